"""ZeroMQ transport over ``ipc://`` and ``tcp://`` (loopback unless configured otherwise).

Sockets: each endpoint binds one ROUTER at its own address to receive, and opens one DEALER per
destination to send, whose ZMQ identity is the endpoint's own address; the ROUTER therefore sees
the sender's address as the first frame and ``Message.src`` is always the sender's address.

State machine and races (the contract of :class:`~digenrl.transport.base.Transport`):
  * OPEN → CLOSED. ``aclose`` cancels the reader task, fails every pending ``recv`` with
    ``TransportClosed``, closes every socket with a short linger (200 ms: messages already handed to
    ZeroMQ still leave) and then terminates the context. All of that lives in a ``_Resources`` holder
    closed through ``weakref.finalize``, so explicit close, garbage collection and a constructor that
    fails half-way share one cleanup path.
  * Receiving: an event-loop reader callback on the ROUTER's ``ZMQ_FD`` drains it, decodes and
    queues messages (at most ``hwm`` decoded messages; beyond that it stops reading, so ZeroMQ's
    high-water marks push back on the senders). ``recv`` waits on that queue, so a cancelled ``recv`` loses nothing. Garbage from a
    peer is counted in ``stats`` (``dropped``, ``dropped/<reason>``), logged with a per-peer rate
    limit (``drops``) and skipped; it never reaches ``recv``. An
    unexpected reader failure is delivered to every pending and later ``recv``.
  * Peers: the first send to a destination waits (up to ``connect_timeout_s``) for the ZMTP
    handshake, seen through a socket monitor. After that, a disconnect event (the peer process
    exited or was killed; or ZMTP heartbeats timed out after ``heartbeat_timeout_s``, for a peer
    that hangs or a dropped link) marks the peer broken: listeners registered with
    ``add_peer_listener`` are told, and every send to it raises ``TransportBroken`` until
    ``forget_peer`` is called.
  * Sending: large frames are sent zero-copy and ``send`` returns only once ZeroMQ no longer
    references them (``MessageTracker``), so the caller may mutate its tensors afterwards. Frames
    of tensors larger than ``chunk_bytes`` are split; the codec reassembles them on receipt.
  * Same host: tensors of at least ``shm_min_bytes`` bound for ``ipc://`` or loopback
    destinations go through reused shared-memory segments (:mod:`digenrl.transport._shm`); only a
    small handle crosses the socket. ``shm=False`` turns that lane off, ``shm=True`` forces it on.
  * Authentication (:mod:`digenrl.transport.curve`): with ``curve`` keys every socket speaks CURVE
    (the ROUTER serves, the DEALERs connect with the cluster's client key, a ZAP handler admits only
    the cluster's client keys). A peer that fails the handshake is dropped by ZeroMQ and counted in
    ``stats["auth_failed"]``; on the sending side a failed handshake breaks the peer with an error
    naming the keys. Without keys, binding ``tcp://`` off loopback is refused.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import tempfile
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from digenrl.errors import KeysRefused, ProtocolError, TransportBroken, TransportClosed
from digenrl.transport import _shm, codec
from digenrl.transport._stale import sweep_stale_once
from digenrl.transport.curve import ClusterKeys, require_keys, start_authenticator
from digenrl.transport.base import Message, Transport
from digenrl.transport.hosts import bind_error

__all__ = ["ZmqTransport"]

log = logging.getLogger(__name__)

_COUNTER = itertools.count()
_MONITORS = itertools.count()
_LOOPBACK = ("127.", "localhost", "[::1]", "::1")
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
                   | _HANDSHAKE_FAILED)
_TRACK_MIN = 64 << 10  # below this pyzmq copies anyway, so there is nothing to track
# Plain ints: pyzmq's flag enums cost an enum operation per use on the per-message path.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


@dataclass
class _Peer:
    """Send-side state for one destination."""

    dst: str
    sock: zmq.asyncio.Socket
    sync: zmq.Socket[Any]  # a blocking view of ``sock`` (owns nothing): the no-wait fast path
    monitor: zmq.asyncio.Socket
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    broken: TransportBroken | None = None
    task: asyncio.Task[None] | None = None
    pool: _shm.ShmPool | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


_CLOSE_LINGER_MS = 200


@dataclass
class _Resources:
    """Everything that must be released, in the order that makes ZeroMQ happy."""

    ctx: zmq.asyncio.Context
    sockets: list[zmq.Socket[Any]] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    readers: list[tuple[asyncio.AbstractEventLoop, int]] = field(default_factory=list)
    pools: list[_shm.ShmPool] = field(default_factory=list)
    ipc_path: str | None = None
    auth: Any = None  # the ZAP handler (a thread with its own sockets) when CURVE is on

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for loop, fd in self.readers:
            if not loop.is_closed():
                loop.remove_reader(fd)
        # Sockets first, then the context. A short linger lets messages already handed to ZeroMQ leave
        # (a worker's reply to "shutdown" was sometimes dropped, so the system saw a failed call);
        # term() waits at most that long for a peer that no longer reads (broken peers: linger 0).
        for sock in self.sockets:
            if not sock.closed:
                sock.close(linger=_CLOSE_LINGER_MS)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        for pool in self.pools:
            pool.close(unlink=False)
        if self.ipc_path is not None:
            try:
                os.unlink(self.ipc_path)
            except FileNotFoundError:
                pass


def _advertised(advertise: str | None, bound: str) -> str:
    if advertise is None:
        return bound
    if "://" in advertise:
        return advertise
    port = bound.rsplit(":", 1)[1]
    return f"tcp://{advertise}:{port}"


def _same_host(dst: str) -> bool:
    if dst.startswith("ipc://"):
        return True
    host = urlsplit(dst).hostname or ""
    return dst.startswith("tcp://") and (host.startswith("127.") or host in ("localhost", "::1"))


class ZmqTransport(Transport):
    """A ZeroMQ endpoint: one ROUTER to receive, one DEALER per destination to send.

    Args:
        address: ``ipc:///path`` or ``tcp://host:port`` (port 0 picks a free one); None picks a
            private ``ipc://`` path in the temp dir.
        hwm: high-water mark (messages) per socket and for the decoded-message queue.
        chunk_bytes: split tensor frames above this size (None: one frame per tensor).
        shm: "auto" (same-host destinations), True (always) or False (never) for the
            shared-memory lane.
        shm_min_bytes: tensors at least this big use the shared-memory lane.
        shm_pool_bytes: the most shared memory kept per destination.
        heartbeat_s: ZMTP heartbeat interval; heartbeat_timeout_s: silence that counts as death.
        connect_timeout_s: how long a first send waits for the destination to accept.
        options: codec limits.
        advertise: the address peers should dial and see as ``Message.src`` when it differs from
            the bound one (a wildcard or NAT bind); ``host`` alone keeps the bound port.
        curve: the cluster's CURVE keys (:func:`digenrl.transport.curve.load_keys`): every socket
            authenticates and encrypts. Required for ``tcp://`` off loopback.
        address_key: where ``address`` came from (e.g. the config key ``transport.address``),
            named in bind errors.

    Raises:
        ValueError: the address is not ``ipc://`` or ``tcp://``.
        ConfigError: a ``tcp://`` address off loopback without ``curve`` keys, or an address that
            cannot be bound here (in use, or no such interface on this host).
        zmq.ZMQError: any other bind failure.
    """

    kind: ClassVar[str] = "zmq"
    zero_copy: ClassVar[bool] = True
    device_direct: ClassVar[bool] = False
    can_abort: ClassVar[bool] = True

    def __init__(
        self,
        address: str | None = None,
        *,
        hwm: int = 256,
        chunk_bytes: int | None = 4 << 20,
        shm: bool | str = "auto",
        shm_min_bytes: int = 1 << 20,
        shm_pool_bytes: int = 1 << 30,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        options: codec.CodecOptions | None = None,
        advertise: str | None = None,
        curve: ClusterKeys | None = None,
        address_key: str = "address",
    ) -> None:
        sweep_stale_once()
        if address is None:
            address = f"ipc://{tempfile.gettempdir()}/digenrl-{os.getpid()}-{next(_COUNTER)}.sock"
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"zmq address must start with ipc:// or tcp://, got {address!r}")
        if shm not in (True, False, "auto"):
            raise ValueError(f"shm must be True, False or 'auto', got {shm!r}")
        require_keys(address, curve)
        base = options or codec.DEFAULT_OPTIONS
        self._options = codec.CodecOptions(
            inline_max_bytes=base.inline_max_bytes, chunk_bytes=chunk_bytes, max_frames=base.max_frames,
            max_header_bytes=base.max_header_bytes, max_total_bytes=base.max_total_bytes)
        self._hwm = hwm
        self._shm = shm
        self._shm_min = shm_min_bytes
        self._shm_pool_bytes = shm_pool_bytes
        self._hb = (int(heartbeat_s * 1000), int(heartbeat_timeout_s * 1000))
        self._connect_timeout = connect_timeout_s
        self._peers: dict[str, _Peer] = {}
        self._queue: deque[Message] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._error: BaseException | None = None
        self._closed = False
        self._reader = _shm.ShmReader()
        self.stats["shm_fallback"] = 0
        self.stats["auth_failed"] = 0
        self._counts = self.stats  # the same dict, without the property on the per-message path
        self._curve = curve
        self._res = _Resources(zmq.asyncio.Context())
        self._finalizer = weakref.finalize(self, self._res.close)
        self._auth_monitor: zmq.asyncio.Socket | None = None
        try:
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if curve is not None:
                self._res.auth = start_authenticator(self._res.ctx, curve)  # before the bind, or all get in
                curve.serve(self._router)
                self._auth_monitor = _monitor(self._router, _HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
                self._res.sockets.append(self._auth_monitor)
            try:
                self._router.bind(address)
            except zmq.ZMQError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENODEV):
                    raise bind_error(address, address_key, exc.errno) from None
                raise
            bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            # A wildcard bind (tcp://0.0.0.0:0) is not an address peers can dial: advertise one.
            self._address = _advertised(advertise, bound)
            if self._res.auth is not None:
                self._res.auth.endpoint = self._address  # named in its refusal lines
            if bound.startswith("ipc://"):
                self._res.ipc_path = bound[len("ipc://"):]
            self._ident = self._address.encode()
        except BaseException:
            self._finalizer()
            raise
        self._sync_router: zmq.Socket[Any] | None = None  # blocking view used by the reader callback
        self._paused = False

    # ------------------------------------------------------------------------------------ setup

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._res.ctx.socket(kind)
        self._res.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb[1])
        sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb[1])
        return sock

    def _ensure_reader(self) -> None:
        if self._sync_router is None and not self._closed:
            # Read from an event-loop callback on ZMQ_FD instead of a task awaiting pyzmq futures:
            # one loop hop less per message (the round trip was ~4x raw zmq.asyncio with a task).
            loop = asyncio.get_running_loop()
            self._sync_router = zmq.Socket.shadow(self._router.underlying)
            fd = self._sync_router.getsockopt(zmq.FD)
            loop.add_reader(fd, self._on_readable)
            self._res.readers.append((loop, fd))
            loop.call_soon(self._on_readable)  # ZMQ_FD is edge-triggered: drain what is already there
            if self._auth_monitor is not None:
                self._res.tasks.append(loop.create_task(self._count_auth_failures(self._auth_monitor),
                                                        name=f"zmq-auth {self._address}"))

    async def _count_auth_failures(self, monitor: zmq.asyncio.Socket) -> None:
        """Count the peers whose CURVE handshake failed (ZeroMQ already dropped them), and say why.

        The event's endpoint is this socket's own address, never the peer's: a refused client key is
        logged by the ZAP handler with the peer's IP; a peer that fails before ZAP is asked has none.
        """
        while True:
            evt = parse_monitor_message(await monitor.recv_multipart())
            if evt["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            self.stats["auth_failed"] += 1
            if evt["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # (the ZAP handler logs those, with the IP)
                log.warning("zmq endpoint %s refused a peer %s; ZeroMQ reports no address for a peer it drops "
                            "before the key check", self._address, _handshake_failure(evt["event"], evt["value"]))

    @property
    def address(self) -> str:
        return self._address

    # ------------------------------------------------------------------------------------ sending

    async def send(self, dst: str, header: dict[str, Any], payload: Any = None) -> None:
        """Send ``header`` and ``payload`` to the endpoint bound at ``dst``.

        Returns once ZeroMQ holds no reference to the payload's tensors any more.

        Raises:
            TransportClosed: this endpoint was closed.
            TransportBroken: ``dst`` did not accept a connection within ``connect_timeout_s``, or died.
            ProtocolError: the message is over the codec's size limits.
            TypeError: the payload holds something that cannot cross the wire.
        """
        self._check_open()
        self._ensure_reader()
        peer = self._peers.get(dst) or self._open_peer(dst)
        if peer.broken is not None:
            raise peer.broken
        if not peer.connected.is_set():
            await self._wait_connected(peer)
        undo, offload = (None, None) if payload is None else self._make_offload(peer, payload)
        try:
            frames = codec.encode(header, payload, options=self._options, offload=offload)
            big = len(frames) > 1 and any(codec.frame_nbytes(f) >= _TRACK_MIN for f in frames[1:])
            if big or peer.lock.locked() or not _send_now(peer.sync, frames):
                # Large frames (tracked) or a full pipe: the awaitable path, one sender at a time.
                async with peer.lock:
                    if peer.broken is not None:
                        raise peer.broken
                    tracker = await peer.sock.send_multipart(frames, copy=not big, track=big)
        except BaseException as exc:
            if undo is not None and peer.broken is None:
                undo()
            self._reraise_send_error(peer, exc)
            raise
        if big and not tracker.done:
            # Zero-copy: zmq still reads the caller's tensors; wait it out off the event loop.
            await asyncio.to_thread(tracker.wait)
        if peer.broken is not None:
            raise peer.broken
        self._counts["sent"] += 1

    def _reraise_send_error(self, peer: _Peer, exc: BaseException) -> None:
        """Turn the side effects of a concurrent close/peer death into the documented errors."""
        if isinstance(exc, (ProtocolError, TypeError, TransportBroken, TransportClosed)):
            return
        task = asyncio.current_task()
        own_cancel = isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0
        if isinstance(exc, (asyncio.CancelledError, zmq.ZMQError)) and not own_cancel:
            if peer.broken is not None:
                raise peer.broken from None
            if self._closed:
                raise TransportClosed(f"zmq endpoint {self._address} was closed during a send") from None

    def _make_offload(self, peer: _Peer, payload: Any) -> tuple[Callable[[], None] | None, codec.Offload | None]:
        """Move the payload's large CPU tensors into a shared-memory segment for ``peer``.

        Returns:
            ``(undo, offload)``: ``undo`` frees the segment if the send fails; ``offload`` maps a
            tensor to its handle (None: frames). Subclasses add device lanes here.
        """
        pool = peer.pool
        if pool is None:
            return None, None
        big = [t for t in _tensors(payload) if t.device.type == "cpu" and t.numel() * t.element_size() >= self._shm_min]
        if not big:
            return None, None
        seg = pool.acquire(_shm.segment_bytes(big))
        if seg is None:
            self.stats["shm_fallback"] += 1
            log.debug("shm pool for %s is full; sending %d tensors as frames", peer.dst, len(big))
            return None, None
        handles = {id(t): h for t, h in zip(big, pool.write(seg, big), strict=True)}
        return (lambda: pool.release(seg)), (lambda t: handles.get(id(t)))

    def _resolver(self, src: str) -> codec.Resolve:
        """The codec ``resolve`` hook for one message from ``src`` (shared-memory handles)."""
        return self._reader.resolver(src)

    def _open_peer(self, dst: str) -> _Peer:
        if not dst.startswith(("ipc://", "tcp://")):
            raise TransportBroken(f"cannot reach {dst!r}: zmq destinations are ipc:// or tcp:// addresses")
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._ident)
        if self._curve is not None:
            self._curve.connect(sock)
        monitor = _monitor(sock, _MONITOR_EVENTS)
        self._res.sockets.append(monitor)
        sock.connect(dst)
        use_shm = self._shm is True or (self._shm == "auto" and _same_host(dst))
        pool = _shm.ShmPool(self._shm_pool_bytes) if use_shm else None
        if pool is not None:
            self._res.pools.append(pool)
        peer = _Peer(dst, sock, zmq.Socket.shadow(sock.underlying), monitor, pool=pool)
        peer.task = asyncio.get_running_loop().create_task(self._watch(peer), name=f"zmq-monitor {dst}")
        self._res.tasks.append(peer.task)
        self._peers[dst] = peer
        return peer

    async def _wait_connected(self, peer: _Peer) -> None:
        try:
            await asyncio.wait_for(peer.connected.wait(), self._connect_timeout)
        except TimeoutError:
            err = TransportBroken(f"{peer.dst} did not accept a connection within {self._connect_timeout:g} s")
            self._mark_broken(peer, err)
            raise err from None
        if peer.broken is not None:
            raise peer.broken

    async def _watch(self, peer: _Peer) -> None:
        try:
            while True:
                evt = parse_monitor_message(await peer.monitor.recv_multipart())
                kind = evt["event"]
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    peer.connected.set()
                elif kind == zmq.EVENT_DISCONNECTED and peer.connected.is_set():
                    self._mark_broken(peer, TransportBroken(f"peer {peer.dst} disconnected (exited, killed or "
                                                            "missed heartbeats)"))
                    return
                elif kind & _HANDSHAKE_FAILED:
                    keys = f"the keys in {self._curve.path}" if self._curve is not None else "no keys"
                    self._mark_broken(peer, KeysRefused(
                        f"{peer.dst} refused the connection: CURVE handshake failed with {keys} (both sides need "
                        "the same `transport.keys`; create them with `digenrl keys create PATH`)"))
                    return
                elif kind == zmq.EVENT_MONITOR_STOPPED:
                    return
        finally:
            if not peer.monitor.closed:
                peer.monitor.close(linger=0)

    def _mark_broken(self, peer: _Peer, err: TransportBroken) -> None:
        if peer.broken is not None:
            return
        peer.broken = err
        peer.connected.set()  # wake a first send waiting for the handshake
        # Debug: ZeroMQ sees the same disconnect whether the peer closed in order or died. The listeners
        # know which (the node fails calls pending on it, the worker and the system judge their links)
        # and report real breaks; an orderly shutdown must read as one.
        log.debug("zmq peer %s is broken: %s", peer.dst, err)
        # Dropping queued messages also releases any zero-copy frames a send is tracking.
        peer.sock.close(linger=0)
        if peer.pool is not None:
            peer.pool.close(unlink=True)
        self._reader.drop(peer.dst)  # its segments can never be reused by a dead sender
        self._notify_peer_broken(peer.dst, err)

    def forget_peer(self, dst: str) -> None:
        """Drop the (broken) link to ``dst`` so the next send reconnects from scratch."""
        peer = self._peers.pop(dst, None)
        if peer is None:
            return
        if peer.task is not None:
            peer.task.cancel()
        for sock in (peer.sock, peer.monitor):
            if not sock.closed:
                sock.close(linger=0)
        if peer.pool is not None:
            peer.pool.close(unlink=True)

    # ---------------------------------------------------------------------------------- receiving

    async def recv(self) -> Message:
        """Return the next message (FIFO per sender); cancel-safe.

        Raises:
            TransportClosed: the endpoint was closed before or while waiting.
            TransportBroken: the background reader failed (the cause is chained).
        """
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        while not self._queue:
            self._check_open()
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        msg = self._queue.popleft()
        if self._paused and len(self._queue) < self._hwm:
            self._paused = False
            loop.call_soon(self._on_readable)
        return msg

    def _check_open(self) -> None:
        if self._error is not None:
            raise TransportBroken(f"zmq receiver of {self._address} failed: {self._error!r}") from self._error
        if self._closed:
            raise TransportClosed(f"zmq endpoint {self._address} is closed")

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    def _on_readable(self) -> None:
        """Drain the ROUTER without blocking; stop at ``hwm`` queued messages (backpressure)."""
        sock = self._sync_router
        if sock is None or self._closed or self._error is not None:
            return
        try:
            while True:
                if len(self._queue) >= self._hwm:
                    self._paused = True  # recv() re-arms us once there is room again
                    return
                # Asking ZMQ_EVENTS first also re-arms the edge-triggered ZMQ_FD, and is cheaper
                # than the zmq.Again exception a non-blocking recv on an empty socket raises.
                if not sock.getsockopt(_EVENTS) & _POLLIN:
                    return
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
                # No locals may outlive the call: a held message would pin its shm segment.
                self._enqueue(self._decode(frames))
                del frames
        except Exception as exc:  # never die silently: hand the error to every receiver
            log.exception("zmq reader of %s failed", self._address)
            self._error = exc
            self._wake()

    def _enqueue(self, msg: Message | None) -> None:
        if msg is not None:
            self._queue.append(msg)
            self._counts["received"] += 1
            self._wake()

    def _decode(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            src = frames[0].bytes.decode()
        except UnicodeDecodeError:
            src = repr(frames[0].bytes[:64])
        try:
            header, payload = codec.decode(frames[1:], options=self._options, resolve=self._resolver(src))
        except ProtocolError as exc:
            self.drops(src, exc.reason, exc)
            return None
        return Message(src, header, payload)

    # ---------------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Stop reading, fail pending receivers, close sockets (linger 0) and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain_unread()
        self.drops.flush()
        self._queue.clear()
        self._reader.clear()
        self._wake()
        self._finalizer()
        log.debug("[shutdown] ZmqTransport: closed address=%s peers=%d", self._address, len(self._peers))

    def _drain_unread(self) -> None:
        # Decoding unread messages maps (and so unlinks) any shm segments they announce.
        sync = zmq.Socket.shadow(self._router.underlying)  # a blocking view; owns nothing
        for _ in range(self._hwm * 4):
            try:
                frames = sync.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # includes zmq.Again: nothing left
                return
            self._decode(frames)

    def __repr__(self) -> str:
        return f"ZmqTransport({self._address!r}{', closed' if self._closed else ''})"


def _handshake_failure(event: int, code: int) -> str:
    """What a CURVE handshake failure's event and code say about the peer."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # A peer without keys sees this endpoint's CURVE greeting, gives up and hangs up, sometimes before
        # its own greeting reached ZeroMQ here: the code is then the socket's errno, not a protocol error.
        return (f"that hung up during the CURVE handshake ({errno.errorcode.get(code, code)}: most often a peer "
                "without CURVE keys; a worker joins with --keys, the run's transport.keys directory)")
    if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "without CURVE keys (a worker joins with --keys, the run's transport.keys directory)"
    if code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "holding another cluster's keys (its server key is not this one's)"
    return "whose CURVE handshake failed (no or wrong keys)"


def _monitor(sock: zmq.Socket[Any], events: int) -> zmq.asyncio.Socket:
    """A monitor socket for ``sock`` on an inproc endpoint no other socket of the process ever had.

    pyzmq's default endpoint is named after the socket's file descriptor, and libzmq unbinds a closed
    socket's monitor only after it freed that descriptor: a socket opened meanwhile gets the same
    number, and its monitor's bind fails with EADDRINUSE ("Address already in use"). A driver opening
    a link to a worker that rejoined after a blip (its old link just closed) lost its reply that way.
    """
    return sock.get_monitor_socket(events, addr=f"inproc://digenrl-monitor-{os.getpid()}-{next(_MONITORS)}")


def _send_now(sock: zmq.Socket[Any], frames: list[Any]) -> bool:
    """Send small frames without waiting if ZeroMQ takes them at once (no future, no await).

    ZeroMQ accepts a multipart message whole or not at all, so False means nothing was sent.
    """
    try:
        sock.send_multipart(frames, _NOBLOCK)
    except zmq.Again:
        return False
    return True


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a payload, in encoding order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
