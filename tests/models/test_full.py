"""Preset "full": the published architectures at real size on the meta device."""

from __future__ import annotations

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models.full import build_full

# Published transformer sizes (model cards / FEASIBILITY.md §2), in parameters.
PUBLISHED = [("qwenimage", "", 20.43e9), ("flux", "", 11.90e9), ("wan21", "1.3B", 1.42e9), ("wan21", "14B", 14.29e9),
             ("hunyuanvideo", "", 12.82e9)]


@pytest.mark.parametrize("name,variant,size", PUBLISHED, ids=[f"{n}-{v or 'default'}" for n, v, _ in PUBLISHED])
def test_full_transformer_has_the_published_size_on_meta(name: str, variant: str, size: float) -> None:
    full = build_full(name, variant, torch.bfloat16, text_encoders=False)
    params = list(full.transformer.parameters())
    assert abs(sum(p.numel() for p in params) / size - 1) < 0.02
    # no storage anywhere, and every parameter in the configured precision (Wan once kept fp32 norms)
    assert {p.device.type for p in params} == {"meta"}
    assert {p.dtype for p in params} == {torch.bfloat16}


def test_full_text_encoders_and_vae_are_the_published_ones() -> None:
    full = build_full("flux", "", torch.bfloat16)
    sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in full.text_encoders.items()}
    assert abs(sizes["text_encoder"] / 123.06e6 - 1) < 0.01  # CLIP ViT-L/14 text model
    assert abs(sizes["text_encoder_2"] / 4.762e9 - 1) < 0.01  # T5 v1.1 XXL encoder
    assert abs(sum(p.numel() for p in full.vae.parameters()) / 83.8e6 - 1) < 0.01


def test_unknown_variant_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model.variant.*1.3B, 14B"):
        build_full("wan21", "7B")


def test_full_preset_cannot_be_sampled() -> None:
    with pytest.raises(ConfigError, match="model.preset: 'full'"):
        load_model("qwenimage", "full")
