"""In-process transport: endpoints in one process exchange messages through per-endpoint queues.

Addresses look like ``inproc://name``; a module-level registry maps them to live endpoints, so
any code in the process can send to any open endpoint by address. Every message goes through the
real codec (:mod:`digenrl.transport.codec`), so what fails to encode here fails everywhere.

Ownership, two modes:
  * ``copy=True`` (default): large frames are copied, so a receiver gets its own tensors exactly
    as it would over ZeroMQ and neither side can mutate the other's. The copies land in warm
    pooled buffers (:mod:`digenrl.transport._warm`): a buffer is reused only once every tensor
    the receiver made from it is gone, and a copy into it runs at memcpy speed instead of
    faulting in fresh pages on every send.
  * ``copy=False`` (handoff): the receiver's tensors *are* the sender's (by reference, zero copy,
    next to no cost whatever the size). The sender gives up its payload tensors at ``send``: it
    must neither mutate them nor hand them out again afterwards. For a producer that builds a
    fresh tensor per message (latents, a state-dict snapshot) and drops it after sending.

State machine: OPEN → CLOSED. ``aclose`` removes the address from the registry, wakes every
pending ``recv`` with ``TransportClosed`` and tells the listeners of every endpoint that had sent
to it that the peer is broken. Sends to an address that is not (or no longer) registered raise
``TransportBroken``. The receive queue is unbounded (inproc has no backpressure) and cancel-safe:
a ``recv`` cancelled while waiting leaves every queued message in place.

Messages are delivered on the receiver's event loop (``call_soon_threadsafe`` when the sender
runs on another loop/thread), so endpoints on different threads of one process also work.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from typing import Any, ClassVar

from digenrl.errors import TransportBroken, TransportClosed
from digenrl.transport import _warm, codec
from digenrl.transport.base import Message, Transport

__all__ = ["InprocTransport"]

log = logging.getLogger(__name__)

_REGISTRY: dict[str, InprocTransport] = {}
_COUNTER = itertools.count()
_SCHEME = "inproc://"


class InprocTransport(Transport):
    """An endpoint reachable by other endpoints of the same process.

    Args:
        address: ``inproc://name`` (or just ``name``); None picks a unique one.
        copy: copy large frames into warm pooled buffers (default), so the receiver owns its
            tensors; False hands the sender's tensors over by reference (the sender gives them up).
        options: codec size limits.

    Raises:
        ValueError: the address is already bound in this process.
    """

    kind: ClassVar[str] = "inproc"
    zero_copy: ClassVar[bool] = True
    device_direct: ClassVar[bool] = False
    can_abort: ClassVar[bool] = True

    def __init__(self, address: str | None = None, *, copy: bool = True,
                 options: codec.CodecOptions = codec.DEFAULT_OPTIONS) -> None:
        if address is None:
            address = f"{_SCHEME}ep-{next(_COUNTER)}"
        elif not address.startswith(_SCHEME):
            address = _SCHEME + address
        if address in _REGISTRY:
            raise ValueError(f"inproc address {address!r} is already bound in this process")
        self._address = address
        self._warm = _warm.WarmBuffers() if copy else None
        self._options = options
        self._queue: deque[tuple[str, list[Any]]] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peers: set[str] = set()
        self._closed = False
        _REGISTRY[address] = self

    @property
    def address(self) -> str:
        return self._address

    async def send(self, dst: str, header: dict[str, Any], payload: Any = None) -> None:
        """Encode and enqueue a message on the endpoint at ``dst``.

        Raises:
            TransportClosed: this endpoint was closed.
            TransportBroken: no open endpoint is bound at ``dst`` in this process.
            ProtocolError: the message is over the codec's size limits.
            TypeError: the payload holds something that cannot cross the wire.
        """
        if self._closed:
            raise TransportClosed(f"inproc endpoint {self._address} is closed")
        frames = codec.encode(header, payload, options=self._options)
        if self._warm is not None:
            frames = [frames[0], *(self._warm.copy(f) for f in frames[1:])]
        peer = _REGISTRY.get(dst if dst.startswith(_SCHEME) else _SCHEME + dst)
        if peer is None:
            raise TransportBroken(f"no inproc endpoint is bound at {dst!r} (closed or never opened)")
        self._peers.add(peer.address)
        peer._deliver(self._address, frames)
        self.stats["sent"] += 1

    def _deliver(self, src: str, frames: list[Any]) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop is running or loop.is_closed():
            self._enqueue(src, frames)
        else:
            loop.call_soon_threadsafe(self._enqueue, src, frames)

    def _enqueue(self, src: str, frames: list[Any]) -> None:
        if self._closed:
            return
        self._queue.append((src, frames))
        self._wake()

    def _wake(self) -> None:
        # Wake every waiter: one that was cancelled after waking must not strand the message.
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    async def recv(self) -> Message:
        """Return the next message addressed to this endpoint (FIFO per sender).

        Raises:
            TransportClosed: the endpoint was closed before or while waiting.
        """
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        while not self._queue:
            if self._closed:
                raise TransportClosed(f"inproc endpoint {self._address} is closed")
            fut = self._loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        src, frames = self._queue.popleft()
        header, payload = codec.decode(frames, options=self._options)
        self.stats["received"] += 1
        return Message(src, header, payload)

    async def aclose(self) -> None:
        """Unregister the address, wake pending receivers and tell peers' listeners. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if _REGISTRY.get(self._address) is self:
            del _REGISTRY[self._address]
        self._queue.clear()
        if self._warm is not None:
            self._warm.close()
        self._wake()
        error = TransportBroken(f"inproc peer {self._address} closed")
        for other in list(_REGISTRY.values()):
            if self._address in other._peers:
                other._peers.discard(self._address)
                other._notify_peer_broken(self._address, error)
        log.debug("[shutdown] InprocTransport: closed address=%s", self._address)

    def __repr__(self) -> str:
        return f"InprocTransport({self._address!r}{', closed' if self._closed else ''})"
