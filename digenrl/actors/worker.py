"""A worker process: joins a running ``ActorSystem`` and hosts the actors it is asked to.

Both kinds of actor process run this: the ones ``ActorSystem.spawn(process=True)`` launches on
this host (via ``python -m digenrl.actors._child``), and ``digenrl worker --join tcp://HOST:PORT``
started by hand, Slurm or Kubernetes on another host.

Protocol (all of it ordinary actor calls):

1. open a transport endpoint (``listen``; a tcp port on loopback by default for ``--join``);
2. host the ``NodeAgent`` as ``_agent`` (it answers only the system it joined);
3. call ``_registry.join(address, name, pid, host, token)`` on the system;
4. serve: the system calls ``_agent.spawn_actor(...)`` to host actors here, and pings;
5. exit when the system calls ``_agent.shutdown``, on SIGTERM/SIGINT (a local driver's children leave
   those to the driver while it lives: ``defer_signals_to``), or when the system has been silent for
   ``parent_timeout`` seconds (it died): drain actors → close → return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Awaitable, Callable

from digenrl.actors import _agent
from digenrl.actors.allowlist import AllowList
from digenrl.actors._context import current_node
from digenrl.actors._node import Node
from digenrl.actors.base import ActorRef
from digenrl.errors import ActorDied, DigenrlError, JoinRefused, KeysRefused, RemoteError, TransportBroken
from digenrl.transport import make_transport
from digenrl.transport.curve import ClusterKeys

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


async def run_worker(
    join: str,
    *,
    name: str | None = None,
    listen: str | None = None,
    transport: str = "zmq",
    token: str | None = None,
    parent_timeout: float = 30.0,
    join_timeout: float = 60.0,
    shutdown_timeout: float = 10.0,
    allow: AllowList | None = None,
    keys: ClusterKeys | None = None,
    defer_signals_to: int | None = None,
    join_deadline: float = 0.0,
    rejoin: bool = False,
) -> str:
    """Join the system at ``join`` and host actors for it until it lets go (see the module docstring).

    Args:
        join: the system's address (``ActorSystem.address``), e.g. ``tcp://10.0.0.1:5555``.
        name: this worker's name in logs (default ``worker-<host>-<pid>``).
        listen: where this worker binds; default: ``tcp://127.0.0.1:0`` when joining over tcp,
            a private ipc path otherwise. Bind a routable interface to serve other hosts.
        transport: transport kind (must match the system's).
        token: the launch token (set by ``spawn(process=True)``).
        parent_timeout: exit when the system has been silent this long.
        join_timeout: give up when the system does not answer the join in time.
        shutdown_timeout: drain deadline when exiting on a signal or on silence.
        allow: the actor classes this worker hosts (besides those registered with
            ``register_actor_class``); default: only the registered ones.
        keys: the cluster's CURVE keys; required when ``listen`` is off loopback, and must match
            the system's when it has keys.
        defer_signals_to: the pid of the driver that launched this process on this host, which stops
            the run in order on SIGINT and SIGTERM (and then this worker, by ``_agent.shutdown``). A
            terminal's Ctrl-C reaches the whole process group and Slurm signals every process of a
            job, so this worker ignores SIGINT, and SIGTERM until that driver lets go of it (closes its
            stdin: ``ChildProcess.stop``) or dies (then Linux sends SIGTERM, which ends it as usual).
            ``None``: both end it.
        join_deadline: keep trying a system that does not accept the connection (not started yet, still
            importing, a link down) for this many seconds, a warning every try; 0: one try. A refusal
            (of this worker's keys, or by the run's join policy) is final: never tried again.
        rejoin: after losing the system's link (``"orphaned"``), join it again, under the same
            ``join_deadline``, as a fresh worker (a running run takes it as a late rollout actor).

    Returns:
        Why it stopped: ``"shutdown"`` (the system let go), ``"signal"`` or ``"orphaned"``
        (the system went silent).

    Raises:
        TimeoutError: the system did not answer the join.
        JoinRefused: the system does not take this worker (its join policy; the message says why).
        KeysRefused: the system refused this worker's CURVE keys (none, or another cluster's).
        DigenrlError: the join failed (system unreachable or refusing).
    """
    name = name or f"worker-{socket.gethostname()}-{os.getpid()}"
    if listen is None and join.startswith("tcp://"):
        listen = "tcp://127.0.0.1:0"
    options = {"curve": keys} if keys is not None else {}

    def new_node() -> Node:  # a fresh node each try: a failed one has marked the system dead and closed its link
        return Node(make_transport(transport, listen, **options), name=name)

    async def serve(node: Node, answer_in: float) -> str:
        return await _join_and_serve(node, join, name, token, answer_in, parent_timeout, allow, defer_signals_to)

    while True:
        reason = await _join_with_retries(join, name, new_node, serve, join_deadline, join_timeout, shutdown_timeout)
        if reason != "orphaned" or not rejoin:
            return reason
        log.warning("worker %s: lost the link to the system at %s; joining it again as a fresh worker (for up to "
                    "%g s); a running run takes it as a new rollout actor", name, join, join_deadline)


async def _join_with_retries(join: str, name: str, new_node: Callable[[], Node],
                             serve: Callable[[Node, float], Awaitable[str]], join_deadline: float, join_timeout: float,
                             shutdown_timeout: float) -> str:
    """Join and serve on a fresh node, trying again until ``join_deadline`` while the system is unreachable;
    returns why serving stopped.

    Raises:
        KeysRefused: at once (a refusal is final).
        TimeoutError: the deadline passed without the system taking this worker (or the one try's error).
    """
    end = time.monotonic() + join_deadline
    tries = 0
    while True:
        tries += 1
        node = new_node()
        # A try ends with the deadline (a system gone for good is not waited on past it), but is never cut below
        # a few seconds (a system that is there answers a join in well under that).
        answer_in = min(join_timeout, max(_MIN_TRY_S, end - time.monotonic())) if join_deadline else join_timeout
        try:
            return await serve(node, answer_in)
        except KeysRefused:
            raise
        except (TransportBroken, ActorDied, TimeoutError) as exc:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the system at {join} did not take this worker within {join_deadline:g} s "
                                   f"({tries} tries; last: {exc})") if join_deadline else exc from None
            log.warning("worker %s: the system at %s is not reachable yet (%s); trying again, %.0f s left",
                        name, join, exc, left)
        finally:
            await _close(node, name, shutdown_timeout)
        await asyncio.sleep(min(_RETRY_S, max(0.0, end - time.monotonic())))


_RETRY_S = 2.0  # between join tries: a driver still importing takes tens of seconds; a link back takes as long
_MIN_TRY_S = 5.0  # the shortest a join try waits for the system's answer


async def _join_and_serve(node: Node, join: str, name: str, token: str | None, join_timeout: float,
                          parent_timeout: float, allow: AllowList | None, defer_signals_to: int | None) -> str:
    node.start()
    node.trusted.add(join)
    current_node.set(node)
    stop = asyncio.Event()
    agent = _agent.NodeAgent(node, stop, allow or AllowList())
    await node.host(agent, _agent.AGENT, trusted_only=True)
    registry: ActorRef[_agent.Registry] = ActorRef(_agent.REGISTRY, join, node=node)
    refused: list[KeysRefused] = []  # the system refused our keys: final, unlike a system not there yet
    stop_watching = node.transport.add_peer_listener(
        lambda peer, error: refused.append(error) if peer == join and isinstance(error, KeysRefused) else None)
    try:
        async with asyncio.timeout(join_timeout):
            config = await registry.call("join", node.address, name, os.getpid(), socket.gethostname(), token)
    except TimeoutError:
        if refused:
            raise refused[0] from None
        raise TimeoutError(f"no answer to the join within {join_timeout:g} s") from None
    except RemoteError as exc:
        if exc.exc_type == f"{JoinRefused.__module__}.{JoinRefused.__qualname__}":  # an answer, not a fault
            raise JoinRefused(exc.message) from None
        raise
    except ActorDied:
        if refused:
            raise refused[0] from None
        raise
    finally:
        stop_watching()
    parent_timeout = float(config.get("heartbeat_timeout", parent_timeout))
    log.info("worker %s: joined %s, serving at %s", name, join, node.address)
    return await _serve(node, join, stop, parent_timeout, agent, defer_signals_to)


async def _serve(node: Node, join: str, stop: asyncio.Event, parent_timeout: float, agent: _agent.NodeAgent,
                 driver: int | None = None) -> str:
    loop = asyncio.get_running_loop()
    reason = "shutdown"

    def on_signal(sig: signal.Signals) -> None:
        nonlocal reason
        if driver is not None and not _let_go(driver):
            log.info("[shutdown] worker %s: step=signal %s left to the driver (pid %d)", node.name, sig.name, driver)
            return
        reason = "signal"
        log.info("[shutdown] worker %s: step=signal %s", node.name, sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT) if driver is None else (signal.SIGTERM,):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread / platform
            loop.add_signal_handler(sig, on_signal, sig)
    def on_broken(peer: str, error: Exception) -> None:
        # The system's link dropped (its process died): no need to wait for heartbeats to stop.
        nonlocal reason
        if peer == join and not stop.is_set() and not agent.shutting_down:
            log.error("[shutdown] worker %s: step=orphaned system link broken: %s", node.name, error)
            reason = "orphaned"
            stop.set()

    remove_listener = node.transport.add_peer_listener(on_broken)
    try:
        node.last_heard[join] = time.monotonic()
        check = min(1.0, parent_timeout / 4)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), check)
            silent = time.monotonic() - node.last_heard.get(join, 0.0)
            if not stop.is_set() and not agent.shutting_down and silent > parent_timeout:
                log.error("[shutdown] worker %s: step=orphaned system silent for %.1fs", node.name, silent)
                reason = "orphaned"
                stop.set()
    finally:
        remove_listener()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    return reason


def _let_go(driver: int) -> bool:
    """The driver that launched this process let go of it: it died, or closed our stdin (``ChildProcess.stop``)."""
    return os.getppid() != driver or bool(select.select([0], [], [], 0)[0] and not os.read(0, 1))


async def _close(node: Node, name: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    hosts = [h for n, h in node.hosts.items() if n != _agent.AGENT]
    log.info("[shutdown] worker %s: step=drain actors=%d deadline=%.1fs", name, len(hosts), timeout)
    await asyncio.gather(*(h.stop(max(0.0, end - time.monotonic())) for h in hosts), return_exceptions=True)
    agent = node.hosts.get(_agent.AGENT)
    if agent is not None:
        await agent.stop(0.5)
    await node.flush(max(0.1, min(1.0, end - time.monotonic())))  # the shutdown reply
    with contextlib.suppress(DigenrlError):
        await node.aclose("worker exiting")
    log.info("[shutdown] worker %s: step=closed", name)
