"""The one interface every transport implements.

A transport is an *endpoint*: it has an ``address`` that peers send to, a ``send`` that delivers a
small msgpack-able header plus a payload to another endpoint's address, and a ``recv`` that yields
messages in arrival order (FIFO per sender). The payload is any nesting of dict/list/tuple, str, int,
float, bool, None, bytes and ``torch.Tensor`` (a state dict, a batch of latents, call arguments);
the codec sends its tensors as raw frames, never pickled. Which implementation serves a link is a config choice
(``inproc``, ``zmq``, ``cuda_ipc``); the actor runtime sees only this interface.

Contract (checked by ``tests/transport/test_conformance.py`` for every implementation):
  * messages from one sender arrive in the order they were sent;
  * tensors arrive bit for bit (dtype, shape, values), whatever their size;
  * ``aclose()`` wakes a pending ``recv`` with ``TransportClosed``;
  * cancelling a pending ``recv`` loses no message: the next ``recv`` returns it;
  * a send to, or a pending exchange with, a peer that died raises ``TransportBroken``.

Beyond the four abstract members every transport has two concrete helpers:
  * ``add_peer_listener(fn)`` -> remover: ``fn(peer_address, TransportBroken)`` runs on the event
    loop when a peer this endpoint has sent to is found dead (the actor runtime fails the calls
    pending on that peer with it);
  * ``stats``: counters ``sent``, ``received``, ``dropped`` (malformed input from a peer: logged
    and skipped, never raised to the receiver) with ``dropped/<reason>`` per reason, ``staged``
    (device tensors that took the host path), plus implementation-specific ones (zmq: ``shm_fallback``);
  * ``drops(src, reason, detail)``: count and log one dropped message, rate-limited per peer
    (:class:`~digenrl.transport._drops.DropLog`); the actor runtime reports the input it rejects
    there too, so one endpoint has one set of counts.

Zero copy cuts both ways: a sender must not mutate a payload tensor until ``send`` returned, and
on ``inproc`` with ``copy=False`` the receiver's tensors alias the sender's.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from digenrl.errors import TransportBroken
from digenrl.transport._drops import DropLog

__all__ = ["Message", "PeerListener", "Transport"]

log = logging.getLogger(__name__)

# Called with (peer_address, error) when a peer this endpoint talks to is found dead.
PeerListener = Callable[[str, TransportBroken], None]


@dataclass(slots=True)
class Message:
    """One received message: who sent it, its msgpack-able header and its payload (tensors inside)."""

    src: str
    header: dict[str, Any]
    payload: Any = None


class Transport(abc.ABC):
    """An addressable endpoint that sends and receives ``Message``s.

    Capability flags (after Ray's compiled-graph channel contract):
      zero_copy: large CPU tensors cross without a host copy on the send side.
      device_direct: CUDA tensors cross without staging through host memory.
      can_abort: a pending ``send`` can be cancelled without corrupting the link.
    """

    kind: ClassVar[str]
    zero_copy: ClassVar[bool] = False
    device_direct: ClassVar[bool] = False
    can_abort: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this endpoint (e.g. ``inproc://rollout-0``, ``tcp://127.0.0.1:5555``)."""

    @abc.abstractmethod
    async def send(self, dst: str, header: dict[str, Any], payload: Any = None) -> None:
        """Deliver ``header`` and ``payload`` to the endpoint at ``dst``.

        Raises:
            TransportClosed: this endpoint was closed.
            TransportBroken: the peer at ``dst`` is gone.
            ProtocolError: the message is over the size limits.
        """

    @abc.abstractmethod
    async def recv(self) -> Message:
        """Wait for the next message addressed to this endpoint.

        Raises:
            TransportClosed: this endpoint was closed (also wakes a pending call).
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the endpoint and release its sockets/buffers. Idempotent."""

    # ---- peer-death notification (concrete, shared by every implementation) -----------------------

    def add_peer_listener(self, listener: PeerListener) -> Callable[[], None]:
        """Call ``listener(peer, error)`` whenever a peer this endpoint sent to is found dead.

        The actor runtime uses this to fail the futures of calls pending on that peer with the
        ``TransportBroken`` passed in. Listeners run on the event loop and must not block.

        Returns:
            A function that removes the listener.
        """
        listeners: list[PeerListener] = self.__dict__.setdefault("_peer_listeners", [])
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    def _notify_peer_broken(self, peer: str, error: TransportBroken) -> None:
        for listener in list(self.__dict__.get("_peer_listeners", ())):
            try:
                listener(peer, error)
            except Exception:  # a buggy listener must not stop the others or the IO task
                log.exception("peer listener %r failed for peer %s", listener, peer)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``sent``, ``received``, ``dropped`` (malformed input), ``staged`` (host fallbacks)."""
        return self.__dict__.setdefault("_stats", {"sent": 0, "received": 0, "dropped": 0, "staged": 0})

    @property
    def drops(self) -> DropLog:
        """Counts dropped input into ``stats`` and logs it, rate-limited per peer."""
        drops = self.__dict__.get("_drops")
        if drops is None:
            drops = self.__dict__["_drops"] = DropLog(log, f"{self.kind} endpoint {self.address}", self.stats)
        return drops

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
