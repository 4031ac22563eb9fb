"""Model adapters over the real diffusers architectures, behind one small interface, plus LoRA."""

from __future__ import annotations

from digenrl.models.base import Cond, GeneratorModel, cat_cond, index_cond, repeat_cond
from digenrl.models.registry import MODEL_NAMES, PRESETS, load_model

__all__ = [
    "Cond",
    "GeneratorModel",
    "MODEL_NAMES",
    "PRESETS",
    "cat_cond",
    "index_cond",
    "load_model",
    "repeat_cond",
]
