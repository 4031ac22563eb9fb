"""``ActorSystem``: owns the driver's node, the actor processes, their supervision and shutdown.

::

    async with ActorSystem() as system:
        c = await system.spawn(Counter, name="counter", process=True)   # or in-process (default)
        assert await c.add.call(2) == 2

Supervision. Every worker process (a local actor process, or a ``digenrl worker --join``) joins
the system's registry and is then watched two ways: the system pings it every
``heartbeat_interval`` and declares it dead after ``heartbeat_timeout`` of silence, and for local
processes a task waits on the process itself, which reports a crash or SIGKILL within
milliseconds. Death → every call pending on that process fails with ``ActorDied``, later calls
fail at once, and the other workers are told (``dead`` notice) so their pending calls fail too.

Shutdown (``aclose``, also on ``__aexit__``) follows one deadline ``shutdown_timeout``::

    RUNNING → DRAINING: each worker's agent drains its actors (queued calls finish, new ones are
              rejected), runs their ``__cleanup__`` and exits; in-process actors drain likewise
            → CLOSED:   processes still alive get SIGTERM, then SIGKILL; pending calls fail;
                        the transport closes. Each step logs a ``[shutdown] ActorSystem: ...`` line.

It runs to the end even if the awaiting task is cancelled (the cancellation is re-raised after).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from digenrl.actors import _agent, _wire
from digenrl.actors._context import current_node
from digenrl.actors._node import Node
from digenrl.actors.base import Actor, ActorRef
from digenrl.actors.loop import running_loop_name
from digenrl.actors.process import ChildProcess, describe_exit
from digenrl.errors import ActorDied, ConfigError, DigenrlError, RemoteError
from digenrl.transport import make_transport
from digenrl.transport.curve import ClusterKeys

__all__ = ["ActorSystem", "Worker"]

log = logging.getLogger(__name__)
A = TypeVar("A", bound=Actor)


@dataclass(eq=False)
class Worker:
    """A process that joined the system (``process=True`` actor or ``digenrl worker --join``)."""

    name: str
    address: str
    pid: int
    host: str
    agent: ActorRef[Any]
    process: ChildProcess | None = None  # set for processes this system launched
    actors: set[str] = field(default_factory=set)
    dedicated: bool = False  # launched for exactly one actor (stops with it)


class ActorSystem:
    """Owns the driver's node, spawns actors (in-process or one process each) and supervises them.

    Args:
        transport: transport kind of the driver's node; ``"zmq"`` (default) reaches other
            processes, ``"inproc"`` keeps everything in this process (``process=True`` then fails).
        address: where the driver's node binds, e.g. ``"tcp://127.0.0.1:0"`` so that
            ``digenrl worker --join <system.address>`` can reach it; default: a private ipc path.
        heartbeat_interval: seconds between pings to each worker process.
        heartbeat_timeout: silence after which a worker is declared dead. A worker's event loop
            must not block longer than this (use ``compute=True`` endpoints for long work).
        shutdown_timeout: the one deadline of ``aclose``.
        spawn_timeout: how long a new process may take to import, join and finish ``setup``.
        transport_options: passed to ``make_transport``.
        keys: the cluster's CURVE keys (``digenrl keys create``): the driver's node and every actor
            process authenticate with them; required for an ``address`` off loopback.

    Attributes:
        join_policy: ``policy(worker)`` is called for each worker that joins on its own (``digenrl
            worker --join``, not a process this system launched) before it is registered; raising
            ``JoinRefused`` turns it away with that message. ``None`` (default): every join is welcome.
    """

    def __init__(
        self,
        *,
        transport: str = "zmq",
        address: str | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 30.0,
        shutdown_timeout: float = 10.0,
        spawn_timeout: float = 120.0,
        transport_options: dict[str, Any] | None = None,
        name: str = "system",
        keys: ClusterKeys | None = None,
    ) -> None:
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError(f"heartbeat_timeout ({heartbeat_timeout}) must exceed heartbeat_interval ({heartbeat_interval})")
        self.transport_kind = transport
        self._address = address
        self._transport_options = {**(transport_options or {}), **({"curve": keys} if keys is not None else {})}
        self.keys = keys
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.shutdown_timeout = shutdown_timeout
        self.spawn_timeout = spawn_timeout
        self.name = name
        self.node: Node | None = None
        self._workers: dict[str, Worker] = {}  # by address
        self._local: list[str] = []  # in-process actor names, in spawn order
        self._names: set[str] = set()
        self._joins: dict[str, asyncio.Future[Worker]] = {}  # launch token -> join future
        self._joined = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._counter = itertools.count()
        self._state = "new"
        self._ctx_token: Any = None
        # Asked about every worker that joins on its own (no launch token), before it is registered:
        # raising JoinRefused turns it away (its `digenrl worker` exits with the reason). None: all welcome.
        self.join_policy: Callable[[Worker], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def __aenter__(self) -> ActorSystem:
        await self.start()
        self._ctx_token = current_node.set(self.node)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        if self._ctx_token is not None:
            with contextlib.suppress(ValueError):  # exited in another context
                current_node.reset(self._ctx_token)

    async def start(self) -> None:
        """Open the driver's node and its registry.

        Raises:
            RuntimeError: already started.
            ValueError: bad transport kind or address.
            ConfigError: a wildcard bind address (0.0.0.0), which peers cannot reply to.
        """
        if self._state != "new":
            raise RuntimeError(f"ActorSystem is {self._state}; start it once")
        if self._address is not None and any(w in self._address for w in ("://0.0.0.0:", "://*:", "://[::]:")):
            raise ConfigError(
                f"ActorSystem address {self._address!r} is a wildcard; bind one concrete interface "
                "(e.g. tcp://10.0.0.1:5555): it is also the address peers send their replies to"
            )
        transport = make_transport(self.transport_kind, self._address, **self._transport_options)
        self.node = Node(transport, name=self.name)
        self.node.start()
        self.node.transport.add_peer_listener(self._on_peer_broken)
        await self.node.host(_agent.Registry(self._on_join), _agent.REGISTRY)
        self._background(self._heartbeat_loop(), "heartbeat")
        self._state = "running"
        log.info("ActorSystem %s: listening at %s", self.name, self.address)

    @property
    def address(self) -> str:
        """The driver node's address: what ``digenrl worker --join`` connects to."""
        if self.node is None:
            raise RuntimeError("ActorSystem is not started")
        return self.node.address

    @property
    def workers(self) -> list[Worker]:
        """Joined worker processes (not counting the ones launched for a single actor)."""
        return [w for w in self._workers.values() if not w.dedicated]

    # -- spawning --------------------------------------------------------------------------------
    async def spawn(
        self, cls: type[A], *args: Any, name: str | None = None, process: bool = False,
        on: Worker | None = None, env: Mapping[str, str] | None = None, **kwargs: Any,
    ) -> A:
        """Construct ``cls(*args, **kwargs)``, run its ``setup`` and return a ref to it.

        The ref is typed as ``cls`` so that ``ref.endpoint.call(...)`` type-checks against the
        endpoint's signature; at run time it is an ``ActorRef``.

        Args:
            cls: an ``Actor`` subclass (module-level for ``process``/``on``).
            name: unique actor name (default: class name + counter); also the process title
                ``digenrl-<name>``.
            process: run it in a fresh process of its own on this host.
            on: host it in this joined worker (see ``wait_for_workers``).
            env: extra environment variables for its process (``process=True`` only), e.g.
                ``{"CUDA_VISIBLE_DEVICES": "3"}`` to give each actor process one device.

        Raises:
            RemoteError: the constructor or ``setup`` raised; carries its traceback.
            ActorDied: the new process died before it was ready.
            TimeoutError: the process did not become ready within ``spawn_timeout``.
            ValueError: the name is taken, ``process=True`` with the inproc transport, or ``env``
                without ``process=True``.
            TypeError: ``cls`` is not an importable ``Actor`` subclass.
        """
        node = self._running()
        if env is not None and not process:
            raise ValueError("env= applies to a new process; pass process=True (or set it when starting the worker)")
        name = self._claim_name(cls, name)
        try:
            if on is not None:
                ref = await self._spawn_on(on, cls, name, args, kwargs)
            elif process:
                ref = await self._spawn_process(cls, name, args, kwargs, env)
            else:
                ref = await self._spawn_local(node, cls, name, args, kwargs)
        except BaseException:
            self._names.discard(name)
            raise
        return ref  # type: ignore[return-value]  # typed as the actor class (module docstring of base)

    def _claim_name(self, cls: type[Actor], name: str | None) -> str:
        if name is None:
            name = f"{cls.__name__.lower()}-{next(self._counter)}"
        if not name or name.startswith("_") or len(name) > 200:
            raise ValueError(f"actor name {name!r} must be 1..200 characters and not start with '_'")
        if name in self._names:
            raise ValueError(f"an actor named {name!r} already exists in this system")
        self._names.add(name)
        return name

    async def _spawn_local(self, node: Node, cls: type[A], name: str, args: Any, kwargs: Any) -> ActorRef[A]:
        try:
            actor = cls(*args, **kwargs)
        except Exception as exc:
            raise _as_remote(f"{name}.__init__()", exc) from exc
        try:
            ref = await node.host(actor, name)
        except Exception as exc:
            raise _as_remote(f"{name}.setup()", exc) from exc
        self._local.append(name)
        return ref

    async def _spawn_process(self, cls: type[A], name: str, args: Any, kwargs: Any,
                             env: Mapping[str, str] | None) -> ActorRef[A]:
        if self.transport_kind == "inproc":
            raise ValueError("process=True needs a transport other processes can reach; use ActorSystem(transport='zmq')")
        spec = _agent.class_spec(cls)  # fail before launching anything
        token = secrets.token_hex(8)
        joined = asyncio.get_running_loop().create_future()
        self._joins[token] = joined
        # A child runs on the driver's kind of loop (set by runtime.event_loop through loop.run).
        argv = ["--join", self.address, "--name", name, "--token", token, "--transport", self.transport_kind,
                "--parent-timeout", str(self.heartbeat_timeout), "--allow", f"{spec['mod']}:{spec['qual']}",
                "--event-loop", running_loop_name()]
        if self.keys is not None:
            argv += ["--keys", self.keys.path]
        try:
            child = await ChildProcess.launch(f"digenrl-{name}", argv, env=env)
        except BaseException:
            self._joins.pop(token, None)
            raise
        try:
            async with asyncio.timeout(self.spawn_timeout):
                worker = await self._await_join(joined, child, name)
                worker.process, worker.dedicated = child, True
                self._background(self._watch_process(worker), f"watch-{name}")
                return await self._spawn_on(worker, cls, name, args, kwargs, spec=spec)
        except BaseException:
            self._joins.pop(token, None)
            await self._discard_worker(child, name)
            raise

    async def _await_join(self, joined: asyncio.Future[Worker], child: ChildProcess, name: str) -> Worker:
        exited: asyncio.Future[Any] = asyncio.ensure_future(child.wait())
        try:
            await asyncio.wait([joined, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if not joined.done():
            joined.cancel()
            raise ActorDied(name, f"process {child.pid} {describe_exit(child.returncode)} before it joined "
                                  "(see its stderr above)")
        return joined.result()

    async def _spawn_on(self, worker: Worker, cls: type[A], name: str, args: Any, kwargs: Any,
                        spec: dict[str, str] | None = None) -> ActorRef[A]:
        if worker.address not in self._workers:
            raise ActorDied(worker.name, "worker is no longer part of this system")
        spec = spec or _agent.class_spec(cls)
        await worker.agent.call("spawn_actor", spec, name, list(args), dict(kwargs))
        worker.actors.add(name)
        return ActorRef(name, worker.address, actor_class=cls, node=self.node)

    async def _discard_worker(self, child: ChildProcess, name: str) -> None:
        # By pid too: a spawn cancelled right after the child joined has not set worker.process yet.
        worker = next((w for w in self._workers.values() if w.process is child or w.pid == child.pid), None)
        if worker is not None:
            self._workers.pop(worker.address, None)
            with contextlib.suppress(DigenrlError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await worker.agent.call("shutdown", 1.0)
        await child.stop(timeout=2.0)

    async def wait_for_workers(self, n: int = 1, timeout: float = 60.0,
                               on_join: Callable[[Worker, int], None] | None = None) -> list[Worker]:
        """Wait until ``n`` workers (``digenrl worker --join``) have joined; return the first ``n``.

        Args:
            n: how many workers to wait for.
            timeout: the deadline in seconds.
            on_join: called as ``on_join(worker, k)`` for the k-th worker (1-based), at once for
                those that joined before the call, then as each joins (progress for a launcher).

        Raises:
            TimeoutError: fewer than ``n`` joined within ``timeout`` seconds; the message says how many.
        """
        seen: set[str] = set()

        def report() -> None:
            for worker in self.workers[:n]:
                if worker.address not in seen:
                    seen.add(worker.address)
                    if on_join is not None:
                        on_join(worker, len(seen))

        try:
            async with asyncio.timeout(timeout), self._joined:
                while True:
                    report()
                    if len(self.workers) >= n:
                        return self.workers[:n]
                    await self._joined.wait()
        except TimeoutError:
            raise TimeoutError(f"{len(self.workers)} of {n} workers joined within {timeout:g} s") from None

    def worker_lost(self, worker: Worker, reason: str) -> None:
        """An outside supervisor (a launcher such as Ray) saw ``worker``'s process or host end.

        The same event as a crash the system notices itself (pending calls fail with ``ActorDied``,
        the other workers are told), only sooner than heartbeats would on a lost host. Ignored once
        the worker is gone or the system is shutting down (then its exit is expected).
        """
        if self._state == "running" and self._workers.get(worker.address) is worker:
            self._worker_died(worker, reason)

    async def _on_join(self, info: dict[str, Any]) -> dict[str, Any]:
        node = self._running()
        agent = ActorRef(_agent.AGENT, info["address"], actor_class=_agent.NodeAgent, node=node)
        worker = Worker(info["name"], info["address"], info["pid"], info["host"], agent)
        waiter = self._joins.pop(info["token"], None) if info["token"] else None
        if waiter is None and self.join_policy is not None:
            self.join_policy(worker)  # JoinRefused goes back to the worker as the join's error
        node.dead.pop(worker.address, None)
        node.last_heard[worker.address] = time.monotonic()
        self._workers[worker.address] = worker
        if waiter is not None and not waiter.done():
            waiter.set_result(worker)
        else:
            log.info("ActorSystem %s: worker %s joined from %s (pid %d at %s)",
                     self.name, worker.name, worker.host, worker.pid, worker.address)
        async with self._joined:
            self._joined.notify_all()
        return {"heartbeat_timeout": self.heartbeat_timeout}

    # -- supervision -----------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        node = self.node
        assert node is not None
        for seq in itertools.count():
            # Pings continue while DRAINING: a worker that hears nothing would think us dead.
            now = time.monotonic()
            for worker in list(self._workers.values()):
                silent = now - node.last_heard.get(worker.address, now)
                if silent > self.heartbeat_timeout and self._state == "running":
                    self._worker_died(worker, f"no heartbeat for {silent:.1f}s")
                elif worker.address not in node.dead:
                    node.send(worker.address, {"k": "ping", "i": seq})
            await asyncio.sleep(self.heartbeat_interval)

    async def _watch_process(self, worker: Worker) -> None:
        assert worker.process is not None
        code = await worker.process.wait()
        reason = f"process {worker.pid} ({worker.process.title}) {describe_exit(code)}"
        if self._state == "running" and worker.address in self._workers:
            self._worker_died(worker, reason)
        elif self._state == "running" and code != 0:  # already declared dead (transport): say how it ended
            log.error("ActorSystem %s: %s", self.name, reason)

    def _on_peer_broken(self, peer: str, error: Exception) -> None:
        # The transport saw the link drop (process exit, kill, ZMTP heartbeat loss): often the
        # first sign of a death, before the process sentinel or our own heartbeats.
        worker = self._workers.get(peer)
        if worker is None or self.node is None:
            return
        if self._state == "running":
            self._worker_died(worker, f"transport broken: {error}")
        else:  # expected while shutting down: just stop pinging it
            self.node.mark_dead(peer, f"transport broken: {error}")

    def _worker_died(self, worker: Worker, reason: str) -> None:
        node = self._running()
        self._workers.pop(worker.address, None)
        self._names.difference_update(worker.actors)
        log.error("ActorSystem %s: worker %s (actors: %s) died: %s",
                  self.name, worker.name, ", ".join(sorted(worker.actors)) or "none", reason)
        node.mark_dead(worker.address, reason)
        node.last_heard.pop(worker.address, None)
        for other in self._workers.values():
            node.send(other.address, {"k": "dead", "a": worker.address, "why": reason})
        if worker.process is not None and worker.process.returncode is None:
            # Declared dead (e.g. hung, no heartbeats) but still there: make sure it is gone.
            self._background(worker.process.stop(0.0), f"kill-{worker.name}")

    def _background(self, coro: Any, label: str) -> None:
        task = asyncio.create_task(coro, name=f"digenrl-{self.name}-{label}")
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("ActorSystem %s: %s task failed", self.name, label, exc_info=t.exception())

        task.add_done_callback(done)

    def _running(self) -> Node:
        if self._state != "running" or self.node is None:
            raise RuntimeError(f"ActorSystem is {self._state}; use it inside `async with ActorSystem()`")
        return self.node

    # -- stopping --------------------------------------------------------------------------------
    async def stop(self, actor: Any, timeout: float | None = None) -> None:
        """Drain and close one actor (its process too, if it had one of its own).

        Raises:
            ValueError: ``actor`` is not an actor of this system.
        """
        node = self._running()
        ref: ActorRef[Any] = actor.ref
        timeout = self.shutdown_timeout if timeout is None else timeout
        if ref.address == node.address and ref.name in node.hosts and ref.name in self._local:
            await node.hosts[ref.name].stop(timeout)
            self._local.remove(ref.name)
        elif (worker := self._workers.get(ref.address)) is not None and ref.name in worker.actors:
            if worker.dedicated:
                self._workers.pop(worker.address, None)
                await self._stop_worker(worker, time.monotonic() + timeout)
            else:
                await worker.agent.call("stop_actor", ref.name, timeout)
            worker.actors.discard(ref.name)
        else:
            raise ValueError(f"{ref!r} is not an actor of this system")
        self._names.discard(ref.name)

    async def aclose(self) -> None:
        """Shut everything down within ``shutdown_timeout`` (see the module docstring). Idempotent."""
        if self._state in ("closing", "closed"):
            return
        if self._state == "new":
            self._state = "closed"
            return
        self._state = "closing"
        task = asyncio.ensure_future(self._shutdown())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise

    async def _shutdown(self) -> None:
        node = self.node
        assert node is not None
        end = time.monotonic() + self.shutdown_timeout
        workers = list(self._workers.values())
        log.info("[shutdown] ActorSystem %s: step=drain local=%d workers=%d deadline=%.1fs",
                 self.name, len(self._local), len(workers), self.shutdown_timeout)
        local = [node.hosts[n].stop(max(0.0, end - time.monotonic())) for n in reversed(self._local) if n in node.hosts]
        await asyncio.gather(*local, *(self._stop_worker(w, end) for w in workers), return_exceptions=True)
        self._workers.clear()
        for task in list(self._tasks):  # heartbeats, process watchers, kills (shielded: they finish)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        registry = node.hosts.get(_agent.REGISTRY)
        if registry is not None:
            await registry.stop(0.1)
        for fut in self._joins.values():
            fut.cancel()
        await node.aclose("actor system shut down")
        self._state = "closed"
        log.info("[shutdown] ActorSystem %s: step=closed", self.name)

    async def _stop_worker(self, worker: Worker, end: float) -> None:
        """Ask the worker to drain and exit; for our own processes, make sure they are gone."""
        assert self.node is not None
        self.node.leaving.add(worker.address)
        try:
            async with asyncio.timeout(max(0.05, end - time.monotonic())):
                await worker.agent.call("shutdown", max(0.0, end - time.monotonic() - 0.2))
        except (DigenrlError, TimeoutError) as exc:  # dead already, or too slow: the process steps below
            if not isinstance(exc, ActorDied):
                log.warning("[shutdown] ActorSystem %s: step=drain worker=%s failed: %s", self.name, worker.name, exc)
        if worker.process is not None:
            await worker.process.stop(max(0.0, end - time.monotonic()))
        self._names.difference_update(worker.actors)


def _as_remote(where: str, exc: Exception) -> RemoteError:
    # In-process actors fail the same way as remote ones, so callers handle one error type.
    return _wire.remote_error({"k": "err", "i": 0, **_wire.error_fields(where, exc)})
