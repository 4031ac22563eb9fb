"""The Ray launcher: Ray places and supervises the run's processes; digenrl's runtime stays the data plane.

::

    digenrl run configs/qwenimage.toml --launcher ray [--ray-address HOST:PORT]
    # or [cluster] launcher = "ray", address = "auto", strategy = "PACK"

What Ray does here, and only this: it reserves one placement group with a bundle per actor (one GPU per
bundle when ``model.device`` is cuda, else CPUs only, plus ``placement.rollout_resources`` /
``trainer_resources``: an ``accelerator_type`` or custom resources for heterogeneous pools), and runs
in each bundle a small Ray actor, ``WorkerHost``, that starts one digenrl worker process
(``python -m digenrl.actors._child``) joining the run's :class:`~digenrl.actors.ActorSystem`. Ray
makes the bundle's GPU visible (``CUDA_VISIBLE_DEVICES``), collects the worker's logs and notices
dead actors and nodes. The coordinator stays in the driver; control, latents and weights go over
digenrl's own transports between the worker processes, as with ``digenrl worker --join``.

Failures. The worker process dies with its host actor (``PR_SET_PDEATHSIG`` SIGKILL), so a Ray
actor or node that dies is, for the coordinator, what ``kill -9`` of an actor process is: a rollout
actor's tokens are re-issued, a trainer's death stops the run with the last checkpoint and a resume
hint. The launcher forwards Ray's notice to the system at once (:meth:`ActorSystem.worker_lost`)
rather than waiting for heartbeats.

Teardown (leaving the ``async with``, also on Ctrl-C or an error): the system has already let its
workers go; the launcher waits briefly for each worker to exit, kills the host actors, removes the
placement group and shuts down a Ray instance it started itself. A driver killed outright leaves
nothing either: Ray ends a job's actors and placement groups with its driver, and their workers with
them.

Ray is an optional extra (``pip install 'digenrl[ray]'``); this module is the only one importing it.
Ray's usage statistics are off (``RAY_USAGE_STATS_ENABLED=0``) unless the user set that variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digenrl.actors import ActorSystem, Worker
from digenrl.actors._agent import class_spec
from digenrl.actors.loop import running_loop_name
from digenrl.config import Config
from digenrl.errors import ConfigError
from digenrl.schedule.base import Role
from digenrl.transport.curve import is_loopback

__all__ = ["Bundle", "RayLauncher", "WorkerHost", "check_ray", "host_actor_name", "plan_bundles"]

log = logging.getLogger(__name__)

RAY_HINT = "install it with `pip install 'digenrl[ray]'` (or `.venv/bin/python -m pip install -e '.[ray]'`)"
_KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")


@dataclass(frozen=True)
class Bundle:
    """One actor's slot: its name, the class its worker may host, and the Ray resources it reserves."""

    actor: str
    role: Role
    cls: type
    resources: dict[str, float]


def plan_bundles(cfg: Config, actors: list[tuple[str, Role, type]]) -> list[Bundle]:
    """A bundle per actor: ``placement.actor_threads`` CPUs, a GPU on cuda (``1 / placement.actors_per_gpu`` of
    one), plus the role's resources.

    ``accelerator_type = "L40S"`` becomes Ray's ``accelerator_type:L40S`` resource (what nodes with
    that GPU advertise), ``num_cpus``/``num_gpus`` replace the defaults, other keys are custom
    resources. Reward actors share the rollout actors' request (they score beside them).
    """
    place, gpu = cfg.placement, cfg.model.device.startswith("cuda")
    extra = {Role.ROLLOUT: place.rollout_resources, Role.REWARD: place.rollout_resources,
             Role.TRAINER: place.trainer_resources}
    out = []
    for name, role, cls in actors:
        # placement.actors_per_gpu > 1: fractional GPUs, which Ray packs onto one device
        res: dict[str, float] = {"CPU": float(place.actor_threads), **({"GPU": 1.0 / place.actors_per_gpu} if gpu else {})}
        for key, value in extra[role].items():
            if key == "accelerator_type":
                res[f"accelerator_type:{value}"] = 0.001  # Ray's own convention for accelerator_type=
            else:
                res[{"num_cpus": "CPU", "num_gpus": "GPU"}.get(key, key)] = float(value)
        out.append(Bundle(name, role, cls, {k: v for k, v in res.items() if v > 0}))
    return out


