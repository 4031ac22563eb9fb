"""``load_model``: one entry point from a (name, preset) pair to a :class:`GeneratorModel`.

Names: ``qwenimage`` (default), ``qwenimage_edit``, ``flux``, ``wan21``, ``wan22``, ``hunyuanvideo``, ``sd3``.
Presets: ``tiny`` and ``small`` (random init of the real architecture, deterministic in ``seed``), ``pretrained`` (a local
diffusers directory, read strictly offline) and ``random`` (the published architecture at real size with
random weights, built on the device: ``models/_random.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.models.base import GeneratorModel

__all__ = ["MODEL_NAMES", "PRESETS", "TEXT_ENCODERS", "load_model"]

# name -> (module, class); modules are imported lazily because each pulls in diffusers/transformers classes.
_MODELS: dict[str, tuple[str, str]] = {
    "qwenimage": ("digenrl.models.qwenimage", "QwenImageModel"),
    "flux": ("digenrl.models.flux", "FluxModel"),
    "wan21": ("digenrl.models.wan", "WanModel"),
    "hunyuanvideo": ("digenrl.models.hunyuan", "HunyuanVideoModel"),
    "wan22": ("digenrl.models.wan22", "Wan22Model"),
    "sd3": ("digenrl.models.sd3", "SD3Model"),
    "qwenimage_edit": ("digenrl.models.qwenimage_edit", "QwenImageEditModel"),
}
MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)
_IMAGE_MODELS = ("qwenimage", "qwenimage_edit", "flux", "sd3")  # one frame; the others generate videos
# "full": the published architecture at real size on the meta device, no weights (models/full.py);
# the memory plan builds it, nothing can sample with it. "random": the same at real size with random weights.
PRESETS: tuple[str, ...] = ("tiny", "tiny4x", "small", "pretrained", "full", "random")
# preset "random": "model" = the real-size text encoders (random); "random-embeds" = none, seeded random prompt
# features of their shape instead (a 7B text encoder need not exist to time the transformer).
TEXT_ENCODERS: tuple[str, ...] = ("model", "random-embeds")


def load_model(
    name: str,
    preset: str,
    *,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    resolution: tuple[int, int] | None = None,
    num_frames: int | None = None,
    guidance_scale: float | None = None,
    text_len: int | None = None,
    variant: str = "",
    layers: int = 0,
    text_encoder: str = "model",
    experts: dict[str, Any] | None = None,
    image_area: int | None = None,
) -> GeneratorModel:
    """Build or load a generator.

    Args:
        name: one of ``MODEL_NAMES``.
        preset: ``"tiny"``, ``"small"``, ``"pretrained"`` or ``"random"`` (Qwen-Image also ``"tiny4x"``: the tiny
            transformer over a 4x-downsampling VAE, 16 image tokens at 32 px instead of 4).
        path: local diffusers pipeline directory; required for ``"pretrained"``, ignored otherwise.
        device, dtype: where and in which precision the components live (fp32 is the CPU default).
        seed: initialisation seed of the random presets.
        resolution: ``(height, width)`` in pixels; default 64×64 for tiny/small, the model's native
            size for pretrained and random.
        num_frames: video frames (Wan2.1, HunyuanVideo; ``4k+1``); default 1, i.e. an image.
        guidance_scale: CFG scale (Qwen-Image 4.0, Wan 4.5 by default) or guidance-embedding value
            (FLUX 3.5, HunyuanVideo 6.0 by default).
        text_len: fixed prompt-token length of the conditioning.
        variant: the size of a family with several (``"random"``; Wan2.1 ``"1.3B"`` or ``"14B"``;
            SD3.5 ``"medium"`` or ``"large"``; "" = the largest).
        layers: ``"random"`` only: every block stack of the transformer cut to this many blocks (0 = published).
        text_encoder: ``"random"`` only: ``"model"`` or ``"random-embeds"`` (see :data:`TEXT_ENCODERS`).
        image_area: qwenimage_edit only: pixels of each conditioning image (default the output's; ``models/qwenimage_edit.py``).
        experts: Wan2.2 only: ``guidance_scale_2``, ``train_experts``, ``expert_offload`` (``models/wan22.py``).

    Raises:
        ConfigError: unknown name, preset or variant (the message lists the allowed values), a missing or
            incomplete ``path`` for ``"pretrained"``, or ``layers``/``text_encoder`` set for another preset.
    """
    if name not in _MODELS:
        raise ConfigError(f"model.name: unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    if preset == "full":
        raise ConfigError("model.preset: 'full' is the published architecture without weights (for `digenrl plan`); "
                          "train with preset 'pretrained' and model.path, or 'tiny' on a CPU")
    if text_encoder not in TEXT_ENCODERS:
        raise ConfigError(f"model.text_encoder: unknown value {text_encoder!r}; allowed: {', '.join(TEXT_ENCODERS)}")
    if preset != "random" and (layers or text_encoder != "model"):
        key = "model.layers" if layers else "model.text_encoder"
        raise ConfigError(f"{key}: only preset 'random' builds a cut or text-encoder-free model, not {preset!r}")
    if preset == "tiny4x" and name != "qwenimage":
        raise ConfigError(f"model.preset: 'tiny4x' (a 4x-downsampling VAE) exists for qwenimage only, not {name!r}")
    module, cls_name = _MODELS[name]
    cls = getattr(importlib.import_module(module), cls_name)
    kwargs = dict(path=path, device=device, dtype=dtype, seed=seed, resolution=resolution,
                  guidance_scale=guidance_scale, text_len=text_len, variant=variant, layers=layers,
                  text_encoder=text_encoder)
    if experts:
        if name != "wan22":
            raise ConfigError(f"model.{next(iter(experts))}: only wan22 has experts, not {name!r}")
        kwargs.update(experts)
    if image_area is not None:
        if name != "qwenimage_edit":
            raise ConfigError(f"image_area: only qwenimage_edit has conditioning images, not {name!r}")
        kwargs["image_area"] = image_area
    if num_frames is not None:
        if name in _IMAGE_MODELS and num_frames != 1:
            raise ConfigError(f"model.num_frames: {name} is an image model; num_frames must be 1, got {num_frames}")
        if name not in _IMAGE_MODELS:
            kwargs["num_frames"] = num_frames
    return cls.create(preset, **kwargs)
