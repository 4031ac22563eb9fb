"""Transports: bytes and tensors between endpoints, behind one interface (:class:`Transport`).

Use :func:`make_transport` to build one by kind::

    t = make_transport("zmq", "tcp://127.0.0.1:0")      # port 0 picks a free port
    await t.send(peer_address, {"op": "step"}, {"latents": x})
    msg = await t.recv()                                  # Message(src, header, payload)
    await t.aclose()

Kinds: ``inproc`` (same process), ``zmq`` (``ipc://`` / ``tcp://``, shared memory for large
tensors between processes of one host), ``cuda_ipc`` (same-node GPU tensors by IPC handle, zmq
underneath). Device collectives (weights to many rollout actors) go through the communicator seam
instead, :mod:`digenrl.transport.communicator` (gloo) and :mod:`digenrl.transport.nccl`: a group
formed at runtime, not a point-to-point endpoint. Implementation modules are imported lazily so that
a process using only ``inproc`` does not import pyzmq.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digenrl.transport.base import Message, PeerListener, Transport

if TYPE_CHECKING:
    from digenrl.transport.codec import PROTOCOL_VERSION, CodecOptions, decode, encode

__all__ = [
    "PROTOCOL_VERSION",
    "CodecOptions",
    "Message",
    "PeerListener",
    "Transport",
    "decode",
    "encode",
    "make_transport",
    "KINDS",
]

KINDS = ("inproc", "zmq", "cuda_ipc")
_CODEC_NAMES = ("PROTOCOL_VERSION", "CodecOptions", "decode", "encode")


def __getattr__(name: str) -> Any:
    # The codec imports torch (seconds); importing the runtime for an actor that sends no tensor must not.
    if name in _CODEC_NAMES:
        from digenrl.transport import codec

        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_transport(kind: str, address: str | None = None, **options: Any) -> Transport:
    """Build a transport endpoint of ``kind`` bound at ``address``.

    Args:
        kind: one of ``KINDS``.
        address: where to bind. ``inproc://name`` for inproc; ``ipc:///path`` or
            ``tcp://host:port`` for the zmq-based kinds (port 0 picks a free port; ``.address``
            then reports the real one). None picks a fresh inproc name or a private ipc path.
        **options: passed to the implementation's constructor (e.g. ``copy`` for inproc;
            ``hwm``, ``chunk_bytes``, ``shm``, ``heartbeat_s`` for zmq; ``strict`` for cuda_ipc).

    Returns:
        An open endpoint; close it with ``await t.aclose()`` (or ``async with``).

    Raises:
        ValueError: unknown kind or malformed address.
    """
    if kind == "inproc":
        from digenrl.transport.inproc import InprocTransport

        return InprocTransport(address, **options)
    if kind == "zmq":
        from digenrl.transport.zmq import ZmqTransport

        return ZmqTransport(address, **options)
    if kind == "cuda_ipc":
        from digenrl.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(address, **options)
    raise ValueError(f"unknown transport kind {kind!r}; expected one of {KINDS}")
