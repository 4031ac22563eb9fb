"""Same-node GPU tensors by CUDA IPC handle; ZeroMQ carries the handles and everything else.

A CUDA tensor in a payload is not copied: the sender exports its storage with
``UntypedStorage._share_cuda_()`` (the mechanism behind ``torch.multiprocessing``), and the
handle tuple travels as plain msgpack values (bytes and ints, never pickled) inside the tensor's
``ref``::

    {"kind": "cuda_ipc", "dev": device, "h": handle, "size": storage_bytes, "soff": storage_offset,
     "stride": [...], "toff": tensor_offset, "rc": refcount_handle, "rco": refcount_offset,
     "ev": event_handle, "evs": event_sync_required, "id": ledger_id}

The receiver opens it with ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which maps
the same device memory (cached per allocation). The tensor the receiver gets shares memory with the
sender's: this is a hand-over, not a copy; the sender must not write to it afterwards (same contract
as ``torch.multiprocessing``).

Producer stream: ``_share_cuda_`` records a CUDA event on the sending thread's current stream (the
``ev`` handle, ``evs`` = event sync required) and ``rebuild_cuda_tensor`` makes the receiver's current
stream wait on it (``cudaIpcOpenEventHandle`` + ``cudaStreamWaitEvent``), so the receiver never reads
before the producer's kernels finished. A producer that wrote the tensor on a side stream makes the
current stream wait for it (``torch.cuda.current_stream().wait_stream(side)``) before sending.

Release, reference counted end to end (torch's own counter, ``rc``/``rco``, only delays reuse of
the block inside the sender's caching allocator; torch asks senders to keep shared tensors alive
while receivers use them): each handle carries an ``id``; the sender's :class:`IpcLedger` holds a
reference to the exported tensor per receiver until that receiver acknowledges it. The receiver's
:class:`AckBatcher` watches the tensor it opened (``weakref.finalize``: views keep their base alive,
so it fires when the last view is gone) and sends ``{"__ipc_ack__": [ids]}`` back, batched per loop
turn. Acks never reach ``recv()``. A receiver that dies releases everything held for it; counters:
``stats["ipc_held"]`` (now), ``stats["ipc_exported"]``, ``stats["ipc_released"]``.

Fallback: a CPU tensor, or any tensor when CUDA is absent on this side or the peer is on another
host (:func:`ipc_route`), is *staged through host memory* (the zmq frame or shared-memory path). A
message that stages tensors larger than the codec's inline threshold is logged (once per destination
and reason at WARNING), emits the named warning ``HostStagingWarning`` and adds their count to
``stats["staged"]``; with ``strict=True`` such a send raises ``ConfigError`` instead (small tensors
that ride inline in the header, such as step counters, are not staging). Only ``ipc://`` and loopback
destinations can use handles: CUDA IPC needs both processes on one node.

GPU coverage: ``export_handle`` / ``open_handle`` between two processes ran once, on an H200
(``tests/transport/test_cuda_ipc.py``); ``tests/transport/test_conformance.py::TestCudaIpc`` (marked gpu)
now sends CUDA tensors between two endpoints of one process (the cache entry of ``export_handle``),
which has not run on a GPU yet. The protocol (ids, acks, ledger, death, route decision, staging
counter) is tested on the CPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from digenrl.errors import ConfigError, ProtocolError, TransportBroken
from digenrl.transport import codec
from digenrl.transport.zmq import ZmqTransport, _Peer, _same_host, _tensors

__all__ = ["AckBatcher", "CudaIpcTransport", "HostStagingWarning", "IpcLedger", "export_handle", "ipc_route",
           "open_handle"]

ACK = "__ipc_ack__"  # header key of an acknowledgement (a transport message, never delivered)

log = logging.getLogger(__name__)


class HostStagingWarning(UserWarning):
    """A tensor took the host-memory path instead of the device-direct one."""


def export_handle(t: torch.Tensor) -> dict[str, Any]:
    """The msgpack-able CUDA IPC handle of a CUDA tensor's storage (no pickle).

    The storage is also entered in torch's cache of opened handles under the key ``open_handle``
    looks up: CUDA refuses to open an IPC handle in the process that exported it, so a receiver in
    this process (two endpoints of one process) gets the storage itself from the cache, as torch's
    own ``rebuild_cuda_tensor`` does for a handle it opened before.
    """
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    storage = t.untyped_storage()
    (device, handle, size, soff, rc, rco, ev, evs) = storage._share_cuda_()
    shared_cache[(handle, soff)] = StorageWeakRef(storage)
    return {"kind": "cuda_ipc", "dev": int(device), "h": bytes(handle), "size": int(size), "soff": int(soff),
            "stride": list(t.stride()), "toff": int(t.storage_offset()), "rc": bytes(rc), "rco": int(rco),
            "ev": None if ev is None else bytes(ev), "evs": bool(evs)}


def open_handle(dtype: torch.dtype, shape: tuple[int, ...], ref: dict[str, Any]) -> torch.Tensor:
    """Map a tensor exported by :func:`export_handle` in another process of this node.

    Raises:
        ProtocolError: the handle is malformed, or CUDA is not available here.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        dev, h, size, soff = ref["dev"], ref["h"], ref["size"], ref["soff"]
        stride, toff, rc, rco, ev, evs = ref["stride"], ref["toff"], ref["rc"], ref["rco"], ref["ev"], ref["evs"]
    except KeyError as exc:
        raise ProtocolError(f"cuda_ipc handle lacks field {exc.args[0]!r}") from None
    ints_ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (dev, size, soff, toff, rco))
    if not (ints_ok and isinstance(h, bytes) and isinstance(rc, bytes) and isinstance(stride, list)
            and len(stride) == len(shape) and all(isinstance(s, int) for s in stride)):
        raise ProtocolError(f"cuda_ipc handle has fields of the wrong type: {sorted(ref)}")
    if not torch.cuda.is_available():
        raise ProtocolError("received a cuda_ipc handle, but CUDA is not available in this process")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(stride), toff, torch.UntypedStorage,
                               dtype, dev, h, size, soff, False, rc, rco, ev, evs)


