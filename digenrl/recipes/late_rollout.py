"""Late rollout actors: workers that join a running run become rollout actors, up to ``placement.max_rollout``.

::

    digenrl run configs/tiny-qwenimage.toml --set placement.max_rollout=2 --set transport.address=tcp://127.0.0.1:5555
    digenrl worker --join tcp://127.0.0.1:5555        # later, while it runs: it hosts rollout-1

Protocol, installed once the run's own actors are placed (``start_cluster``) and its coordinator built:

1. join: the system's ``join_policy`` decides before the worker is registered. ``JoinRefused`` (its
   ``digenrl worker`` exits with code 3 and the reason) when the run takes no late joins
   (``placement.max_rollout`` 0), when its live and arriving rollout actors already number
   ``placement.max_rollout``, or when the run is ending; else the worker gets the next name ``rollout-<k>``.
2. place: a ``RolloutActor`` is spawned on it (it builds its model there), learns the run's refs
   (``connect``), and every live actor learns its ref (``meet``): holders hand it fragments, reward
   actors and trainers take from it, the lead trainer publishes to it.
3. admit: :meth:`Coordinator.admit <digenrl.roles.coordinator.Coordinator.admit>`: the newest published
   versions first (zmq messages, or the gloo / nccl group re-formed with it), then tokens.

A worker that dies or fails on the way is logged and dropped; the run goes on. Workers that joined
before the run started and host nothing (more than ``placement.workers``) are taken the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from digenrl.actors import ActorSystem, Worker
from digenrl.config import Config
from digenrl.errors import JoinRefused
from digenrl.roles.coordinator import Coordinator
from digenrl.roles.rollout import RolloutActor

__all__ = ["LateRollouts"]

log = logging.getLogger(__name__)


class LateRollouts:
    """The join policy of a running run and the placement of the rollout actors it accepts.

    ::

        late = LateRollouts(cfg, system, coordinator)
        late.install()          # after start_cluster, before coordinator.run()
        ...
        await late.aclose()     # the run is ending: later joins are refused

    Args:
        cfg: the run config (``placement.max_rollout``, ``placement.rollout``).
        system: the run's actor system.
        coordinator: the run's coordinator (its live rollout actors count against the limit).
    """

    def __init__(self, cfg: Config, system: ActorSystem, coordinator: Coordinator) -> None:
        self.cfg, self.system, self.coordinator = cfg, system, coordinator
        self.limit = cfg.placement.max_rollout if cfg.placement.late_rollout else 0
        self.args = (cfg.to_dict(), cfg.placement.actor_threads)
        self._next = cfg.placement.rollout
        self._arriving: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def install(self) -> None:
        """Become the system's join policy; take the idle workers that joined already."""
        self.system.join_policy = self.check
        if self.limit:
            log.info("up to %d rollout actors in all: more may join while the run goes, with `digenrl worker --join %s`",
                     self.limit, self.system.address)
        for worker in self.system.workers:
            if not worker.actors and not worker.dedicated:
                try:
                    self.check(worker)
                except JoinRefused as exc:
                    log.warning("worker %s from %s stays idle: %s", worker.name, worker.host, exc)

    def check(self, worker: Worker) -> None:
        """Accept ``worker`` as the next rollout actor (placed in the background), or refuse it.

        Raises:
            JoinRefused: the run takes no late joins, is full, or is ending (the message says which).
        """
        place = self.cfg.placement
        if self._closed:
            raise JoinRefused("the run is ending; it takes no more workers")
        if not self.limit:
            raise JoinRefused(f"this run takes no workers once it runs (placement.max_rollout = {place.max_rollout}); "
                              f"start it with placement.max_rollout > placement.rollout = {place.rollout} to let "
                              "rollout actors join it")
        count = len({*self.coordinator.rollouts, *self._arriving})
        if count >= self.limit:
            raise JoinRefused(f"this run has {count} rollout actors, its limit (placement.max_rollout = {self.limit}); "
                              "raise placement.max_rollout to let more join")
        name = f"rollout-{self._next}"
        self._next += 1
        self._arriving.add(name)
        log.info("worker %s from %s (%s) joins the run as %s", worker.name, worker.host, worker.address, name)
        # A task: it runs once the system has registered the worker (right after this returns).
        task = asyncio.ensure_future(self._place(worker, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _place(self, worker: Worker, name: str) -> None:
        coordinator = self.coordinator
        ref: Any = None
        try:
            ref = await self.system.spawn(RolloutActor, *self.args, name=name, on=worker)
            peers = {n: coordinator.refs[n] for n in coordinator.alive}
            await ref.connect.call({**peers, name: ref})
            await asyncio.gather(*(p.meet.call({name: ref}) for p in peers.values()))
            try:
                await coordinator.admit(name, ref)
                return
            except Exception:  # logged by the coordinator
                pass
        except Exception as exc:
            log.warning("could not place %s on worker %s (%s: %s); the run goes on without it", name, worker.name,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        finally:
            self._arriving.discard(name)
        if ref is not None:  # placed but not admitted: free its worker
            with contextlib.suppress(Exception):
                await self.system.stop(ref, 1.0)

    async def aclose(self) -> None:
        """Refuse later joins and stop placing the ones under way."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
