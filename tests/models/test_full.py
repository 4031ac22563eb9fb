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


# SD3.5's checkpoints hold the 2D position table as a tensor besides the parameters (diffusers: a persistent
# buffer), and the published sizes count it: Hugging Face's tensor counts of the released MMDiT files (GGUF
# conversions ND911/stable-diffusion-3.5-medium-GGUF: 2.47B params, ND911/stable-diffusion-3.5-large-GGUF: 8.15B;
# the model cards round them to 2.5 and 8.1 billion). Parameters alone: 2.243 B and 8.057 B.
SD35_PUBLISHED = [("medium", 2.47e9), ("large", 8.15e9)]


@pytest.mark.parametrize("variant,size", SD35_PUBLISHED, ids=[v for v, _ in SD35_PUBLISHED])
def test_sd35_transformer_has_the_published_size_on_meta(variant: str, size: float) -> None:
    full = build_full("sd3", variant, torch.bfloat16, text_encoders=False)
    held = sum(t.numel() for t in full.transformer.state_dict().values())  # what the checkpoint file holds
    assert abs(held / size - 1) < 0.005
    params = list(full.transformer.parameters())
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    # MMDiT-X: Medium's first 13 blocks carry the second (image-only) attention; Large has none
    dual = [i for i, b in enumerate(full.transformer.transformer_blocks) if b.attn2 is not None]
    assert dual == (list(range(13)) if variant == "medium" else [])


def test_sd35_text_encoders_and_vae_are_the_published_ones() -> None:
    full = build_full("sd3", "medium", torch.bfloat16)
    sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in full.text_encoders.items()}
    assert abs(sizes["text_encoder"] / 123.65e6 - 1) < 0.005  # CLIP ViT-L/14 text model with its projection
    assert abs(sizes["text_encoder_2"] / 694.7e6 - 1) < 0.005  # OpenCLIP ViT-bigG/14 text model with projection
    assert abs(sizes["text_encoder_3"] / 4.762e9 - 1) < 0.005  # T5 v1.1 XXL encoder
    assert abs(sum(p.numel() for p in full.vae.parameters()) / 83.8e6 - 1) < 0.005


# Wan2.2, within 0.5%. TI2V-5B: "5B" (Wan-AI/Wan2.2-TI2V-5B model card). A14B: each expert is Wan2.1-T2V-14B's
# architecture, 14.29 B as that checkpoint's transformer (the PUBLISHED wan21 14B entry above); the model card's
# "27B total parameters, 14B active per step" rounds both down: two experts count 28.58 B.
WAN22_PUBLISHED = [("TI2V-5B", 5.0e9, 0.0), ("A14B", 14.29e9, 14.29e9)]


@pytest.mark.parametrize("variant,first,second", WAN22_PUBLISHED, ids=[v for v, _, _ in WAN22_PUBLISHED])
def test_full_wan22_has_the_published_sizes(variant: str, first: float, second: float) -> None:
    full = build_full("wan22", variant, torch.bfloat16, text_encoders=False)
    n1 = sum(p.numel() for p in full.transformer.parameters())
    assert abs(n1 / first - 1) < 0.005
    if second:
        assert full.transformer_2 is not None
        n2 = sum(p.numel() for p in full.transformer_2.parameters())
        assert abs(n2 / second - 1) < 0.005 and n1 == n2  # two experts of one architecture
        assert {p.device.type for p in full.transformer_2.parameters()} == {"meta"}
    else:
        assert full.transformer_2 is None
        assert full.vae.config.z_dim == 48 and full.transformer.config.in_channels == 48
