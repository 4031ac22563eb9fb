"""The generator a run trains, built from its config: one builder for the colocated loop and the actors.

:func:`build_model` makes the configured diffusers generator (random tiny/small preset or local
pretrained weights), applies the toy VAE init where asked and makes LoRA adapters (or every
parameter, for full fine-tuning) trainable. Every process of a run builds it the same way from the
same seed, so the rollout actors, trainers and the colocated loop start from identical weights.
"""

from __future__ import annotations

import threading

import torch

from digenrl.config import Config
from digenrl.models import GeneratorModel, load_model
from digenrl.models._toy import toy_signal_init
from digenrl.models.lora import apply_lora, enable_full_finetune

__all__ = ["build_model", "trained_steps"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BUILD_LOCK = threading.Lock()


def build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    """The generator with its trainable parameters, built exactly as the colocated recipe builds it."""
    # diffusers' lazy imports are not thread-safe: in-process actors build their models one at a time.
    with _BUILD_LOCK:
        return _build_model(cfg)


def _build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    m = cfg.model
    model = load_model(m.name, m.preset, path=m.path or None, device=m.device, dtype=_DTYPES[m.dtype], seed=m.seed,
                       resolution=(m.resolution[0], m.resolution[1]),
                       num_frames=m.num_frames if m.name in ("wan21", "hunyuanvideo") else None,
                       guidance_scale=m.guidance_scale, text_len=m.text_len or None)
    if m.vae_init == "signal":  # random toy presets: make pixels depend on the latent and the prompt
        toy_signal_init(model, seed=m.seed + 3)
    if m.finetune == "lora":
        params = apply_lora(model, rank=m.lora_rank, alpha=m.lora_alpha, seed=m.seed,
                            target_modules=m.lora_targets or None)
    else:
        params = enable_full_finetune(model)
    return model, params


def trained_steps(cfg: Config) -> int:
    """Transitions trained per sample (|T|) under ``rollout.steps``."""
    ro = cfg.rollout
    if ro.steps == "window":
        return ro.window
    if ro.steps == "fraction":
        return max(1, round(ro.fraction * (ro.num_steps - 1)))
    return ro.num_steps - 1