def host_actor_name(actor: str) -> str:
    """The Ray name of the host actor of ``actor`` in this driver's run (``ray.get_actor`` finds it);
    ``""``: the placement group's name."""
    return f"digenrl-{socket.gethostname()}-{os.getpid()}" + (f"-{actor}" if actor else "")


# Ray's switch for a single-node, loopback-only instance (named for macOS/Windows, where it is the default):
# its node, GCS and workers then use 127.0.0.1 instead of this host's interface address. Read when ray is
# imported, and inherited by the raylet and workers it starts.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


_RAY_MISSING = f"cluster.launcher = 'ray' needs Ray, which is not installed; {RAY_HINT}"


def check_ray() -> None:
    """Refuse ``cluster.launcher = "ray"`` at once where Ray is not installed (``digenrl validate`` and run).

    Ray is found, not imported: importing it reads the switches :func:`_import_ray` sets first.

    Raises:
        ConfigError: the launcher's own missing-Ray error.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError(_RAY_MISSING)


def _import_ray(loopback_only: bool = False) -> Any:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing phones home unless the user asks
    if loopback_only:  # a private Ray for this run alone: nothing of it listens off loopback
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    try:
        import ray
    except ImportError:
        raise ConfigError(_RAY_MISSING) from None
    return ray


class WorkerHost:
    """The Ray actor of one bundle: starts one digenrl worker process and reports how it ended.

    The worker starts in ``__init__``, which Ray runs on the actor process's main thread: Linux sends
    ``PR_SET_PDEATHSIG`` when the *thread* that started a child exits, and the main thread lives exactly
    as long as the actor. Methods run threaded (``max_concurrency``), so ``wait`` blocks while ``stop``
    is called.
    """

    def __init__(self, argv: list[str], keys: dict[str, bytes] | None) -> None:
        import ray

        self.keys_dir: str | None = None
        ip = ray.util.get_node_ip_address()
        if keys is not None:  # handed over by the launcher: a private copy on this node
            self.keys_dir = tempfile.mkdtemp(prefix="digenrl-keys-")
            for name, data in keys.items():
                fd = os.open(os.path.join(self.keys_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            argv = [*argv, "--keys", self.keys_dir]
        join = argv[argv.index("--join") + 1]
        # Peers reply to the address a worker binds: loopback for a one-host run, else this node's IP.
        listen = "tcp://127.0.0.1:0" if is_loopback(join) else f"tcp://{ip}:0"
        cmd = [sys.executable, "-m", "digenrl.actors._child", *argv, "--listen", listen,
               "--parent-pid", str(os.getpid()), "--parent-signal", "SIGKILL"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.where = {"host_pid": os.getpid(), "worker_pid": self.proc.pid, "node_ip": ip,
                      "node_id": ray.get_runtime_context().get_node_id(),
                      "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def info(self) -> dict[str, Any]:
        """The pids of this actor and its worker, the node's address and id, the visible GPUs."""
        return self.where

    def wait(self) -> int:
        """Block until the worker process exits; its exit code (negative: the signal that killed it)."""
        code = self.proc.wait()
        if self.keys_dir is not None:
            import shutil

            shutil.rmtree(self.keys_dir, ignore_errors=True)
        return code

    def stop(self, timeout: float) -> int | None:
        """SIGTERM the worker (it drains and exits), SIGKILL after ``timeout``; its exit code."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class RayLauncher:
    """Reserve a placement group, host one digenrl worker per bundle, tear it all down on exit.

    ::

        async with RayLauncher(cfg, actors) as launcher, ActorSystem(address="tcp://...") as system:
            workers = await launcher.start_workers(system)     # {"trainer-0": Worker, ...}

    Raises (from ``__aenter__``):
        ConfigError: Ray is missing, the cluster lacks a resource the bundles ask for (named with its
            config key), or the placement group is not ready within ``placement.join_timeout``.
    """

    def __init__(self, cfg: Config, actors: list[tuple[str, Role, type]], logs: Path | None = None) -> None:
        self.cfg = cfg
        self.logs = logs  # where a dead raylet's last log lines go (the run directory); None: a temporary file
        self._unroute: Callable[[], None] | None = None
        self.bundles = plan_bundles(cfg, actors)
        self.ray: Any = None
        self.pg: Any = None
        self.hosts: dict[str, Any] = {}  # actor name -> WorkerHost handle
        self.info: dict[str, dict[str, Any]] = {}  # actor name -> what WorkerHost.start returned
        self._waits: dict[str, asyncio.Future[int]] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._owns_ray = False
        self._closing = False

    @property
    def placement_group_id(self) -> str | None:
        """The hex id of the run's placement group (``ray.util.placement_group_table()`` key)."""
        return None if self.pg is None else self.pg.id.hex()

    async def __aenter__(self) -> RayLauncher:
        ray = self.ray = _import_ray(loopback_only=self.cfg.cluster.address == "local")
        try:
            self._connect(ray)
            self._check_resources(ray)
            self._check_address(ray)
            await self._reserve(ray)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():  # the embedding program (or a test) connected already
            return
        address = self.cfg.cluster.address
        local = address == "local"
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING}
        if local:  # a private instance for this run: no dashboard
            kwargs["include_dashboard"] = False
        # address None: RAY_ADDRESS, else the cluster this host joined with `ray start`, else a new local one.
        ray.init(address=None if address in ("auto", "local") else address, **kwargs)
        self._owns_ray = True
        log.info("Ray: connected (%s), %d node(s)", address, len(ray.nodes()))
        self._unroute = _route_raylet_deaths(self.logs)

    def _check_resources(self, ray: Any) -> None:
        total = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in self.bundles:
            for key, amount in b.resources.items():
                need[key] = need.get(key, 0.0) + amount
        for key, amount in need.items():
            if total.get(key, 0.0) + 1e-9 < amount:
                raise ConfigError(f"{self._config_key(key)}: the bundles need {key} = {amount:g} in all, the Ray "
                                  f"cluster has {total.get(key, 0.0):g} (cluster resources: "
                                  f"{_short(total)})")

    def _config_key(self, resource: str) -> str:
        """The config key a resource came from, for error messages."""
        for role, key in ((Role.ROLLOUT, "rollout_resources"), (Role.TRAINER, "trainer_resources")):
            table = getattr(self.cfg.placement, key)
            names = {f"accelerator_type:{v}" if k == "accelerator_type" else k for k, v in table.items()}
            if resource in names or (resource in ("CPU", "GPU") and f"num_{resource.lower()}s" in table):
                return f"placement.{key}"
        if resource == "GPU":
            return "model.device = 'cuda' (one GPU per actor: placement.rollout + trainer + reward)"
        return "placement.actor_threads x (placement.rollout + trainer + reward)"

    def _check_address(self, ray: Any) -> None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        address = self.cfg.transport.address
        if len(nodes) > 1 and (not address or is_loopback(address)):
            raise ConfigError(f"transport.address = {address or '(loopback)'!r}: the Ray cluster has {len(nodes)} "
                              "nodes, whose workers must reach this driver; set transport.address = "
                              "'tcp://<this host's IP>:<port>' and transport.keys (digenrl keys create PATH)")

    async def _reserve(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group

        timeout = self.cfg.placement.join_timeout
        self.pg = placement_group([b.resources for b in self.bundles], strategy=self.cfg.cluster.strategy,
                                  name=host_actor_name(""))
        try:
            await asyncio.wait_for(_future(self.pg.ready()), timeout)
        except TimeoutError:
            raise ConfigError(f"the Ray placement group ({len(self.bundles)} bundles, strategy "
                              f"{self.cfg.cluster.strategy}: {[b.resources for b in self.bundles]}) was not ready "
                              f"within placement.join_timeout = {timeout:g} s: the cluster has the resources in all "
                              "but not free, or not on the nodes cluster.strategy allows") from None
        log.info("Ray: placement group %s ready (%d bundles, %s)", self.placement_group_id, len(self.bundles),
                 self.cfg.cluster.strategy)

    async def start_workers(self, system: ActorSystem) -> dict[str, Worker]:
        """Start a worker process in every bundle, joined to ``system``; returns them by actor name.

        Raises:
            ConfigError: a worker did not join within ``placement.join_timeout`` or exited first.
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        keys = _key_files(system.keys.path) if system.keys is not None else None
        host_cls = ray.remote(max_concurrency=4)(WorkerHost)
        starts = {}
        for i, b in enumerate(self.bundles):
            res = dict(b.resources)
            opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0),
                                    "resources": res, "name": host_actor_name(b.actor), "max_restarts": 0,
                                    "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, i)}
            spec = class_spec(b.cls)
            argv = ["--join", system.address, "--name", b.actor, "--transport", system.transport_kind,
                    "--parent-timeout", str(system.heartbeat_timeout), "--allow", f"{spec['mod']}:{spec['qual']}",
                    "--event-loop", running_loop_name(),
                    "--log-level", logging.getLevelName(logging.getLogger("digenrl.actors").getEffectiveLevel())]
            host = host_cls.options(**opts).remote(argv, keys)  # type: ignore[attr-defined]
            self.hosts[b.actor] = host
            starts[b.actor] = _future(host.info.remote())
        for name, fut in starts.items():
            self.info[name] = await fut
            self._waits[name] = _future(self.hosts[name].wait.remote())
        return await self._joined(system)

    async def _joined(self, system: ActorSystem) -> dict[str, Worker]:
        names = [b.actor for b in self.bundles]
        timeout = self.cfg.placement.join_timeout
        join = asyncio.ensure_future(system.wait_for_workers(len(names), timeout=timeout))
        try:
            await asyncio.wait([join, *self._waits.values()], return_when=asyncio.FIRST_COMPLETED)
            for name, fut in self._waits.items():
                if fut.done():
                    raise ConfigError(f"the Ray worker for {name} (node {self.info[name]['node_ip']}) "
                                      f"{_ended(fut)} before it joined; its log is in Ray's worker logs "
                                      "(printed above by Ray)")
            workers = join.result()
        except TimeoutError:
            raise ConfigError(f"{len(system.workers)} of {len(names)} Ray workers joined {system.address} within "
                              f"placement.join_timeout = {timeout:g} s; can the Ray nodes reach this address?") from None
        finally:
            join.cancel()
        by_name = {w.name: w for w in workers}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ConfigError(f"workers {missing} did not join; others joined instead: {sorted(by_name)} "
                              f"(another `digenrl worker --join {system.address}`?)")
        for name in names:
            self._watchers.append(asyncio.create_task(self._watch(system, name, by_name[name])))
        return {n: by_name[n] for n in names}

    async def _watch(self, system: ActorSystem, name: str, worker: Worker) -> None:
        """Forward Ray's word that a host (or its node) ended to the system, as a crash."""
        fut = self._waits[name]
        with contextlib.suppress(Exception):
            await asyncio.shield(fut)
        if not self._closing:
            why = _ended(fut)
            log.error("Ray: the worker of %s (node %s) %s", name, self.info[name]["node_ip"], why)
            system.worker_lost(worker, f"Ray: {why}")

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop the watchers, let the workers exit (kill them after ``timeout``), release everything. Idempotent.

        Every step is bounded: after ``ray stop`` (or the loss of the head node) Ray's own calls would
        block, and the run's error must still reach the user; what Ray no longer answers for ends with it.
        """
        self._closing = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers.clear()
        if self.hosts:
            # The system told its workers to exit already; a short wait, then SIGTERM/SIGKILL via stop().
            pending = [f for f in self._waits.values() if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=timeout)
            stops = [_future(h.stop.remote(1.0)) for n, h in self.hosts.items()
                     if n in self._waits and not self._waits[n].done()]
            if stops:
                await asyncio.wait(stops, timeout=timeout)
                for fut in stops:  # a host on a dead node cannot answer: expected, not news
                    if fut.done() and not fut.cancelled():
                        fut.exception()
            for fut in self._waits.values():
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # a host on a dead node (its watcher already cancelled): expected, not news
        if self._unroute is not None:
            self._unroute()
            self._unroute = None
        hosts, pg, owns = list(self.hosts.values()), self.pg, self._owns_ray
        self.hosts, self.pg, self._owns_ray = {}, None, False
        if not (hosts or pg is not None or owns):
            return
        if await _bounded(lambda: self._release(hosts, pg), timeout):
            if pg is not None:
                log.info("[shutdown] RayLauncher: step=removed placement group %s", pg.id.hex())
            if owns and self.ray.is_initialized():
                self.ray.shutdown()
        else:
            log.warning("[shutdown] RayLauncher: step=release Ray did not answer within %.0f s (`ray stop`, or its "
                        "head node lost?); the run's Ray actors and placement group end with that cluster", timeout)

    def _release(self, hosts: list[Any], pg: Any) -> None:
        for host in hosts:
            with contextlib.suppress(Exception):
                self.ray.kill(host, no_restart=True)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)


_RAYLET_DIED = "Raylet is terminated"


def _route_raylet_deaths(logs: Path | None) -> Callable[[], None]:
    """A raylet's death, which Ray reports to the driver with its last 20 log lines, as one line; the lines in a file.

    Ray prints the report through ``ray._private.worker.print_to_stdstream`` (its error listener calls it by
    name); every other line Ray streams passes through as before. Returns the function that undoes it.
    """
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:  # another Ray: its reports stay as Ray prints them
        return lambda: None
    count = itertools.count(1)
    seen: set[int] = set()  # the node's agents each report the same death: once is enough

    def routed(data: dict[str, Any], ignore_prefix: bool) -> None:
        lines = [str(line) for line in data.get("lines", [])]
        if data.get("pid") != "raylet" or not lines or not lines[0].startswith(_RAYLET_DIED):
            original(data, ignore_prefix)
            return
        if hash(tuple(lines)) in seen:
            return
        seen.add(hash(tuple(lines)))
        where = logs if logs is not None and logs.is_dir() else Path(tempfile.gettempdir())
        path = where / f"ray-raylet-died-{os.getpid()}-{next(count)}.log"
        try:
            path.write_text("\n".join(lines) + "\n")
            kept = f"its last log lines are in {path}"
        except OSError as exc:
            kept = f"its last log lines could not be written to {path}: {exc}"
        unexpected = "unexpected" in lines[0].split("\n", 1)[0]
        log.error("Ray: a node's raylet died%s; %s", " unexpectedly (kill -9, the OOM killer or a crash)" if unexpected
                  else "", kept)

    ray_worker.print_to_stdstream = routed

    def undo() -> None:
        if ray_worker.print_to_stdstream is routed:
            ray_worker.print_to_stdstream = original

    return undo


async def _bounded(fn: Callable[[], None], timeout: float) -> bool:
    """Run the blocking ``fn`` on a daemon thread (it may never return); whether it returned within ``timeout``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def target() -> None:
        error: BaseException | None = None
        try:
            fn()
        except Exception as exc:
            error = exc
        loop.call_soon_threadsafe(lambda: done.done() or (done.set_exception(error) if error else done.set_result(None)))

    threading.Thread(target=target, name="digenrl-ray-release", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        return False
    except Exception as exc:
        log.warning("[shutdown] RayLauncher: step=release failed: %s", exc)
    return True


def _future(ref: Any) -> asyncio.Future[Any]:
    """An ObjectRef as a future of the running loop (any loop, uvloop included)."""
    return asyncio.wrap_future(ref.future())


def _ended(fut: asyncio.Future[int]) -> str:
    if fut.cancelled():
        return "was cancelled"
    exc = fut.exception()
    if exc is not None:
        return f"is lost: its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return _describe(fut.result())


def _key_files(path: str) -> dict[str, bytes]:
    """The cluster's key files, handed to each Ray worker (they travel over Ray's own channels)."""
    return {name: (Path(path) / name).read_bytes() for name in _KEY_FILES}


def _short(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "object_store", "memory"))}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "none"
