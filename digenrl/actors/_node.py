"""A node: one transport endpoint, the actors it hosts, and the calls it has in flight.

Every process of a system runs one ``Node`` (the driver's ``ActorSystem`` and each worker or
actor process). Two background tasks serve it:

* the **router** reads the transport and dispatches: calls to the hosted actors' mailboxes,
  replies to pending futures, pings answered at once (never queued behind actor work), bad input
  dropped and counted in the transport's ``drops`` (rate-limited warnings per peer; a call we can
  name is also answered with an error);
* **senders**, one short-lived task per destination with messages queued, drain that
  destination's queue in order, so a ``tell`` followed by a ``call`` to the same actor arrives in
  that order, and a slow or unreachable destination (a connect timeout, a spoofed reply address)
  delays only its own messages. Messages to this node's own address (in-process actors) are
  dispatched directly without the codec, so their arguments pass by reference.

Death: ``mark_dead(address, reason)`` fails every call pending on that address with
``ActorDied`` and makes later calls fail at once. It is fed by the supervisor (process sentinel,
heartbeat loss, a ``dead`` notice from the system) and by the transport's peer listener.
Background-task failures are never silent: they fail every pending call and are logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from digenrl.actors import _wire
from digenrl.actors._context import current_node
from digenrl.actors._mailbox import ActorHost
from digenrl.actors.base import Actor, ActorRef, decode_refs, encode_refs
from digenrl.errors import ActorDied, ProtocolError, TransportBroken, TransportClosed
from digenrl.transport.base import Message, Transport

__all__ = ["Node"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    address: str
    actor: str
    method: str


@dataclass(slots=True)
class _Out:
    dst: str
    header: dict[str, Any]
    payload: Any
    on_error: Callable[[BaseException], None] | None


class Node:
    """One transport endpoint plus the actors hosted on it and the calls it has in flight.

    Args:
        transport: an open transport; the node owns it and closes it in ``aclose``.
        name: a label for logs.
    """

    def __init__(self, transport: Transport, *, name: str) -> None:
        self.transport = transport
        self.name = name
        self.address = transport.address
        self.hosts: dict[str, ActorHost] = {}
        self.last_heard: dict[str, float] = {}
        self.dead: dict[str, str] = {}
        # Peers asked to exit (their reply to "shutdown" may race their disconnect): leaving is not news.
        self.leaving: set[str] = set()
        self.trusted: set[str] = set()  # addresses whose ``dead`` notices we believe (the system)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._queues: dict[str, collections.deque[_Out]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._remove_listener: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start the router task (on the running loop, in this node's context)."""
        self._remove_listener = self.transport.add_peer_listener(self._on_peer_broken)
        # Endpoint code runs in tasks spawned from the router, so refs it builds find this node.
        ctx = contextvars.copy_context()
        ctx.run(current_node.set, self)
        task = asyncio.create_task(self._route(), name=f"digenrl-{self.name}-router", context=ctx)
        task.add_done_callback(self._on_task_done)
        self._tasks.append(task)

    # -- calling out -----------------------------------------------------------------------------
    def call(self, ref: ActorRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Queue a call to ``ref.method`` and return the future of its reply."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._closed:
            fut.set_exception(TransportClosed(f"node {self.name} is closed; cannot call {ref.name}.{method}"))
            return fut
        if ref.address in self.dead:
            fut.set_exception(ActorDied(ref.name, self.dead[ref.address]))
            return fut
        call_id = next(self._ids)
        self._pending[call_id] = _Pending(fut, ref.address, ref.name, method)
        fut.add_done_callback(lambda f: self._call_done(call_id, ref, f))
        header = {"k": "call", "i": call_id, "to": ref.name, "m": method}
        self._enqueue(_Out(ref.address, header, [args, kwargs], lambda e: self._call_failed(call_id, e)))
        return fut

    def tell(self, ref: ActorRef[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Queue a one-way call to ``ref.method``.

        Raises:
            ActorDied: the actor is known to be dead.
            TransportClosed: this node is closed.
        """
        if self._closed:
            raise TransportClosed(f"node {self.name} is closed; cannot tell {ref.name}.{method}")
        if ref.address in self.dead:
            raise ActorDied(ref.name, self.dead[ref.address])

        def failed(exc: BaseException) -> None:
            log.warning("tell %s.%s to %s failed: %s", ref.name, method, ref.address, exc)

        header = {"k": "tell", "to": ref.name, "m": method}
        self._enqueue(_Out(ref.address, header, [args, kwargs], failed))

    def send(self, dst: str, header: dict[str, Any], payload: Any = None) -> None:
        """Queue a raw runtime message (replies, pings, notices); failures are logged."""
        if not self._closed:
            self._enqueue(_Out(dst, header, payload, None))

    def reply(self, dst: str, call_id: int, result: Any, on_error: Callable[[BaseException], None]) -> None:
        """Queue the ``ok`` reply of call ``call_id``; ``on_error`` runs if it cannot be encoded/sent."""
        if not self._closed:
            self._enqueue(_Out(dst, {"k": "ok", "i": call_id}, result, on_error))

    def reply_error(self, dst: str, call_id: int, where: str, exc: BaseException) -> None:
        """Queue the ``err`` reply of call ``call_id`` carrying ``exc``'s traceback as text."""
        self.send(dst, {"k": "err", "i": call_id, **_wire.error_fields(where, exc)})

    def _call_done(self, call_id: int, ref: ActorRef[Any], fut: asyncio.Future[Any]) -> None:
        pending = self._pending.pop(call_id, None)
        if fut.cancelled() and pending is not None and ref.address not in self.dead:
            self.send(ref.address, {"k": "cancel", "i": call_id, "to": ref.name})

    def _call_failed(self, call_id: int, exc: BaseException) -> None:
        pending = self._pending.get(call_id)
        if pending is None or pending.future.done():
            return
        if isinstance(exc, TransportBroken):
            self.mark_dead(pending.address, f"transport broken: {exc}")
        else:  # unencodable arguments, over the size limit: this call only
            pending.future.set_exception(exc)

    # -- death -----------------------------------------------------------------------------------
    def mark_dead(self, address: str, reason: str) -> None:
        """Fail every call pending on ``address`` with ``ActorDied``; later calls fail at once."""
        if address == self.address or address in self.dead:
            return
        self.dead[address] = reason
        failed = [p for p in self._pending.values() if p.address == address]
        for p in failed:
            if not p.future.done():
                p.future.set_exception(ActorDied(p.actor, reason))
        # A peer that leaves with nothing pending is news, not a problem. One we asked to leave ends a
        # shutdown in order, even when its disconnect beats its reply to "shutdown": not news either
        # (whoever still waited on it gets ActorDied).
        if address in self.leaving:
            level = logging.DEBUG
        else:
            level = logging.WARNING if failed else logging.INFO
        log.log(level, "node %s: peer %s is dead (%s); failed %d pending call(s)%s", self.name, address, reason,
                len(failed), "".join(f" {p.actor}.{p.method}" for p in failed))

    def _on_peer_broken(self, peer: str, error: TransportBroken) -> None:
        if any(p.address == peer for p in self._pending.values()):
            self.mark_dead(peer, f"transport broken: {error}")

    # -- background tasks ------------------------------------------------------------------------
    def _enqueue(self, out: _Out) -> None:
        if out.dst == self.address:  # in-process: no codec, no task; call_soon keeps the order
            msg = Message(self.address, out.header, out.payload)
            asyncio.get_running_loop().call_soon(self._dispatch_local, msg)
            return
        queue = self._queues.setdefault(out.dst, collections.deque())
        queue.append(out)
        if out.dst not in self._senders:
            task = asyncio.create_task(self._drain(out.dst, queue), name=f"digenrl-{self.name}-send")
            self._senders[out.dst] = task

    async def _drain(self, dst: str, queue: collections.deque[_Out]) -> None:
        try:
            while queue:
                await self._send_one(queue.popleft())
        finally:  # no await between the last check and here, so no message can be stranded
            del self._senders[dst]
            if not queue:
                self._queues.pop(dst, None)

    def _dispatch_local(self, msg: Message) -> None:
        if not self._closed:
            self._dispatch(msg, local=True)

    async def _send_one(self, out: _Out) -> None:
        try:
            await self.transport.send(out.dst, out.header, encode_refs(out.payload))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one bad message or dead peer must not stop the sender
            if isinstance(exc, TransportClosed) and self._closed:
                return
            if out.on_error is not None:
                out.on_error(exc)
            else:
                log.warning("node %s: could not send %s to %s: %s", self.name, out.header.get("k"), out.dst, exc)

    async def _route(self) -> None:
        while True:
            try:
                msg = await self.transport.recv()
            except TransportClosed:
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # undecodable bytes: the codec names the problem
                self.transport.drops(None, getattr(exc, "reason", "malformed"), exc)
                continue
            self._dispatch(msg, local=False)

    def _dispatch(self, msg: Message, *, local: bool) -> None:
        if msg.src in self.last_heard:  # only peers someone watches (no growth from spoofed senders)
            self.last_heard[msg.src] = time.monotonic()
        try:
            self._dispatch_parsed(msg, _wire.parse(msg.header, msg.payload), local)
        except ProtocolError as exc:
            self._reject(msg, exc)
        except Exception as exc:  # e.g. RecursionError on absurd nesting: drop it, keep routing
            self.transport.drops(msg.src, "malformed", f"{type(exc).__name__}: {exc}")

    def _dispatch_parsed(self, msg: Message, parsed: _wire.Parsed, local: bool) -> None:
        kind, header = parsed.kind, parsed.header
        if kind in ("call", "tell"):
            args = parsed.args if local else decode_refs(list(parsed.args), self)
            kwargs = parsed.kwargs if local else decode_refs(parsed.kwargs, self)
            host = self.hosts.get(header["to"])
            if host is not None and host.trusted_only and not local and msg.src not in self.trusted:
                host = None  # the node's own agent answers only the system; to others it does not exist
            if host is None:
                missing = LookupError(f"no actor named {header['to']!r} on node {self.name} ({self.address})")
                if kind == "call":
                    self.reply_error(msg.src, header["i"], f"{header['to']}.{header['m']}", missing)
                else:
                    self.transport.drops(msg.src, "no-actor", missing)
                return
            host.deliver(msg.src, header.get("i"), header["m"], args, kwargs or {})
        elif kind in ("ok", "err"):
            self._resolve(msg, header, local)
        elif kind == "ping":
            self.send(msg.src, {"k": "pong", "i": header["i"]})
        elif kind == "cancel":
            host = self.hosts.get(header["to"])
            if host is not None:
                host.cancel(msg.src, header["i"])
        elif kind == "dead":
            if msg.src in self.trusted:
                self.mark_dead(header["a"], header["why"])
            else:
                self.transport.drops(msg.src, "untrusted", "dead notice from an untrusted sender")
        # "pong" only refreshes last_heard (done above)

    def _resolve(self, msg: Message, header: dict[str, Any], local: bool) -> None:
        pending = self._pending.get(header["i"])
        if pending is None or pending.address != msg.src:
            # A reply for a call that was cancelled or timed out is normal; a reply from the wrong
            # peer is not, but either way there is nobody to deliver it to.
            if pending is not None:
                self.transport.drops(msg.src, "wrong-peer",
                                     f"reply to call {header['i']} came from {msg.src}, but the call went to "
                                     f"{pending.address} (peers must be addressed exactly as they bound: "
                                     "127.0.0.1 is not localhost)")
            return
        if pending.future.done():
            return
        if header["k"] == "ok":
            pending.future.set_result(msg.payload if local else decode_refs(msg.payload, self))
        else:
            pending.future.set_exception(_wire.remote_error(header))

    def _reject(self, msg: Message, exc: ProtocolError) -> None:
        header = msg.header if isinstance(msg.header, dict) else {}
        call_id = header.get("i")
        if header.get("k") == "call" and isinstance(call_id, int) and not isinstance(call_id, bool):
            target = f"{str(header.get('to'))[:60]}.{str(header.get('m'))[:60]}"
            self.reply_error(msg.src, call_id, target, exc)
        self.transport.drops(msg.src, "header", exc)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._closed:
            return
        exc = task.exception() or RuntimeError(f"{task.get_name()} stopped unexpectedly")
        log.error("node %s: background task %s failed: %r", self.name, task.get_name(), exc)
        self._fail_pending(ActorDied(self.name, f"node task {task.get_name()} failed: {exc!r}"))

    def _fail_pending(self, exc: BaseException) -> None:
        for p in list(self._pending.values()):
            if not p.future.done():
                p.future.set_exception(exc)
        self._pending.clear()

    # -- hosting and shutdown --------------------------------------------------------------------
    async def host(self, actor: Actor, name: str, *, trusted_only: bool = False) -> ActorRef[Any]:
        """Host ``actor`` under ``name`` here: run its ``setup`` and start its mailbox.

        ``trusted_only`` actors (a worker's agent) take calls only from ``self.trusted`` addresses.

        Raises:
            ValueError: the name is taken on this node.
            BaseException: whatever ``setup`` raised (after ``__cleanup__`` ran).
        """
        if name in self.hosts:
            raise ValueError(f"an actor named {name!r} already runs on node {self.name}")
        host = ActorHost(self, name, actor)
        host.trusted_only = trusted_only
        self.hosts[name] = host
        try:
            await host.start()
        except BaseException:
            self.hosts.pop(name, None)
            raise
        return host.ref

    async def flush(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until the outbound queue is empty."""
        if self._senders:
            await asyncio.wait(set(self._senders.values()), timeout=timeout)

    async def aclose(self, reason: str = "node closed") -> None:
        """Stop the tasks, fail pending calls and close the transport. Idempotent.

        Hosted actors must have been stopped before (see ``ActorHost.stop``).
        """
        if self._closed:
            return
        self._closed = True
        if self._remove_listener is not None:
            self._remove_listener()
        self._fail_pending(ActorDied(self.name, reason))
        tasks = [*self._tasks, *self._senders.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._queues.clear()
        await self.transport.aclose()
        log.debug("[shutdown] Node %s: closed address=%s", self.name, self.address)