def ipc_route(is_cuda: bool, cuda_here: bool, same_host: bool) -> str | None:
    """``None`` when a tensor can go by handle, else why it is staged through host memory."""
    if not cuda_here:
        return "CUDA is not available"
    if not same_host:
        return "the peer is not on this node"
    if not is_cuda:
        return "the tensors are not on a GPU"
    return None


class IpcLedger:
    """Sender side: each exported tensor stays referenced until its receiver acknowledges it.

    Not thread-safe: the transport uses it on its event loop only.
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[int, Any]] = {}
        self._next = 0
        self.exported = 0
        self.released = 0
        self.unknown_acks = 0

    def hold(self, peer: str, tensor: Any) -> int:
        """Keep ``tensor`` for ``peer``; returns the id its handle carries."""
        ident, self._next = self._next, self._next + 1
        self._held.setdefault(peer, {})[ident] = tensor
        self.exported += 1
        return ident

    def release(self, peer: str, ids: Any) -> int:
        """Drop what ``peer`` acknowledged; returns how many were held. Unknown ids are counted, not fatal
        (a late ack after ``forget``)."""
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ProtocolError(f"cuda_ipc ack from {peer} must be a list of ints, got {ids!r:.60}")
        held = self._held.get(peer, {})
        n = 0
        for i in ids:
            if held.pop(i, None) is None:
                self.unknown_acks += 1
            else:
                n += 1
        if not held:
            self._held.pop(peer, None)
        self.released += n
        return n

    def forget(self, peer: str) -> int:
        """``peer`` died: release everything held for it; returns how many."""
        n = len(self._held.pop(peer, {}))
        self.released += n
        return n

    @property
    def held(self) -> int:
        return sum(len(v) for v in self._held.values())

    def held_for(self, peer: str) -> int:
        return len(self._held.get(peer, {}))


class AckBatcher:
    """Receiver side: acknowledges an opened handle when the tensor mapped from it is gone.

    ``watch`` attaches a finalizer to the tensor; the finalizer may run on any thread (the garbage
    collector's), so ids are queued under a lock and ``flush`` is requested through ``schedule`` (the
    transport passes ``loop.call_soon_threadsafe``), which sends one ack per source.

    Args:
        send: ``send(src, ids)``, called by ``flush`` on the loop.
        schedule: ``schedule(callback)`` runs ``callback`` soon on the loop.
    """

    def __init__(self, send: Callable[[str, list[int]], None], schedule: Callable[[Callable[[], None]], Any]) -> None:
        self._send = send
        self._schedule = schedule
        self._pending: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.watched = 0

    def watch(self, tensor: Any, src: str, ident: int) -> None:
        self.watched += 1
        weakref.finalize(tensor, self._done, src, ident)

    def _done(self, src: str, ident: int) -> None:
        with self._lock:
            first = not self._pending
            self._pending.setdefault(src, []).append(ident)
        if first:
            try:
                self._schedule(self.flush)
            except RuntimeError:  # the loop is closed: the sender forgets us when we are gone
                pass

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for src, ids in pending.items():
            self._send(src, ids)


class CudaIpcTransport(ZmqTransport):
    """A ZeroMQ endpoint that hands CUDA tensors to same-node peers by IPC handle.

    Args:
        address: as for :class:`~digenrl.transport.zmq.ZmqTransport` (use ``ipc://``).
        strict: raise instead of staging a tensor through host memory.
        **kwargs: passed to ``ZmqTransport``.

    Raises:
        ConfigError: ``strict=True`` and CUDA is not available.
    """

    kind: ClassVar[str] = "cuda_ipc"
    device_direct: ClassVar[bool] = True

    def __init__(self, address: str | None = None, *, strict: bool = False, **kwargs: Any) -> None:
        if strict and not torch.cuda.is_available():
            raise ConfigError("transport.cuda_ipc strict=True needs CUDA, but torch.cuda.is_available() is False")
        self._strict = strict
        self.ledger = IpcLedger()
        self._acks: AckBatcher | None = None  # made on the loop, at the first handle received
        self._ack_tasks: set[asyncio.Task[None]] = set()
        self._warned: set[tuple[str, str]] = set()
        super().__init__(address, **kwargs)
        self.stats.update(ipc_held=0, ipc_exported=0, ipc_released=0)

    # -- sending ---------------------------------------------------------------------------------
    def _make_offload(self, peer: _Peer, payload: Any) -> tuple[Callable[[], None] | None, codec.Offload | None]:
        undo, host_offload = super()._make_offload(peer, payload)
        same = _same_host(peer.dst)
        cuda = torch.cuda.is_available()
        inline = self._options.inline_max_bytes
        staged = [(t, why) for t in _tensors(payload) if (why := ipc_route(t.is_cuda, cuda, same)) is not None
                  and t.numel() * t.element_size() > inline]
        if staged:
            self._staged(peer.dst, [t for t, _ in staged], staged[0][1])

        def offload(t: torch.Tensor) -> dict[str, Any] | None:
            if ipc_route(t.is_cuda, cuda, same) is None:
                ref = export_handle(t)
                ref["id"] = self.ledger.hold(peer.dst, t)  # released by the receiver's ack
                self._count()
                return ref
            return host_offload(t) if host_offload is not None else None

        return undo, offload

    def _staged(self, dst: str, staged: list[torch.Tensor], reason: str) -> None:
        what = ", ".join(sorted({f"{t.device.type} {t.dtype}" for t in staged}))
        if self._strict:
            raise ConfigError(f"transport.cuda_ipc strict=True: {len(staged)} tensor(s) ({what}) would be "
                              f"staged through host memory because {reason}")
        self.stats["staged"] += len(staged)
        if (dst, reason) not in self._warned:  # the counter keeps counting; the log says it once
            self._warned.add((dst, reason))
            log.warning("cuda_ipc: staging tensors to %s through host memory because %s (counted in "
                        "stats['staged']; strict=True refuses instead)", dst, reason)
        warnings.warn(f"cuda_ipc: staging {len(staged)} tensor(s) ({what}) through host memory because {reason}",
                      HostStagingWarning, stacklevel=4)

    def _count(self) -> None:
        self.stats.update(ipc_held=self.ledger.held, ipc_exported=self.ledger.exported,
                          ipc_released=self.ledger.released)

    # -- receiving -------------------------------------------------------------------------------
    def _resolver(self, src: str) -> codec.Resolve:
        host = super()._resolver(src)

        def resolve(dtype: torch.dtype, shape: tuple[int, ...], ref: dict[str, Any]) -> torch.Tensor:
            if ref.get("kind") == "cuda_ipc":
                ident = ref.get("id")
                if not isinstance(ident, int) or isinstance(ident, bool):
                    raise ProtocolError("cuda_ipc handle lacks its integer 'id'")
                t = open_handle(dtype, shape, ref)
                self._batcher().watch(t, src, ident)
                return t
            return host(dtype, shape, ref)

        return resolve

    def _batcher(self) -> AckBatcher:
        if self._acks is None:
            loop = asyncio.get_running_loop()  # decoding runs on the transport's loop
            self._acks = AckBatcher(self._send_ack, loop.call_soon_threadsafe)
        return self._acks

    def _send_ack(self, src: str, ids: list[int]) -> None:
        if self._closed:
            return
        task = asyncio.ensure_future(self._ack(src, ids))
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _ack(self, src: str, ids: list[int]) -> None:
        try:
            await self.send(src, {ACK: ids})
        except (TransportBroken, ConfigError) as exc:  # the sender is gone: nothing is held for us there
            log.debug("cuda_ipc: ack of %d handle(s) to %s not sent: %s", len(ids), src, exc)

    def _enqueue(self, msg: Any) -> None:
        if msg is not None and isinstance(msg.header, dict) and ACK in msg.header:
            try:
                self.ledger.release(msg.src, msg.header[ACK])
            except ProtocolError as exc:
                self.drops(msg.src, exc.reason, exc)
            self._count()
            return
        super()._enqueue(msg)

    def _mark_broken(self, peer: _Peer, err: TransportBroken) -> None:
        if self.ledger.forget(peer.dst):
            log.info("cuda_ipc: %s is gone; released the handles it held", peer.dst)
            self._count()
        super()._mark_broken(peer, err)
