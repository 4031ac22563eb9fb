"""How each family's transformer is split for Ulysses SP: the mesh, the plans, the checks at forward time.

diffusers does the work (``ModelMixin.enable_parallelism`` with a ``ContextParallelConfig``): its hooks split the
inputs named in the plan along the sequence and all-gather the output, and every attention processor that has a
``_parallel_config`` runs ``TemplatedUlyssesAttention``. This module gives it what it lacks here:

* a ``DeviceMesh`` made from the caller's groups (``DeviceMesh.from_group``). The mesh is ``(dp, ring = 1,
  ulysses = N)`` over the whole world; the size-1 ring dimension is never used by Ulysses, and since a group of one
  cannot be made without a collective over the whole world it carries the SP group. It covers the whole world
  because diffusers flattens ``(ring, ulysses)`` into a new group (``DeviceMesh._flatten``), and ``new_group`` is a
  collective of the whole world that names groups by a counter: a mesh of one SP group alone makes every group's
  flattened group under the same name, and two groups' connections cross. Over the whole mesh, every rank creates
  every SP group's flattened group, in the same order, each under its own name;
* a plan for HunyuanVideo, which diffusers has none for: the latent and text streams are split at the first
  block, the RoPE tables with them, the output gathered after ``proj_out``; and the joint attention mask
  ``[B, 1, 1, latent + text]``, built inside the forward for the whole sequence, is replaced in every block by
  the member's own ``[latent part, text part]`` (the layout of its local tokens; diffusers all-gathers it to the
  layout of the keys after the all-to-all);
* a check before each forward that the group divides the sequences it splits (ConfigError with the numbers:
  diffusers would stop at a bare ``assert``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from digenrl.errors import ConfigError

__all__ = ["enable_ulysses", "ulysses_mesh", "transformers_of", "latent_tokens", "check_sequences"]


def transformers_of(model: Any) -> list[torch.nn.Module]:
    """Every transformer of ``model`` that runs: Wan2.2's experts (both, trained or not), else the one transformer,
    and the frozen reference copy of a fully fine-tuned one (its experts too). Each module once."""
    from digenrl.models.lora import reference_transformer, trainable_mode

    found: list[torch.nn.Module] = []
    names = getattr(model, "experts", ("transformer",))
    for name in names:
        found.append(model.expert(name) if hasattr(model, "expert") else model.pipe.transformer)
    ref = reference_transformer(model) if trainable_mode(model) is not None else None
    if ref is not None:
        found.extend(ref.children() if not hasattr(ref, "config") else [ref])
    unique: dict[int, torch.nn.Module] = {id(m): m for m in found}
    return list(unique.values())


def latent_tokens(transformer: torch.nn.Module, latent_shape: tuple[int, ...]) -> int:
    """Tokens of a video latent ``(C, F, H, W)`` after the transformer's patch embedding."""
    cfg = transformer.config
    if isinstance(cfg.patch_size, (tuple, list)):  # Wan: (t, h, w)
        pt, ph, pw = cfg.patch_size
    else:  # HunyuanVideo: spatial patch_size, temporal patch_size_t
        pt, ph, pw = cfg.patch_size_t, cfg.patch_size, cfg.patch_size
    _, f, h, w = latent_shape[-4:]
    return (f // pt) * (h // ph) * (w // pw)


def ulysses_mesh(group: dist.ProcessGroup, device_type: str, mesh: Any = None) -> Any:
    """The ``(dp, ring = 1, ulysses = N)`` DeviceMesh of SP group ``group`` (module docstring).

    ``mesh``: the world's ``(dp, sp)`` DeviceMesh whose ``sp`` group is ``group``; ``None`` when ``group`` is the
    whole world (one SP group, ``dp = 1``).
    """
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    if mesh is None:
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"sequence parallelism over ranks {ranks} of a world of {dist.get_world_size()}: a group "
                             "smaller than the world needs the world's (dp, sp) mesh (parallelize(..., mesh=...))")
        return DeviceMesh.from_group([group, group, group], device_type, mesh=torch.tensor(ranks).view(1, 1, -1),
                                     mesh_dim_names=("dp", "ring", "ulysses"))
    if mesh.mesh_dim_names != ("dp", "sp") or mesh.get_group("sp").group_name != group.group_name:
        raise ValueError(f"the mesh {mesh} must be a (dp, sp) DeviceMesh whose sp group is ranks {ranks}")
    dp, sp = mesh.shape
    return DeviceMesh.from_group([mesh.get_group("dp"), group, group], device_type, mesh=mesh.mesh.view(dp, 1, sp),
                                 mesh_dim_names=("dp", "ring", "ulysses"))


