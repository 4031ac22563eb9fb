"""The trainer group: a run's trainer actors as one torch.distributed process group.

Formation (the recipe does it when it spawns the trainers, and again on every resume, so a resumed
run always gets a fresh store on a fresh port)::

    address = await lead.open_group.call(world)                 # TCPStore on a free port of its host
    await gather(t.connect.call(..., group={"rank": r, "world_size": world, "address": address}))

``TrainerGroup.join`` hands that store to ``init_process_group(store=...)``: no environment variables,
no ``MASTER_ADDR`` to set. Backend gloo on CPU, NCCL on CUDA (same code, another backend).

Gradients (``train.shard``, see :func:`resolve_shard`):

* ``ddp``: every trainer holds the whole trainable set; at the optimizer step the accumulated
  gradients are summed by :func:`all_reduce_buckets` (flattened into ``bucket_mb`` buckets, one
  ``all_reduce`` each). Not ``DistributedDataParallel``: a step accumulates over several TRAIN tokens
  per trainer, their number differs between trainers (they carve work off one queue), and DDP needs
  equal backward counts; one bucketed reduce at the step needs nothing of the sort.
* ``fsdp``: FSDP2 (:func:`shard_model`: ``fully_shard`` per transformer block, then the root) with a
  ``MixedPrecisionPolicy`` (bf16 compute, fp32 master weights and reduction). Forward and backward
  are collectives, so every rank runs every TRAIN token on its slice of the rows (the coordinator
  fans tokens out, see :func:`row_share`), and publication / checkpoints gather the full tensors
  parameter by parameter (:func:`gathered_state_dict`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from digenrl.errors import ConfigError, TransportBroken
from digenrl.transport.gloo_iface import gloo_env

__all__ = ["SHARD_MODES", "TrainerGroup", "resolve_shard", "all_reduce_buckets", "shard_model", "row_share",
           "gathered_state_dict", "open_store", "group_backend"]

log = logging.getLogger(__name__)

SHARD_MODES = ("auto", "none", "ddp", "fsdp")


def resolve_shard(shard: str, finetune: str, world: int) -> str:
    """The effective sharding of a trainer group of ``world`` trainers.

    ``auto``: one trainer needs none; LoRA (a small trainable set every trainer can hold) is ``ddp``;
    full fine-tuning with several trainers is ``fsdp`` (weights + grads + Adam of a 12-20B model do
    not fit one GPU).

    Raises:
        ConfigError: an unknown mode, or ``ddp``/``fsdp`` asked of a single trainer.
    """
    if shard not in SHARD_MODES:
        raise ConfigError(f"train.shard: {shard!r} is not allowed; allowed: {', '.join(map(repr, SHARD_MODES))}")
    if shard == "auto":
        if world == 1:
            return "none"
        return "fsdp" if finetune == "full" else "ddp"
    if shard == "none" and world > 1:
        raise ConfigError(f"train.shard = 'none' with placement.trainer = {world}: several trainers must share their "
                          "gradients; use 'auto', 'ddp' or 'fsdp'")
    return shard


def group_backend(device: str) -> str:
    """NCCL for CUDA trainers, gloo otherwise."""
    return "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"


def open_store(host: str, world: int, timeout_s: float) -> Any:
    """The rendezvous of a group: a TCPStore server on a free port of ``host`` (the lead trainer's)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class TrainerGroup:
    """This process's membership of the trainer group (the default torch.distributed group).

    Args:
        rank: this trainer's rank (the lead is 0).
        world_size: trainers in the group.
        address: ``host:port`` of the lead's store.
        backend: ``gloo`` or ``nccl``.
        timeout_s: how long a collective (and the rendezvous) may wait for a peer.
        store: the lead's own store (from :func:`open_store`); the others connect to ``address``.
        label: what the group is, for errors (a rollout actor's sequence-parallel group forms the same way).

    Raises:
        RuntimeError: the group could not form within ``timeout_s`` (a trainer never joined).
    """

    def __init__(self, rank: int, world_size: int, address: str, backend: str, timeout_s: float,
                 store: Any = None, label: str = "trainer group") -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group; a trainer joins exactly one")
        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        what = f"{label} rank {rank} of {world_size} (rendezvous {address})"
        # gloo: listen where the other trainers reach this host (gloo_iface), not where its name resolves.
        listen = gloo_env(host, what) if backend == "gloo" else contextlib.nullcontext()
        chosen = None
        try:
            with listen as chosen:
                if store is None:
                    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError / gloo's are RuntimeErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            where = f", listening on {chosen}" if chosen is not None else ""
            raise TransportBroken(f"{what}{where}: the group did not form: {first}") from None
        self.rank, self.world_size, self.backend, self.store = rank, world_size, backend, store

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[int]]:
    """Indices of ``tensors`` grouped by dtype (and device) into runs of at most ``bucket_bytes``."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.dtype, t.device), []).append(i)
    for indices in by_kind.values():
        current: list[int] = []
        size = 0
        for i in indices:
            n = tensors[i].numel() * tensors[i].element_size()
            if current and size + n > bucket_bytes:
                yield current
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            yield current


def all_reduce_buckets(tensors: Sequence[torch.Tensor], bucket_mb: float = 64.0, group: Any = None) -> int:
    """Sum ``tensors`` in place over the group: flattened into dtype buckets, one ``all_reduce`` each.

    Every rank calls it with tensors of the same shapes in the same order. Returns the collectives run.
    """
    import torch.distributed as dist

    calls = 0
    for idx in _buckets(tensors, max(1, int(bucket_mb * (1 << 20)))):
        if len(idx) == 1:
            dist.all_reduce(tensors[idx[0]], group=group)
        else:
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
            dist.all_reduce(flat, group=group)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                offset += n
        calls += 1
    return calls


def row_share(start: int, end: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous slice of rows ``[start, end)`` (shares differ by at most one row)."""
    n = end - start
    lo = start + rank * n // world
    return lo, start + (rank + 1) * n // world


