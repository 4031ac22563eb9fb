"""The disaggregated schedule: rollout, reward and trainer devices apart, techniques as switches.

State machine (one instance per run; ``start()`` then ``on_event()`` per event):

- Versions. ``V`` = optimizer steps done = the trainers' version. Rollout devices hold the newest
  published version ``pub`` and the one before (a rollout actor keeps two), so every READY fragment
  can continue. A fragment's version is fixed by its first ROLLOUT token (trajectory-consistent):
  batch ``b`` starts with version ``max(0, b - staleness)``, whatever the timing, so a run is
  reproducible and resumes exactly (``previous_version``: the run resumes holding version -1 too).
- Rollout (``_rollout.py``). Each fragment is UNSTARTED -> (READY <-> RUNNING)* -> AWAIT_REWARD ->
  REWARDING -> SCORED. READY fragments wait in buckets keyed ``(version, batch, step)``; a ROLLOUT
  token takes one bucket's fragments up to the device's sample budget. Older batches and
  further-advanced fragments go first (depth-first, group-major: whole prompt groups finish early).
- Reward. A REWARD device scores; without one, the device holding the final latents does.
- Training. A prompt chunk's fragments become trainable when all of them are scored (with GAP), or
  when the whole batch is (without GAP, or with ``batch_advantages``: advantages need every group of
  the batch, so a TRAIN token never waits for fragments only its trainer could generate). Trainers
  carve TRAIN tokens off the batch-``V`` queue; when every row of batch ``V`` is trained and all
  trainers are idle, one OPTIM collective runs, then the lead trainer PUBLISHes ``V + 1``.
- TAG (``_tag.py``). An idle trainer with no training work ready takes a short step-range token of
  batch ``V`` (or ``V + 1`` with staleness 1) at its own version when the BTS-like makespan test,
  switch cost included, says the batches finish sooner. Training is always dispatched before helping.
- Faults. A dead device's running token is void: rollout fragments restart from noise (their
  latents are gone), rewards are re-queued, TRAIN rows are re-queued, a broken OPTIM is re-issued
  once the dead trainer's accumulated rows are re-trained, PUBLISH moves to a new lead. Fragments
  whose latents the dead device held restart too. No trainer, or nothing that can generate, left:
  ``failed`` says why and no more tokens are issued.
"""

from __future__ import annotations

import logging
from collections import deque

from digenrl.errors import ConfigError
from digenrl.schedule._rollout import Entry, RolloutMixin
from digenrl.schedule._state import BatchState, FragState, Part
from digenrl.schedule._tag import TagMixin
from digenrl.schedule.base import (
    CostEstimate,
    Device,
    DispatchingSchedule,
    Role,
    Token,
    TokenDone,
    TokenKind,
    Workload,
)
from digenrl.schedule.cost import SpeedTracker, UniformCost
from digenrl.schedule.options import ScheduleOptions, resolve

__all__ = ["DisaggregatedSchedule"]

log = logging.getLogger(__name__)

_POOLS = (Role.ROLLOUT, Role.TRAINER, Role.REWARD)


