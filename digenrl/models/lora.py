"""What is trained, and how the reference model is obtained: LoRA via peft, or full fine-tuning.

Two modes, chosen once per model:

* :func:`apply_lora` wraps the per-model default projections (ALGORITHM.md (b)) with peft LoRA
  adapters. ``lora_B`` starts at zero, so the policy equals the reference at step 0 (KL = 0, ratio = 1).
  The reference forward disables the adapter (no second copy of the weights). Sampling
  (:func:`sampling`) runs with the adapters merged into float32 base weights, restored exactly after.
* :func:`enable_full_finetune` makes every transformer parameter trainable and keeps a frozen
  deep copy as the reference (what flow_grpo does under FSDP).

Weight sync and checkpoints use the same small state dict: :func:`trainable_state_dict` (LoRA-only in
LoRA mode) / :func:`load_trainable_state_dict`, and on disk :func:`save_trainable` /
:func:`load_trainable` (safetensors). Loading is strict: missing, unexpected or mis-shaped keys are an
error naming them, never a silent partial load (FEASIBILITY §3 gotcha 3).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.models._common import seeded

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "apply_lora",
    "enable_full_finetune",
    "trainable_mode",
    "trainable_parameters",
    "trainable_state_dict",
    "load_trainable_state_dict",
    "reference",
    "reference_transformer",
    "sampling",
    "save_trainable",
    "load_trainable",
]

_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
_JOINT_ATTN = _ATTN + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

# Per-model default LoRA targets (suffixes of module names), after the reference configs:
# Qwen-Image "attention + img_mlp + txt_mlp", FLUX "attention + ff + ff_context" (flow_grpo),
# Wan2.1 "attention" (self- and cross-attention), HunyuanVideo as FLUX (same MMDiT block layout).
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "qwenimage": _JOINT_ATTN + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    "qwenimage_edit": _JOINT_ATTN + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    "flux": _JOINT_ATTN + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
    "wan21": _ATTN,
    "wan22": _ATTN,  # as Wan2.1, on each trained expert
    "hunyuanvideo": _JOINT_ATTN + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
    # flow_grpo scripts/train_sd3.py: the joint attention of both streams, named "attn.*" so that SD3.5-M's
    # second (image-only) attention "attn2" stays frozen
    "sd3": tuple(f"attn.{t}" for t in _JOINT_ATTN),
}

_MODE_ATTR = "_digenrl_trainable_mode"
_REF_ATTR = "_digenrl_reference_transformer"
_LAYERS_ATTR = "_digenrl_lora_layers"  # the adapter layers, found once: sampling() runs per rollout token


def trainable_mode(model: Any) -> str | None:
    """``"lora"``, ``"full"``, or ``None`` when neither :func:`apply_lora` nor :func:`enable_full_finetune` ran."""
    return getattr(model.transformer, _MODE_ATTR, None)


def apply_lora(
    model: Any,
    *,
    rank: int = 8,
    alpha: float | None = None,
    target_modules: Sequence[str] | None = None,
    init: str = "gaussian",
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """Freeze the transformer and add a peft LoRA adapter; returns the trainable (LoRA) parameters.

    Args:
        model: a generator adapter (anything with ``.transformer`` and ``.name``).
        rank: LoRA rank ``r``.
        alpha: LoRA alpha; default ``2 * rank`` (the reference configs use α = 2r).
        target_modules: module-name suffixes to wrap; default ``DEFAULT_LORA_TARGETS[model.name]``.
        init: peft ``init_lora_weights`` ("gaussian" as flow_grpo; B = 0 in every peft init).
        seed: seed of the random ``lora_A`` init, so replicas built with the same seed agree.

    Raises:
        ConfigError: bad rank, the model already has a trainable mode, or no module matches.
    """
    from peft import LoraConfig

    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"lora.rank must be a positive int, got {rank!r}")
    tr = model.transformer
    if trainable_mode(model) is not None:
        raise ConfigError(f"model {model.name!r} is already set up for {trainable_mode(model)!r} training")
    targets = list(target_modules) if target_modules is not None else list(DEFAULT_LORA_TARGETS.get(model.name, _ATTN))
    names = [n for n, _ in tr.named_modules()]
    if not any(n == t or n.endswith("." + t) for t in targets for n in names):
        raise ConfigError(f"lora.target_modules: none of {targets} matches a module of {type(tr).__name__}")
    tr.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, init_lora_weights=init,
                     target_modules=targets)
    with seeded(seed):
        tr.add_adapter(cfg)
    setattr(tr, _MODE_ATTR, "lora")
    setattr(tr, _LAYERS_ATTR, _lora_layers(tr))
    return trainable_parameters(model)


def _lora_layers(module: torch.nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def enable_full_finetune(model: Any) -> list[torch.nn.Parameter]:
    """Make every transformer parameter trainable; a frozen deep copy becomes the reference.

    Raises:
        ConfigError: the model already has a trainable mode.
    """
    if trainable_mode(model) is not None:
        raise ConfigError(f"model {model.name!r} is already set up for {trainable_mode(model)!r} training")
    tr = model.transformer
    ref = copy.deepcopy(tr).requires_grad_(False).eval()
    tr.requires_grad_(True)
    setattr(tr, _MODE_ATTR, "full")
    setattr(tr, _REF_ATTR, [ref])  # a list, so the copy is not registered as a submodule of tr
    return trainable_parameters(model)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters the optimizer should update, in a stable (module) order.

    Raises:
        ConfigError: no trainable mode was set up.
    """
    mode = _require_mode(model)
    if mode == "lora":
        return [p for n, p in model.transformer.named_parameters() if "lora_" in n]
    return list(model.transformer.parameters())