def shard_model(model: Any, fp32_master: bool) -> None:
    """FSDP2 on ``model.transformer``: ``fully_shard`` on each transformer block, then on the root.

    FSDP averages the gradients over the group as it reduce-scatters them (gloo has no pre-scaled
    sum to turn that off), so the step divides by ``rows / world`` rather than ``rows``.
    A bf16/fp16 model with ``fp32_master`` keeps fp32 sharded parameters (the master weights, which
    the optimizer updates) and computes in the model's dtype, reducing gradients in fp32. The frozen
    full-fine-tune reference copy is sharded the same way (it is as large as the policy).

    Raises:
        ConfigError: the transformer has no list of blocks to shard.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from digenrl.models.experts import ExpertSet
    from digenrl.models.lora import reference_transformer

    tr = model.transformer
    dtype = next(tr.parameters()).dtype
    policy = MixedPrecisionPolicy()
    if fp32_master and dtype in (torch.bfloat16, torch.float16):
        tr.to(torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for module in [tr, reference_transformer(model)]:
        if module is None:
            continue
        # An ExpertSet (Wan2.2 A14B) has no forward of its own: each expert is a root, whose hooks gather its
        # embeddings and heads when the adapter calls it on its rows.
        for root in list(module.children()) if isinstance(module, ExpertSet) else [module]:
            blocks = [b for name in _BLOCK_LISTS for b in getattr(root, name, [])]
            if not blocks:
                raise ConfigError(f"train.shard = 'fsdp': {type(root).__name__} has none of the block lists "
                                  f"{_BLOCK_LISTS} to shard; use train.shard = 'ddp'")
            for block in blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(root, mp_policy=policy)


# The transformer block lists of the supported diffusers models (Qwen-Image, Wan: transformer_blocks /
# blocks; FLUX and HunyuanVideo add single_transformer_blocks / single_blocks).
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "single_blocks", "token_refiner")


def gathered_state_dict(sd: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Full CPU tensors of a (possibly sharded) state dict, gathered one tensor at a time.

    Every rank of the group must call it (each ``full_tensor`` is an all-gather); ranks with
    ``keep = False`` drop each gathered tensor at once, so only the caller that needs the state (the
    lead: publication, checkpoints) ever holds a full copy, in host memory.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out
