"""Ulysses sequence parallelism (SP) of a generator's transformer(s) over a torch.distributed group.

A video latent outgrows one device per sample (Wan2.1 480x832x81 frames: 32,760 tokens; HunyuanVideo 720p x 129
frames: 118,800). With SP the members of a group (world size = SP degree N) each hold the full weights and the same
inputs; each runs the transformer on 1/N of the tokens, and around every self/joint attention an all-to-all trades
the sequence split for a head split (each member attends over the whole sequence with H/N heads), then back. The
last projection's output is all-gathered, so every member returns the same full velocity.

What runs is diffusers' own context parallelism (``diffusers.hooks.context_parallel``: the split/gather hooks of a
model's ``_cp_plan``; ``attention_dispatch.TemplatedUlyssesAttention``: the all-to-all attention with its backward,
the inverse all-to-all). Checked on gloo against SP = 1, forward *and* backward (``tests/models/
test_sequence_parallel.py``). What digenrl adds (``_sp_plans.py``): a mesh made from the caller's groups (over
the whole world when it holds several SP groups: :func:`dp_sp_mesh`), a plan for HunyuanVideo (diffusers has
none), the checks below, and a way around diffusers' ``enable_parallelism`` dividing by
``torch.accelerator.device_count()``, which is 0 on a CPU-only host.

**Gradients.** The gather's backward hands each member the gradient of its own tokens, and the split's backward is
the slice's: every member's parameter gradient is the part that flows through its 1/N of the tokens (the timestep
and text embedders, computed whole on each member, get the part their member's tokens use). The SP = 1 gradient is
their **sum** over the group: :func:`sync_gradients` after each backward. Gradients with respect to the *inputs*
(not used by digenrl's trainers) are partial in the same way.

**What cannot be split is refused** (:class:`~digenrl.errors.ConfigError` with the numbers): a head count or a split
sequence (image/video tokens; Qwen-Image's and HunyuanVideo's text tokens, split too) that N does not divide.
Padding is not offered: diffusers' padded mode ("Ulysses anything") has no backward, and padded keys would change
Wan's unmasked attention.

Call :func:`parallelize` once, after the trainable mode is set up (``apply_lora`` / ``enable_full_finetune``: a LoRA
wrapper added later around a hooked module would see a gathered input). Never run on a GPU yet: written for NCCL
(each member's tensors on its own device), tested on gloo.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from digenrl.errors import ConfigError

__all__ = ["parallelize", "dp_sp_mesh", "sync_gradients", "sp_group_size", "sp_group", "SP_MODELS"]

SP_MODELS: tuple[str, ...] = ("wan21", "wan22", "hunyuanvideo", "qwenimage")
_GROUP_ATTR = "_digenrl_sp_group"
_BUCKET_BYTES = 64 * 2**20


def parallelize(model: Any, group: dist.ProcessGroup, mesh: Any = None) -> None:
    """Make ``model``'s transformer(s) run sequence-parallel over ``group``; a no-op for a group of size 1.

    Contract: every member of ``group`` calls this with an identical model (same weights) and later calls the
    model with identical inputs; each gets the full, identical output. After a backward, call
    :func:`sync_gradients` on the trained parameters. Both experts of Wan2.2 A14B and the frozen reference copy of
    a fully fine-tuned transformer are parallelized too.

    ``group`` is the whole default world (``mesh = None``), or one of several SP groups of it: then ``mesh`` is the
    world's :func:`dp_sp_mesh` and **every rank of the world** calls this at once, each with its own group and the
    same kind of model (a collective of the world creates every group's flattened group, each under its own name).

    Raises:
        ConfigError: the model is not one of :data:`SP_MODELS`, is already parallel, or its heads or configured
            sequence (``latent_shape``, ``text_len``) are not divisible by the group size; the message gives the
            numbers. A later call with a sequence that does not divide raises the same at forward time.
        ValueError: ``group`` is smaller than the world and ``mesh`` is missing, or is not a (dp, sp) mesh whose
            ``sp`` group is ``group``.
    """
    from digenrl.models._sp_plans import check_sequences, enable_ulysses, transformers_of, ulysses_mesh

    degree = dist.get_world_size(group)
    if degree == 1:
        return
    name = getattr(model, "name", type(model).__name__)
    if name not in SP_MODELS:
        raise ConfigError(f"sequence parallelism: model {name!r} is not supported; supported: {', '.join(SP_MODELS)}")
    if sp_group_size(model) != 1:
        raise ConfigError(f"sequence parallelism: model {name!r} is already parallel over {sp_group_size(model)} ranks")
    modules = transformers_of(model)
    for module in modules:
        check_heads(name, module, degree)
    check_sequences(name, configured_sequences(model), degree, modules[0].config.num_attention_heads)
    device_mesh = ulysses_mesh(group, next(modules[0].parameters()).device.type, mesh)
    for module in modules:
        enable_ulysses(name, module, group, device_mesh)
    setattr(model, _GROUP_ATTR, group)


def dp_sp_mesh(sp: int, device_type: str) -> Any:
    """The default world as a 2-D ``(dp, sp)`` DeviceMesh: SP group ``g`` is ranks ``g*sp .. g*sp + sp - 1``, and
    the data-parallel group of SP rank ``s`` holds rank ``s`` of every SP group. Every rank of the world calls this
    (it creates every group); ``mesh.get_group("sp")`` / ``("dp")`` are this rank's groups.

    Raises:
        ValueError: ``sp`` does not divide the world size.
    """
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(f"a world of {world} ranks does not split into SP groups of {sp}")
    return DeviceMesh(device_type, torch.arange(world).view(world // sp, sp), mesh_dim_names=("dp", "sp"))


def sync_gradients(params: Any, group: dist.ProcessGroup | None) -> None:
    """Sum each parameter's gradient over ``group`` in place, so every member holds the SP = 1 gradient.

    Exact: a member's gradient is the part flowing through its tokens (module docstring), and the parts add up.
    A no-op for ``None`` or a group of size 1. Parameters without a gradient are skipped; all members must pass
    the same parameters in the same order. The gradients travel flattened, in buckets of up to
    ``_BUCKET_BYTES`` of one dtype and device (a full fine-tune's gradients are never copied whole).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for g in (p.grad for p in params if p.grad is not None):
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size >= _BUCKET_BYTES):
            _all_reduce_bucket(bucket, group)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        _all_reduce_bucket(bucket, group)


def _all_reduce_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sp_group_size(model: Any) -> int:
    """The SP degree ``model`` runs with: its group's size, 1 when not parallel."""
    group = getattr(model, _GROUP_ATTR, None)
    return 1 if group is None else dist.get_world_size(group)


def sp_group(model: Any) -> dist.ProcessGroup | None:
    """The group ``model`` was parallelized over (``None`` when not parallel)."""
    return getattr(model, _GROUP_ATTR, None)


def check_heads(name: str, transformer: torch.nn.Module, degree: int) -> None:
    """Raise :class:`ConfigError` unless ``degree`` divides the transformer's attention heads."""
    heads = int(transformer.config.num_attention_heads)
    if heads % degree:
        raise ConfigError(f"sequence parallelism: model {name!r} has {heads} attention heads, not divisible by the "
                          f"SP degree {degree} (Ulysses gives each rank heads/degree); use a degree dividing {heads}")


def configured_sequences(model: Any) -> dict[str, int]:
    """The split sequence lengths of ``model`` at its configured size: latent tokens, and text tokens where split."""
    from digenrl.models._sp_plans import latent_tokens

    tr = model.pipe.transformer
    if model.name == "qwenimage":
        return {"image tokens": int(model.latent_shape[0]), "text tokens (model.text_len)": int(model.text_len)}
    seq = {"latent tokens": latent_tokens(tr, model.latent_shape)}
    if model.name == "hunyuanvideo":
        seq["text tokens (model.text_len)"] = int(model.text_len)
    return seq
