"""Same-node GPU tensors by CUDA IPC handle; ZeroMQ carries the handles and everything else.

A CUDA tensor in a payload is not copied: the sender exports its storage with
``UntypedStorage._share_cuda_()`` (the mechanism behind ``torch.multiprocessing``), and the
handle tuple travels as plain msgpack values (bytes and ints, never pickled) inside the tensor's
``ref``::

    {"kind": "cuda_ipc", "dev": device, "h": handle, "size": storage_bytes, "soff": storage_offset,
     "stride": [...], "toff": tensor_offset, "rc": refcount_handle, "rco": refcount_offset,
     "ev": event_handle, "evs": event_sync_required}

The receiver opens it with ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which maps
the same device memory (cached per allocation) and joins torch's cross-process reference count,
so the sender's allocation stays alive while the receiver holds the tensor. The tensor the
receiver gets shares memory with the sender's: this is a hand-over, not a copy; the sender must
not write to it afterwards (same contract as ``torch.multiprocessing``).

Fallback: a CPU tensor, or any tensor when CUDA is absent on this side, is *staged through host
memory* (the zmq frame or shared-memory path). A message that stages tensors larger than the
codec's inline threshold emits the named warning ``HostStagingWarning`` (once per call site under
Python's default filter) and adds their count to ``stats["staged"]``; with ``strict=True`` such a
send raises ``ConfigError`` instead (small tensors that ride inline in the header, such as step
counters, are not staging). Only ``ipc://`` and loopback destinations can use handles: CUDA IPC
needs both processes on one node.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from digenrl.errors import ConfigError, ProtocolError
from digenrl.transport import codec
from digenrl.transport.zmq import ZmqTransport, _Peer, _same_host, _tensors

__all__ = ["CudaIpcTransport", "HostStagingWarning", "export_handle", "open_handle"]

log = logging.getLogger(__name__)


class HostStagingWarning(UserWarning):
    """A tensor took the host-memory path instead of the device-direct one."""


def export_handle(t: torch.Tensor) -> dict[str, Any]:
    """The msgpack-able CUDA IPC handle of a CUDA tensor's storage (no pickle)."""
    storage = t.untyped_storage()
    (device, handle, size, soff, rc, rco, ev, evs) = storage._share_cuda_()
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
        super().__init__(address, **kwargs)

    def _make_offload(self, peer: _Peer, payload: Any) -> tuple[Callable[[], None] | None, codec.Offload | None]:
        undo, host_offload = super()._make_offload(peer, payload)
        direct = torch.cuda.is_available() and _same_host(peer.dst)
        inline = self._options.inline_max_bytes
        staged = [t for t in _tensors(payload)
                  if not (direct and t.is_cuda) and t.numel() * t.element_size() > inline]
        if staged:
            self._staged(peer.dst, staged)

        def offload(t: torch.Tensor) -> dict[str, Any] | None:
            if direct and t.is_cuda:
                return export_handle(t)
            return host_offload(t) if host_offload is not None else None

        return undo, offload

    def _staged(self, dst: str, staged: list[torch.Tensor]) -> None:
        what = ", ".join(sorted({f"{t.device.type} {t.dtype}" for t in staged}))
        reason = "CUDA is not available" if not torch.cuda.is_available() else (
            f"{dst} is not on this node" if not _same_host(dst) else "the tensors are not on a GPU")
        if self._strict:
            raise ConfigError(f"transport.cuda_ipc strict=True: {len(staged)} tensor(s) ({what}) would be "
                              f"staged through host memory because {reason}")
        self.stats["staged"] += len(staged)
        warnings.warn(f"cuda_ipc: staging {len(staged)} tensor(s) ({what}) through host memory because {reason}",
                      HostStagingWarning, stacklevel=4)

    def _resolver(self, src: str) -> codec.Resolve:
        host = super()._resolver(src)

        def resolve(dtype: torch.dtype, shape: tuple[int, ...], ref: dict[str, Any]) -> torch.Tensor:
            if ref.get("kind") == "cuda_ipc":
                return open_handle(dtype, shape, ref)
            return host(dtype, shape, ref)

        return resolve
