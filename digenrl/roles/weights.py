"""Versioned weight publication from trainers to rollout actors.

What travels is the *trainable* state dict (LoRA-only when training LoRA, see
:func:`digenrl.models.lora.trainable_state_dict`), stamped with its ``policy_version``:

* ``pack_buckets`` flattens it into a few flat tensors, one per dtype and at most ``bucket_mb`` each
  (one frame / one collective per bucket instead of one per tensor: FEASIBILITY §5), with a small
  ``[[name, dtype, shape], ...]`` layout; ``unpack_buckets`` inverts it exactly.
* Lanes: ``zmq`` sends the buckets as the arguments of the receivers' ``receive_weights`` control
  endpoint (same host: shared memory, else zero-copy frames); ``torchdist`` broadcasts them with
  :func:`digenrl.transport.torchdist.broadcast_state_dict` (gloo on CPU, NCCL on GPU) inside a group
  the trainer and every rollout actor joined at setup (``DistLane``). ``cuda_ipc`` uses the zmq lane
  over an actor system built on the ``cuda_ipc`` transport (device handles instead of host copies).
* ``WeightStore`` is the receiving side: it keeps the newest ``keep`` versions (two suffice for
  staleness 1: a trajectory started with ``v - 1`` continues after ``v`` arrived) and loads a version
  into the model only when asked, between tokens. A token covers whole denoising steps of
  trajectories that all carry one version, so weights never change inside a trajectory.
* ``state_digest`` is a content hash of what a model actually samples with; tests compare the
  rollout's digest with the trainer's after a publication, so a silent no-op sync cannot pass.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from digenrl.errors import ProtocolError, StalenessViolation
from digenrl.models.lora import load_trainable_state_dict, trainable_state_dict
from digenrl.transport.codec import DTYPES

__all__ = ["pack_buckets", "unpack_buckets", "state_digest", "WeightStore", "DistLane"]

log = logging.getLogger(__name__)
_NAMES = {v: k for k, v in DTYPES.items()}


def pack_buckets(sd: Mapping[str, torch.Tensor], bucket_mb: float = 64.0) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """Flatten ``sd`` into dtype buckets of at most ``bucket_mb`` MiB (a bigger tensor gets its own).

    Returns:
        ``(layout, buckets)``: ``layout[i] = [name, dtype, shape, bucket, offset]``.

    Raises:
        TypeError: a value is not a tensor or has a dtype the codec cannot carry.
    """
    limit = int(bucket_mb * (1 << 20))
    layout: list[list[Any]] = []
    parts: list[list[torch.Tensor]] = []
    sizes: list[int] = []
    open_for: dict[torch.dtype, int] = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _NAMES:
            raise TypeError(f"weight {name!r}: expected a tensor of a codec dtype, got {type(t).__name__}")
        flat = t.detach().reshape(-1).cpu() if t.device.type != "cuda" else t.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        b = open_for.get(t.dtype)
        if b is None or sizes[b] + nbytes > limit:
            b = len(parts)
            parts.append([])
            sizes.append(0)
            open_for[t.dtype] = b
        offset = sum(p.numel() for p in parts[b])
        parts[b].append(flat)
        sizes[b] += nbytes
        layout.append([name, _NAMES[t.dtype], list(t.shape), b, offset])
    return layout, [torch.cat(p) if len(p) > 1 else p[0].clone() for p in parts]


def unpack_buckets(layout: Any, buckets: Any) -> dict[str, torch.Tensor]:
    """Rebuild the state dict packed by :func:`pack_buckets`.

    Raises:
        ProtocolError: a malformed layout or a bucket too short for it (names the entry).
    """
    if not isinstance(layout, list) or not isinstance(buckets, list | tuple):
        raise ProtocolError("weights: layout must be a list and buckets a list of tensors")
    out: dict[str, torch.Tensor] = {}
    for entry in layout:
        if not (isinstance(entry, list | tuple) and len(entry) == 5 and isinstance(entry[0], str)):
            raise ProtocolError(f"weights: malformed layout entry {entry!r:.80}")
        name, dtype, shape, b, offset = entry
        if dtype not in DTYPES or not isinstance(b, int) or not 0 <= b < len(buckets):
            raise ProtocolError(f"weights: entry {name!r} has bad dtype {dtype!r} or bucket {b!r}")
        flat = buckets[b]
        n = 1
        for s in shape:
            n *= int(s)
        if not isinstance(flat, torch.Tensor) or flat.dtype != DTYPES[dtype] or offset < 0 or offset + n > flat.numel():
            raise ProtocolError(f"weights: entry {name!r} does not fit bucket {b}")
        out[name] = flat[offset : offset + n].view(*shape)
    return out


def state_digest(sd: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of ``sd`` in key order (first 16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class WeightStore:
    """The newest ``keep`` published versions on a rollout actor, and the one loaded in the model.

    ``stage`` may run on the event loop (a control endpoint) while the compute thread calls
    ``ensure``; a lock keeps the two apart.

    Args:
        model: the generator whose trainable weights are swapped.
        version: the version the model holds now (its initial weights).
        keep: versions kept (>= 2 for staleness 1).
    """

    def __init__(self, model: Any, version: int = 0, keep: int = 3) -> None:
        self.model = model
        self.keep = max(2, keep)
        self.loaded: int | None = version
        self._versions: dict[int, dict[str, torch.Tensor]] = {version: trainable_state_dict(model)}
        self._lock = threading.Lock()
        self.swaps = 0

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def stage(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        """Keep ``sd`` as ``version``; the oldest versions beyond ``keep`` are dropped."""
        with self._lock:
            self._versions[version] = {k: v.clone() for k, v in sd.items()}
            if version == self.loaded:  # re-published (e.g. after a resume): reload before the next use
                self.loaded = None
            for old in sorted(self._versions)[: -self.keep]:
                if old != self.loaded:
                    del self._versions[old]

    def ensure(self, version: int) -> None:
        """Load ``version`` into the model unless it is loaded already (call between tokens only).

        Raises:
            StalenessViolation: ``version`` was never published here or was already dropped.
        """
        with self._lock:
            if version == self.loaded:
                return
            sd = self._versions.get(version)
            if sd is None:
                raise StalenessViolation(f"policy_version {version} is not on this rollout actor "
                                         f"(has {sorted(self._versions)}); a token asked for a version never published")
            load_trainable_state_dict(self.model, sd)
            self.loaded = version
            self.swaps += 1

    def digest(self, version: int | None = None) -> str:
        """Digest of a stored version's weights (``None``: of the weights the model holds now)."""
        if version is None:
            return state_digest(trainable_state_dict(self.model, copy_tensors=False))
        with self._lock:
            return state_digest(self._versions[version])


class DistLane:
    """torch.distributed lane: the lead trainer (rank 0) broadcasts, rollout actors (ranks 1..n) receive.

    Every member constructs it in ``setup`` with the same ``init_method``; the collective is entered by
    all members for each published version (the coordinator calls ``publish`` on the trainer and
    ``receive`` on each rollout actor together).

    Raises:
        RuntimeError: torch.distributed could not form the group (timeout, port in use).
    """

    def __init__(self, rank: int, world_size: int, init_method: str, backend: str | None = None,
                 timeout_s: float = 120.0) -> None:
        import datetime

        import torch.distributed as dist

        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def broadcast(self, sd: Mapping[str, torch.Tensor] | None, bucket_mb: float) -> dict[str, torch.Tensor]:
        """Enter the bucketed broadcast (source: rank 0). Blocking; run it off the event loop."""
        from digenrl.transport.torchdist import broadcast_state_dict

        return broadcast_state_dict(sd, 0, bucket_mb=bucket_mb)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