def trainable_state_dict(model: Any, *, copy_tensors: bool = True) -> dict[str, torch.Tensor]:
    """The trained weights: LoRA tensors only in LoRA mode, the whole transformer otherwise.

    Args:
        copy_tensors: detach *and clone* (default), so the dict stays valid across optimizer steps;
            ``False`` returns detached views sharing storage with the live parameters.

    Raises:
        ConfigError: no trainable mode was set up.
    """
    mode = _require_mode(model)
    tr = model.transformer
    if mode == "lora":
        from peft.utils import get_peft_model_state_dict

        sd = get_peft_model_state_dict(tr)
    else:
        sd = tr.state_dict()
    return {k: (v.detach().clone() if copy_tensors else v.detach()) for k, v in sd.items()}


def load_trainable_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` (from :func:`trainable_state_dict` of an identically set-up model) in place.

    Raises:
        ConfigError: no trainable mode was set up.
        ValueError: keys missing or unexpected, or a shape differs; the message names them.
    """
    own = trainable_state_dict(model, copy_tensors=False)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"trainable state dict mismatch: missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {unexpected[:5]} ({len(unexpected)})")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state_dict[k].shape)]
    if bad:
        k = bad[0]
        raise ValueError(f"trainable state dict shape mismatch at {k!r}: expected {tuple(own[k].shape)}, "
                         f"got {tuple(state_dict[k].shape)} ({len(bad)} keys differ)")
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for k, dst in own.items():
            src = state_dict[k].to(device=dst.device, dtype=dst.dtype)
            if isinstance(dst, DTensor) and not isinstance(src, DTensor):  # FSDP: its own shard of the full tensor
                src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None)
            dst.copy_(src)


def reference_transformer(model: Any) -> torch.nn.Module | None:
    """The frozen reference copy of a fully fine-tuned transformer (``None`` in LoRA mode: no copy)."""
    return getattr(model.transformer, _REF_ATTR, [None])[0]


@contextlib.contextmanager
def reference(model: Any) -> Iterator[Any]:
    """Within the block, ``model`` computes the reference (pre-training) velocity, under ``no_grad``.

    LoRA mode disables the adapter and afterwards re-enables it and restores every parameter's
    ``requires_grad`` exactly (peft's ``disable_adapters`` clears it on the LoRA weights). Full mode
    swaps in the frozen copy for the block. Without a trainable mode the model is its own reference.
    """
    mode = trainable_mode(model)
    tr = model.transformer
    if mode is None:
        with torch.no_grad():
            yield model
        return
    if mode == "full":
        ref = getattr(tr, _REF_ATTR)[0]
        model.transformer = ref
        try:
            with torch.no_grad():
                yield model
        finally:
            model.transformer = tr
        return
    flags = [(p, p.requires_grad) for p in tr.parameters()]
    tr.disable_adapters()
    try:
        with torch.no_grad():
            yield model
    finally:
        tr.enable_adapters()
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def sampling(model: Any) -> Iterator[Any]:
    """Within the block, ``model`` samples (no gradients) with its LoRA adapters merged into the base weights.

    An unmerged adapter adds two small matmuls per target module: 35% of the tiny Qwen-Image's
    forward (128 samples, 1 thread: 80 ms unmerged, 52 ms merged; velocity equal within 1e-6
    relative). Only float32 weights are merged: in bf16/fp16 the merged weight's rounding would
    swallow small LoRA updates (a rollout/trainer mismatch), so those models sample unmerged. The
    base weights are copied before the merge and written back after, bit for bit (peft's
    merge/unmerge alone drifts by rounding). Full fine-tuning and models without LoRA: a no-op.
    """
    layers = []
    if trainable_mode(model) == "lora":
        layers = [layer for layer in getattr(model.transformer, _LAYERS_ATTR) if not layer.merged]
    bases = [layer.get_base_layer() for layer in layers]
    if any(base.weight.dtype != torch.float32 for base in bases):
        layers, bases = [], []
    with torch.no_grad():
        saved = [base.weight.detach().clone() for base in bases]
        for layer in layers:
            layer.merge()
        try:
            yield model
        finally:
            for layer, base, weight in zip(layers, bases, saved, strict=True):
                base.weight.copy_(weight)
                layer.merged_adapters.clear()  # what peft's unmerge() ends with, without recomputing the delta


def save_trainable(model: Any, path: str | Path) -> None:
    """Write :func:`trainable_state_dict` to ``path`` as safetensors (with the mode in the metadata)."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in trainable_state_dict(model).items()}
    save_file(sd, str(path), metadata={"digenrl_mode": _require_mode(model), "model": str(model.name)})


def load_trainable(model: Any, path: str | Path) -> None:
    """Read a file written by :func:`save_trainable` into ``model``.

    Raises:
        ConfigError: ``path`` does not exist, or was saved from another mode.
        ValueError: key or shape mismatch (see :func:`load_trainable_state_dict`).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"trainable weights file {str(p)!r} does not exist")
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    mode = _require_mode(model)
    if meta.get("digenrl_mode", mode) != mode:
        raise ConfigError(f"{str(p)!r} holds {meta['digenrl_mode']!r} weights but the model is set up for {mode!r}")
    load_trainable_state_dict(model, load_file(str(p)))


def _require_mode(model: Any) -> str:
    mode = trainable_mode(model)
    if mode is None:
        raise ConfigError(f"model {getattr(model, 'name', '?')!r} has no trainable mode; call apply_lora or "
                          "enable_full_finetune first")
    return mode
