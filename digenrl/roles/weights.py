"""Versioned weight publication from trainers to rollout actors.

What travels is the *trainable* state dict (LoRA-only when training LoRA, see
:func:`digenrl.models.lora.trainable_state_dict`), stamped with its ``policy_version``:

* ``pack_buckets`` flattens it into a few flat tensors, one per dtype and at most ``bucket_mb`` each
  (one frame / one collective per bucket instead of one per tensor: FEASIBILITY §5), with a small
  ``[[name, dtype, shape], ...]`` layout; ``unpack_buckets`` inverts it exactly.
* Lanes: ``zmq`` sends the buckets as the arguments of the receivers' ``receive_weights`` control
  endpoint (same host: shared memory, else zero-copy frames); ``gloo`` and ``nccl`` broadcast them
  over a :mod:`~digenrl.transport.communicator` group of the lead trainer and the live rollout actors
  (``CommPublisher`` / ``CommReceiver``): only the layout and the group's spec ride the control
  channel. ``cuda_ipc`` uses the zmq lane over an actor system built on the ``cuda_ipc`` transport
  (device handles instead of host copies).
* ``WeightStore`` is the receiving side: it keeps the newest ``keep`` versions (two suffice for
  staleness 1: a trajectory started with ``v - 1`` continues after ``v`` arrived) and loads a version
  into the model only when asked, between tokens. A token covers whole denoising steps of
  trajectories that all carry one version, so weights never change inside a trajectory.
* ``state_digest`` is a content hash of what a model actually samples with; tests compare the
  rollout's digest with the trainer's after a publication, so a silent no-op sync cannot pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from digenrl.errors import ActorDied, ProtocolError, StalenessViolation, TransportBroken
from digenrl.models.lora import load_trainable_state_dict, trainable_state_dict
from digenrl.transport.codec import DTYPES
from digenrl.transport.communicator import GroupHost, GroupSpec, OrderedOps, join_group_async

__all__ = ["pack_buckets", "unpack_buckets", "state_digest", "WeightStore", "CommPublisher", "CommReceiver"]

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

    def held(self, version: int) -> dict[str, torch.Tensor]:
        """The stored weights of ``version`` (read-only: a compressed publication's base).

        Raises:
            StalenessViolation: ``version`` is not stored here.
        """
        with self._lock:
            sd = self._versions.get(version)
        if sd is None:
            raise StalenessViolation(f"a delta against v{version} arrived, but this rollout actor holds "
                                     f"{self.versions}; the trainer must send it in full")
        return sd

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

class CommPublisher:
    """The lead trainer's side of the ``gloo`` / ``nccl`` weight lane.

    Protocol (receivers are actors with two control endpoints, see :class:`CommReceiver`)::

        membership changed?  spec = host.new_group(1 + len(receivers))      # generation g
                             gather(r.join_weights_group(spec, rank) ..., own join as rank 0)
                             replay the newest ``keep`` versions             # a newcomer gets them
        each version v:      seq = next number of generation g
                             gather(r.receive_weights_comm(g, seq, v, layout, sizes) ..., own broadcast)

    The receivers are the live rollout actors the coordinator names at each publication. A new name
    (an actor added mid-run or re-spawned after a kill) or a missing one re-forms the group; the
    replay hands the newcomer the current version (and, for staleness 1, the one before) before the
    coordinator can give it a token. A receiver that dies inside a broadcast breaks the generation:
    its call raises ``ActorDied``, the survivors re-form without it and get the replay.

    Args:
        kind: ``gloo`` or ``nccl``.
        host: the address receivers reach this process's store on (gloo).
        bucket_mb: bucket size (one collective per bucket).
        timeout_s: how long joining and a broadcast may wait for a peer.
        keep: versions replayed to a re-formed group (>= 2 for staleness 1).
        device: this process's CUDA device for ``nccl`` (default: the current one).
    """

    def __init__(self, kind: str, host: str = "127.0.0.1", bucket_mb: float = 64.0, timeout_s: float = 120.0,
                 keep: int = 2, device: torch.device | str | None = None) -> None:
        self.host = GroupHost(kind, host, timeout_s)
        self.device = device
        self.bucket_mb, self.keep = bucket_mb, max(1, keep)
        self.members: list[str] = []
        self.ops: OrderedOps | None = None
        self.recent: dict[int, tuple[list[list[Any]], list[torch.Tensor]]] = {}
        self.formations = 0
        self._seq = 0
        self._form_lock = asyncio.Lock()

    async def publish(self, version: int, sd: Mapping[str, torch.Tensor], receivers: Mapping[str, Any]) -> dict[str, Any]:
        """Broadcast ``version`` to ``receivers`` (name -> actor ref), re-forming the group if they changed.

        Returns:
            ``{"bytes", "failed", "generation"}``: ``failed`` names receivers found dead (the
            others got ``version`` in a group re-formed without them).

        Raises:
            TransportBroken: the broadcast failed and no receiver was found dead (a timeout).
        """
        layout, buckets = pack_buckets(sd, self.bucket_mb)
        self.recent[version] = (layout, buckets)
        for old in sorted(self.recent)[: -self.keep]:
            del self.recent[old]
        out = await self._until_done(receivers, lambda alive: self._publish_once(version, layout, buckets, alive))
        out["bytes"] = sum(b.numel() * b.element_size() for b in buckets)
        return out

    async def admit(self, receivers: Mapping[str, Any]) -> dict[str, Any]:
        """Make ``receivers`` the group now (no new version): a newcomer gets the newest versions.

        Call it when a rollout actor joins (or is re-spawned), before giving it a token.
        Returns ``{"failed", "generation"}`` as :meth:`publish`.
        """
        return await self._until_done(receivers, self._admit_once)

    async def _until_done(self, receivers: Mapping[str, Any],
                          attempt: Callable[[Mapping[str, Any]], Awaitable[list[str]]]) -> dict[str, Any]:
        failed: list[str] = []
        while True:
            alive = {n: r for n, r in receivers.items() if n not in failed}
            dead = await attempt(alive)
            if not dead:
                return {"failed": failed, "generation": self.ops.generation if self.ops is not None else -1}
            log.warning("weights: receivers %s died during a group operation; re-forming the group without them", dead)
            failed += dead

    async def _admit_once(self, alive: Mapping[str, Any]) -> list[str]:
        async with self._form_lock:
            return await self._match(alive) or []

    async def _publish_once(self, version: int, layout: list[list[Any]], buckets: list[torch.Tensor],
                            alive: Mapping[str, Any]) -> list[str]:
        async with self._form_lock:
            dead = await self._match(alive)
            if dead is not None:
                return dead  # a new generation's replay carried `version` too (or nobody is left)
            assert self.ops is not None
            ops, seq = self.ops, self._take_seq()
        return await self._broadcast(ops, seq, version, layout, buckets, alive)

    async def _match(self, alive: Mapping[str, Any]) -> list[str] | None:
        """Under the form lock: leave when no receiver is alive, re-form when the members changed (the
        replay hands everyone the newest versions); the receivers found dead then. None: the group is current."""
        if not alive:
            self._leave()
            return []
        if self.ops is None or list(alive) != self.members:
            return await self._form(alive)
        return None

    def _take_seq(self) -> int:
        # Numbered synchronously, so concurrent publications get their numbers in call order.
        seq, self._seq = self._seq, self._seq + 1
        return seq

    async def _form(self, alive: Mapping[str, Any]) -> list[str]:
        self._leave()
        spec = self.host.new_group(1 + len(alive))
        wire = spec.to_wire()
        calls = [asyncio.ensure_future(ref.join_weights_group.call(wire, rank))
                 for rank, ref in enumerate(alive.values(), 1)]
        own = asyncio.ensure_future(join_group_async(spec, 0, self.device))
        dead = await _together(own, calls, list(alive))
        if dead:
            if own.done() and not own.cancelled() and own.exception() is None:
                own.result().close()
            return dead
        self.ops, self.members, self._seq = OrderedOps(own.result()), list(alive), 0
        self.formations += 1
        log.info("weights: group generation %d formed with %s", spec.generation, self.members)
        for v in sorted(self.recent):
            dead = await self._broadcast(self.ops, self._take_seq(), v, *self.recent[v], alive)
            if dead:
                return dead
        return []

    async def _broadcast(self, ops: OrderedOps, seq: int, version: int, layout: list[list[Any]],
                         buckets: list[torch.Tensor], alive: Mapping[str, Any]) -> list[str]:
        sizes = [[_NAMES[b.dtype], b.numel()] for b in buckets]
        bufs = [b.to(ops.comm.device).contiguous() for b in buckets]
        calls = [asyncio.ensure_future(ref.receive_weights_comm.call(ops.generation, seq, version, layout, sizes))
                 for ref in alive.values()]
        own = asyncio.ensure_future(ops.run(seq, lambda: ops.comm.broadcast(bufs, 0)))
        dead = await _together(own, calls, list(alive))
        if dead and self.ops is ops:
            self._leave()
        return dead

    def _leave(self) -> None:
        if self.ops is not None:
            self.ops.close()
        self.ops, self.members = None, []

    def close(self) -> None:
        """Leave the group and close the store."""
        self._leave()
        self.host.close()


async def _together(own: asyncio.Future[Any], calls: list[asyncio.Future[Any]], names: list[str]) -> list[str]:
    """Wait for this member's operation and the receivers' calls; returns the receivers found dead.

    On a failure it does not wait for survivors stuck in the broken collective (they are released
    by the next generation's join): it waits only until the dead receiver's ``ActorDied`` arrives.

    Raises:
        TransportBroken / RemoteError: the operation failed and no receiver died.
    """
    pending: set[asyncio.Future[Any]] = {own, *calls}
    failure: BaseException | None = None
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        dead = [n for n, c in zip(names, calls, strict=True) if c.done() and isinstance(c.exception(), ActorDied)]
        errors = [f.exception() for f in done if f.exception() is not None]
        failure = failure or next(iter(errors), None)
        if dead:
            for f in pending:
                f.cancel()
            return dead
    if failure is not None:
        raise failure if isinstance(failure, Exception) else TransportBroken(str(failure))
    return []


class CommReceiver:
    """A rollout actor's side of the ``gloo`` / ``nccl`` weight lane (see :class:`CommPublisher`).

    ``join`` and ``receive`` back two *control* endpoints, so a broadcast proceeds while the actor
    computes, and a new generation's join is never queued behind a broadcast stuck in a broken one.
    Received versions are staged into ``store`` in the publisher's order (on the group's thread).

    Args:
        store: the actor's weight store (anything with ``versions`` and ``stage(version, sd)``).
        device: this process's CUDA device for ``nccl`` (default: the current one).
    """

    def __init__(self, store: Any, device: torch.device | str | None = None) -> None:
        self.store = store
        self.device = device
        self.ops: OrderedOps | None = None
        self.log: list[int] = []  # versions received, in order (for tests and weights_info)

    async def join(self, wire: Any, rank: int) -> int:
        """Join the generation ``wire`` describes as ``rank``; leaves the previous one. Returns the generation."""
        spec = GroupSpec.from_wire(wire)
        comm = await join_group_async(spec, rank, self.device)
        if self.ops is not None and self.ops.generation >= spec.generation:
            comm.close()  # a join that finished after a newer generation's: never step back
            raise ProtocolError(f"group generation {spec.generation} is older than this actor's {self.ops.generation}")
        old, self.ops = self.ops, OrderedOps(comm)
        if old is not None:
            old.close()
        return spec.generation

    async def receive(self, generation: int, seq: int, version: int, layout: Any, sizes: Any) -> int:
        """Enter broadcast ``seq`` of ``generation`` and stage ``version`` from it.

        Raises:
            ProtocolError: not a member of ``generation`` (a stale publication), or bad sizes.
            TransportBroken: the broadcast failed (a peer died).
        """
        ops = self.ops
        if ops is None or ops.generation != generation:
            raise ProtocolError(f"weights v{version} were published to group generation {generation}, but this "
                                f"actor is in {'no group' if ops is None else f'generation {ops.generation}'}")
        bufs = [torch.empty(n, dtype=DTYPES[d], device=ops.comm.device) for d, n in _sizes(sizes)]

        def op() -> None:
            ops.comm.broadcast(bufs, 0)
            if version not in self.store.versions:  # a replay to a re-formed group: already here
                self.store.stage(version, unpack_buckets(layout, bufs))
            self.log.append(version)

        await ops.run(seq, op)
        return version

    def close(self) -> None:
        if self.ops is not None:
            self.ops.close()
            self.ops = None


def _sizes(sizes: Any) -> list[tuple[str, int]]:
    if not isinstance(sizes, list) or not all(
            isinstance(s, list | tuple) and len(s) == 2 and s[0] in DTYPES and isinstance(s[1], int) and 0 <= s[1] < 1 << 48
            for s in sizes):
        raise ProtocolError(f"weights: bucket sizes must be [[dtype, numel], ...], got {sizes!r:.80}")
    return [(s[0], s[1]) for s in sizes]