class DisaggregatedSchedule(RolloutMixin, TagMixin, DispatchingSchedule):
    """Disaggregated schedule with GAP, TSP, TAG and one-step async as switches.

    Args:
        devices: the devices at start; roles ROLLOUT, TRAINER and (optional) REWARD.
        workload: what the run consumes.
        options: the switches (see ``ScheduleOptions``).
        cost: predicted seconds per token and device; ``UniformCost()`` when ``None``.
        name: the schedule's name in reports.

    Raises:
        ConfigError: bad options, a HYBRID device, no trainer, or nothing able to generate.
    """

    def __init__(
        self,
        devices: list[Device],
        workload: Workload,
        options: ScheduleOptions,
        cost: CostEstimate | None = None,
        name: str = "disaggregated",
    ) -> None:
        options.validate(workload)
        if options.colocated:
            raise ConfigError("schedule.colocated=true needs ColocatedSchedule (make_schedule('colocated', ...))")
        self.name = name
        self.failed = None
        self.w = workload
        self.opt = options
        self._speed = SpeedTracker(cost or UniformCost())
        # TAG's onload/offload of the rollout state, when the cost estimate models it (base.SwitchCost).
        self._switch_fn = getattr(cost, "helper_switch_seconds", None)
        self._switch_cache: dict[str, float] = {}
        self._helping: set[str] = set()
        self._devices: dict[str, Device] = {}
        self._role: dict[str, Role] = {}
        self._alive: dict[Role, dict[str, None]] = {r: {} for r in _POOLS}
        self._idle: dict[Role, dict[str, None]] = {r: {} for r in _POOLS}
        self._running: dict[str, Token] = {}  # device -> its token (OPTIM: every group member)
        self._kicked: dict[str, None] = {}  # just idle: may have a local reward to run
        for d in devices:
            self._check_new(d)
        if not self._alive[Role.TRAINER]:
            raise ConfigError("disaggregated schedules need at least one Role.TRAINER device")
        if not self._alive[Role.ROLLOUT] and not options.tag:
            raise ConfigError("no Role.ROLLOUT device and schedule.tag=false: nothing can generate")
        self.sizes = resolve(options, workload, len(self._alive[Role.ROLLOUT]), len(self._alive[Role.TRAINER]))
        for d in devices:
            self._add(d)
        self._next_id = 0
        self._batches: dict[int, BatchState] = {}
        self._opened = -1
        self.version = 0  # V: optimizer steps done
        self.published = 0  # newest version on the rollout devices
        # A resumed one-step-stale run starts holding the version before the checkpoint too (-1 here).
        self._prev_published = self._first_version
        self._publish_queue: deque[int] = deque()
        self._optim_running = False
        self._buckets: dict[tuple[int, int, int], deque[Entry]] = {}  # (version, batch, step)
        self._heaps: dict[int, list[tuple[int, int]]] = {}  # version -> (batch, -step)
        self._in_heap: set[tuple[int, int, int]] = set()
        self._reward_queue: deque[tuple[int, int, int]] = deque()  # (batch, fragment, epoch)
        self._local_reward: dict[str, deque[tuple[int, int, int]]] = {}
        self._held: dict[str, set[tuple[int, int]]] = {}  # device -> (batch, fragment) latents it holds
        self._roll_capacity: float | None = None
        self._train_capacity: float | None = None

    # -- devices -------------------------------------------------------------------------------
    def _check_new(self, d: Device) -> None:
        if d.role not in _POOLS:
            raise ConfigError(f"device {d.name!r} has role {d.role.value!r}: disaggregated schedules take "
                              f"{[r.value for r in _POOLS]} (HYBRID devices belong to 'colocated')")
        if d.name in self._role and d.name in self._alive[self._role[d.name]]:
            raise ConfigError(f"device {d.name!r} is already alive in this schedule")
        if d.speed <= 0:
            raise ConfigError(f"device {d.name!r} has speed={d.speed}: must be > 0")
        self._role[d.name] = d.role
        self._alive[d.role][d.name] = None

    def _add(self, d: Device) -> None:
        self._devices[d.name] = d
        self._switch_cache.pop(d.name, None)
        self._helping.discard(d.name)  # a (re)joined trainer starts set up for training
        self._idle[d.role][d.name] = None
        self._kicked[d.name] = None
        self._speed.add(d)
        self._roll_capacity = self._train_capacity = None

    def _is_alive(self, name: str) -> bool:
        role = self._role.get(name)
        return role is not None and name in self._alive[role]

    @property
    def _lead(self) -> str | None:
        return next(iter(self._alive[Role.TRAINER]), None)

    # -- public API ----------------------------------------------------------------------------
    def _begin(self) -> None:
        self._open_batches()

    def _on_joined(self, device: Device) -> None:
        self._check_new(device)
        self._add(device)

    def _before_dispatch(self) -> None:
        if not self._alive[Role.ROLLOUT]:
            self._restart_orphans()

    def _restart_orphans(self) -> None:
        """No rollout device left: READY fragments of a version older than the trainers' ``V`` can
        never continue (only rollout devices keep an older version), so they restart from noise."""
        for batch in self._batches.values():
            for info in batch.frags:
                if info.state is FragState.READY and info.version < self.version:
                    if info.holder in self._held:
                        self._held[info.holder].discard((batch.k, info.geo.index))
                    batch.restart(info.geo.index)

    # -- helpers -------------------------------------------------------------------------------
    def _token(self, kind: TokenKind, device: str, batch: int, **fields: object) -> Token:
        token = Token(self._next_id, kind, device, batch, **fields)  # type: ignore[arg-type]
        self._next_id += 1
        for name in token.devices:
            self._running[name] = token
            self._idle[self._role[name]].pop(name, None)
        return token

    def _open_batches(self) -> None:
        s = self.opt.staleness
        upto = min(self.w.num_batches - 1, max(self.published + s, self.version))
        while self._opened < upto:
            self._opened += 1
            g = self.sizes
            # (batch-wide advantages: the full-batch barrier, whatever the fragments' sizes)
            self._batches[self._opened] = BatchState(self._opened, self.w, g.fragment_groups, g.fragment_members,
                                                     self.opt.gap and not self.opt.batch_advantages)

    # -- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, out: list[Token]) -> None:
        self._dispatch_publish(out)
        self._dispatch_optim(out)
        self._dispatch_train(out)
        kicked, self._kicked = self._kicked, {}
        for name in kicked:
            queue = self._local_reward.get(name)
            role = self._role[name]
            if queue and name in self._idle[role] and not (role is Role.TRAINER and self._train_ready()):
                self._issue_reward(name, queue, out)
        idle = self._idle[Role.REWARD]
        while idle and self._reward_queue:
            self._issue_reward(next(iter(idle)), self._reward_queue, out)
        self._dispatch_rollout(out)
        if self.opt.tag:
            self._dispatch_helpers(out)

    def _dispatch_publish(self, out: list[Token]) -> None:
        lead = self._lead
        if self._publish_queue and lead is not None and lead in self._idle[Role.TRAINER]:
            v = self._publish_queue.popleft()
            out.append(self._token(TokenKind.PUBLISH, lead, v - 1, policy_version=v))

    def _dispatch_optim(self, out: list[Token]) -> None:
        batch = self._batches.get(self.version)
        trainers = self._alive[Role.TRAINER]
        if (batch is None or self._optim_running or not batch.fully_trained
                or len(self._idle[Role.TRAINER]) != len(trainers)):
            return
        group = tuple(trainers)
        self._optim_running = True
        out.append(self._token(TokenKind.OPTIM, group[0], batch.k, policy_version=batch.k, group=group))

    def _train_ready(self) -> bool:
        batch = self._batches.get(self.version)
        return batch is not None and not self._optim_running and bool(batch.train_queue)

    def _dispatch_train(self, out: list[Token]) -> None:
        idle = self._idle[Role.TRAINER]
        while idle and self._train_ready():
            name = next(iter(idle))
            batch = self._batches[self.version]
            limit = round(self.sizes.train_pack * self._speed.relative_speed(name, TokenKind.TRAIN))
            parts = batch.carve(limit, whole_samples=not self.opt.tsp)
            out.append(self._train_token(name, batch, parts))

    def _train_token(self, name: str, batch: BatchState, parts: list[Part]) -> Token:
        t = self.w.trained_steps
        frags = tuple(batch.frags[f].geo for f, _, _ in parts)
        rows = tuple((s, e) for _, s, e in parts)
        transitions = sum(e - s for s, e in rows)
        samples = sum((e - 1) // t - s // t + 1 for s, e in rows)
        self._helping.discard(name)  # the driver offloads the rollout state before training
        return self._token(TokenKind.TRAIN, name, batch.k, fragment=frags[0].index, num_samples=samples,
                           transitions=transitions, policy_version=batch.frags[parts[0][0]].version,
                           fragments=frags, rows=rows, packed=self.opt.tsp)

    # -- completions ---------------------------------------------------------------------------
    def _on_done(self, event: TokenDone) -> None:
        token = event.token
        running = self._running.get(token.device)
        if running is None or running.id != token.id:
            log.debug("ignoring completion of token %d: not running (device died?)", token.id)
            return
        token = running  # the schedule's own copy, whatever the driver sent back
        for name in token.devices:
            other = self._running.get(name)
            if other is not None and other.id == token.id:
                del self._running[name]
                if name in self._alive[self._role[name]]:
                    self._idle[self._role[name]][name] = None
                    self._kicked[name] = None
        if event.observed_seconds is not None:
            self._speed.observe(token, event.observed_seconds)
        kind = token.kind
        if kind is TokenKind.ROLLOUT:
            self._rollout_done(token)
        elif kind is TokenKind.REWARD:
            batch = self._batches[token.batch]
            for geo in token.fragments:
                info = batch.frags[geo.index]
                if info.holder in self._held:
                    self._held[info.holder].discard((batch.k, geo.index))
                batch.score(geo.index)
        elif kind is TokenKind.TRAIN:
            batch = self._batches[token.batch]
            batch.trained(token.device, [(g.index, s, e) for g, (s, e) in zip(token.fragments, token.rows)])
        elif kind is TokenKind.OPTIM:
            self._optim_running = False
            del self._batches[token.batch]
            self.version = token.batch + 1
            if not self.done:
                self._publish_queue.append(self.version)
            self._open_batches()
        elif kind is TokenKind.PUBLISH:
            if token.policy_version > self.published:
                self._prev_published, self.published = self.published, token.policy_version
            self._open_batches()

    # -- faults --------------------------------------------------------------------------------
    def _on_died(self, name: str) -> None:
        role = self._role.get(name)
        if role is None or name not in self._alive[role]:
            log.debug("ignoring death of unknown or already dead device %r", name)
            return
        del self._alive[role][name]
        self._idle[role].pop(name, None)
        self._speed.remove(name)
        self._helping.discard(name)
        self._kicked.pop(name, None)
        self._roll_capacity = self._train_capacity = None
        token = self._running.pop(name, None)
        if token is not None:
            self._void(token, name)
        for b, f in self._held.pop(name, set()):
            batch = self._batches.get(b)
            if batch is not None and batch.frags[f].state in (FragState.READY, FragState.AWAIT_REWARD):
                batch.restart(f)
        for b, f, epoch in self._local_reward.pop(name, deque()):
            batch = self._batches.get(b)
            if batch is not None and self._live(batch, (f, epoch), FragState.AWAIT_REWARD):
                batch.restart(f)
        if role is Role.TRAINER:
            batch = self._batches.get(self.version)
            if batch is not None:
                batch.lose_trainer(name)
        if role is Role.REWARD and not self._alive[Role.REWARD]:
            self._reroute_rewards()
        if not self._alive[Role.TRAINER]:
            self.failed = f"no trainer left after {name!r} died (at version {self.version})"
        elif not self._alive[Role.ROLLOUT] and not self.opt.tag:
            self.failed = f"no rollout-capable device left after {name!r} died and schedule.tag=false"

    def _void(self, token: Token, name: str) -> None:
        """The running ``token`` of dead device ``name`` will never complete: re-queue its work."""
        kind = token.kind
        for other in token.devices:  # an OPTIM's survivors are free again
            running = self._running.get(other)
            if other != name and running is not None and running.id == token.id:
                del self._running[other]
                self._idle[self._role[other]][other] = None
                self._kicked[other] = None
        batch = self._batches.get(token.batch)
        if kind is TokenKind.ROLLOUT and batch is not None:
            for geo in token.fragments:
                batch.restart(geo.index)
        elif kind is TokenKind.REWARD and batch is not None:
            for geo in token.fragments:
                info = batch.frags[geo.index]
                if self._is_alive(info.holder):
                    info.state = FragState.AWAIT_REWARD
                    entry = (batch.k, geo.index, info.epoch)
                    if self._alive[Role.REWARD]:
                        self._reward_queue.appendleft(entry)
                    else:
                        self._local_reward.setdefault(info.holder, deque()).appendleft(entry)
                        self._kicked[info.holder] = None
                else:
                    batch.restart(geo.index)
        elif kind is TokenKind.TRAIN and batch is not None:
            batch.requeue([(g.index, s, e) for g, (s, e) in zip(token.fragments, token.rows)])
        elif kind is TokenKind.OPTIM:
            self._optim_running = False
        elif kind is TokenKind.PUBLISH:
            self._publish_queue.appendleft(token.policy_version)

    def _reroute_rewards(self) -> None:
        """The last REWARD device died: the latents' holders score their own fragments."""
        while self._reward_queue:
            b, f, epoch = self._reward_queue.popleft()
            batch = self._batches.get(b)
            if batch is None or not self._live(batch, (f, epoch), FragState.AWAIT_REWARD):
                continue
            holder = batch.frags[f].holder
            self._local_reward.setdefault(holder, deque()).append((b, f, epoch))
            self._kicked[holder] = None