@contextlib.contextmanager
def _accelerator_count_nonzero() -> Iterator[None]:
    """diffusers' ``_resolve_parallel_config`` picks ``rank % torch.accelerator.device_count()``: on a CPU-only
    host that count is 0 (ZeroDivisionError). The device it picks is not used by a CPU mesh; say 1 for the call."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda *_: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = real  # type: ignore[assignment]


def enable_ulysses(name: str, transformer: torch.nn.Module, group: dist.ProcessGroup, mesh: Any) -> None:
    """Turn on diffusers' Ulysses context parallelism for one transformer over ``group``, with digenrl's checks.

    ``mesh``: :func:`ulysses_mesh`'s, the same for every transformer of a model (its flattened group made once).
    """
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ulysses_degree=dist.get_world_size(group), mesh=mesh)
    plan = None
    if name == "hunyuanvideo":
        plan = hunyuan_plan(transformer)
        _hook_hunyuan_mask(transformer, group)
    transformer.register_forward_pre_hook(_sequence_check(name, dist.get_world_size(group)), with_kwargs=True)
    with _accelerator_count_nonzero():
        transformer.enable_parallelism(config=config, cp_plan=plan)


def _sequence_check(name: str, degree: int) -> Any:
    """A forward pre-hook raising ConfigError when ``degree`` does not divide a sequence this call would split."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        text = kwargs.get("encoder_hidden_states")
        if x is None:
            return
        if x.dim() == 5:
            seq = {"latent tokens": latent_tokens(module, tuple(x.shape))}
        else:
            seq = {"image tokens": int(x.shape[1])}
        if name in ("qwenimage", "hunyuanvideo") and text is not None:
            seq["text tokens"] = int(text.shape[1])
        check_sequences(name, seq, degree, int(module.config.num_attention_heads))

    return hook


def hunyuan_plan(transformer: torch.nn.Module) -> dict[str, Any]:
    """The context-parallel plan of ``HunyuanVideoTransformer3DModel`` (module docstring)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    first = "transformer_blocks.0" if len(transformer.transformer_blocks) else "single_transformer_blocks.0"
    seq = ContextParallelInput(split_dim=1, expected_dims=3)
    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
    return {
        "rope": {0: rope, 1: rope},
        first: {"hidden_states": seq, "encoder_hidden_states": seq},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _hook_hunyuan_mask(transformer: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Give every HunyuanVideo block the mask of its member's own ``[latent, text]`` tokens (module docstring)."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    state: dict[str, int] = {}

    def remember(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        state["latent"] = latent_tokens(module, tuple(x.shape))

    def local_mask(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        index = 3  # (hidden_states, encoder_hidden_states, temb, attention_mask, ...) as the forward passes them
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else args[index]
        latent = state["latent"]  # the forward builds one mask for the whole sequence and hands it to every block
        if mask is None:
            return args, kwargs
        parts = (mask[..., :latent], mask[..., latent:])
        mask = torch.cat([p.chunk(degree, dim=-1)[rank] for p in parts], dim=-1).contiguous()
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = mask
        else:
            args = args[:index] + (mask,) + args[index + 1:]
        return args, kwargs

    transformer.register_forward_pre_hook(remember, with_kwargs=True)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        block.register_forward_pre_hook(local_mask, with_kwargs=True)


def check_sequences(name: str, sequences: dict[str, int], degree: int, heads: int) -> None:
    """Raise :class:`ConfigError` unless ``degree`` divides every split sequence (``{"image tokens": 16, ...}``)."""
    for what, length in sequences.items():
        if length % degree:
            raise ConfigError(f"sequence parallelism: model {name!r} ({heads} heads) splits {length} {what} over "
                              f"SP degree {degree}, and {length} is not a multiple of {degree}; change the "
                              f"resolution, frame count or text length, or the degree")
