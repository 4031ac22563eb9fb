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

from digenrl.actors import _agent
from digenrl.actors.allowlist import AllowList
from digenrl.actors._context import current_node
from digenrl.actors._node import Node
from digenrl.actors.base import ActorRef
from digenrl.errors import DigenrlError, JoinRefused, RemoteError
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

    Returns:
        Why it stopped: ``"shutdown"`` (the system let go), ``"signal"`` or ``"orphaned"``
        (the system went silent).

    Raises:
        TimeoutError: the system did not answer the join.
        JoinRefused: the system does not take this worker (its join policy; the message says why).
        DigenrlError: the join failed (system unreachable or refusing).
    """
    name = name or f"worker-{socket.gethostname()}-{os.getpid()}"
    if listen is None and join.startswith("tcp://"):
        listen = "tcp://127.0.0.1:0"
    options = {"curve": keys} if keys is not None else {}
    node = Node(make_transport(transport, listen, **options), name=name)
    node.start()
    node.trusted.add(join)
    current_node.set(node)
    stop = asyncio.Event()
    try:
        agent = _agent.NodeAgent(node, stop, allow or AllowList())
        await node.host(agent, _agent.AGENT, trusted_only=True)
        registry: ActorRef[_agent.Registry] = ActorRef(_agent.REGISTRY, join, node=node)
        try:
            async with asyncio.timeout(join_timeout):
                config = await registry.call("join", node.address, name, os.getpid(), socket.gethostname(), token)
        except RemoteError as exc:
            if exc.exc_type == f"{JoinRefused.__module__}.{JoinRefused.__qualname__}":  # an answer, not a fault
                raise JoinRefused(exc.message) from None
            raise
        parent_timeout = float(config.get("heartbeat_timeout", parent_timeout))
        log.info("worker %s: joined %s, serving at %s", name, join, node.address)
        return await _serve(node, join, stop, parent_timeout, agent, defer_signals_to)
    finally:
        await _close(node, name, shutdown_timeout)


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
