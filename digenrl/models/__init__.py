"""Model adapters over the real diffusers architectures, behind one small interface, plus LoRA.

``load_model(name, preset)`` returns a :class:`GeneratorModel`; :mod:`digenrl.models.lora` decides what
is trained (LoRA or full) and provides the reference forward and the weight-sync state dict.
"""

from __future__ import annotations

from digenrl.models.base import Cond, GeneratorModel, cat_cond, cond_to, decode_in_chunks, index_cond, repeat_cond
from digenrl.models.lora import (
    DEFAULT_LORA_TARGETS,
    apply_lora,
    enable_full_finetune,
    load_trainable,
    load_trainable_state_dict,
    reference,
    sampling,
    save_trainable,
    trainable_mode,
    trainable_parameters,
    trainable_state_dict,
)
from digenrl.models.registry import MODEL_NAMES, PRESETS, load_model

__all__ = [
    "Cond",
    "DEFAULT_LORA_TARGETS",
    "GeneratorModel",
    "MODEL_NAMES",
    "PRESETS",
    "apply_lora",
    "cat_cond",
    "cond_to",
    "decode_in_chunks",
    "enable_full_finetune",
    "index_cond",
    "load_model",
    "load_trainable",
    "load_trainable_state_dict",
    "reference",
    "repeat_cond",
    "sampling",
    "save_trainable",
    "trainable_mode",
    "trainable_parameters",
    "trainable_state_dict",
]
