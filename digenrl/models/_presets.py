"""The pipeline a model preset names and the sizes it defaults to, for every adapter's ``create``.

``pretrained``: a local diffusers directory, loaded offline; ``random``: the published architecture with
random weights (``models/_random.py``); any other preset: the adapter's own tiny/small build. The two real
presets share their defaults (the published resolution and text length); the built ones run at 64 px.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from digenrl.models._common import load_pipeline_offline, to_device_dtype
from digenrl.models._random import build_random_pipeline

__all__ = ["REAL_PRESETS", "preset_pipeline", "preset_size"]

REAL_PRESETS: tuple[str, ...] = ("pretrained", "random")
_BUILT_HW = (64, 64)


def preset_pipeline(name: str, preset: str, pipeline_cls: type, scheduler: Callable[[], Any], build: Callable[[], Any],
                    *, path: str | Path | None, device: str | torch.device, dtype: torch.dtype, seed: int,
                    variant: str = "", layers: int = 0, text_encoder: str = "model",
                    pipeline_kwargs: dict[str, Any] | None = None) -> Any:
    """``preset``'s pipeline of model ``name`` on ``device`` in ``dtype``.

    ``scheduler()``: the adapter's stock scheduler for ``random``; ``build()``: its tiny/small pipeline (both
    called only for their preset). ``variant``, ``layers``, ``text_encoder``, ``pipeline_kwargs``: ``random``'s
    (``build_random_pipeline``).

    Raises:
        ConfigError: a missing or incomplete weights directory, an unknown variant or preset (as the builders say).
    """
    if preset == "pretrained":
        return load_pipeline_offline(pipeline_cls, path, dtype, device)
    if preset == "random":
        return build_random_pipeline(name, scheduler(), pipeline_kwargs=pipeline_kwargs, variant=variant,
                                     layers=layers, text_encoder=text_encoder, device=device, dtype=dtype, seed=seed)
    return to_device_dtype(build(), device, dtype)


def preset_size(preset: str, resolution: tuple[int, int] | None, text_len: int | None,
                real: tuple[tuple[int, int], int], built_text_len: int) -> tuple[int, int, int]:
    """``(height, width, text_len)``: the ones given, else ``real`` ``((height, width), text_len)`` for the real
    presets and 64 px with ``built_text_len`` tokens for the built ones."""
    hw, length = real if preset in REAL_PRESETS else (_BUILT_HW, built_text_len)
    h, w = resolution or hw
    return h, w, text_len or length
