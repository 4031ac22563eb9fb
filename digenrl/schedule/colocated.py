"""The colocated baseline: every device samples its share, switches, trains its share, steps.

This is the hybrid-engine pattern of Flow-GRPO, DanceGRPO, GenRL and veRL-Omni's default mode, with
the switch costs those systems pay made explicit as SWITCH tokens (offload the other phase's state,
onload this phase's, re-shard weights for the rollout engine), whose length the cost model gives.

State machine per batch ``V`` (= optimizer steps done):

1. Rollout stage: a device in train phase first runs ``SWITCH(to="rollout")``; devices in rollout
   phase take whole-trajectory ROLLOUT tokens of batch ``V`` at version ``V`` (strict on-policy).
   A REWARD device scores if there is one, else the device holding the latents.
2. When every fragment of ``V`` is scored: each device runs ``SWITCH(to="train")``, then TRAIN tokens
   (by default one share per device: data-parallel), packed when ``tsp`` is on.
3. When every row is trained and every device idle in train phase: one OPTIM collective over all
   devices; ``V`` becomes ``V + 1``. No PUBLISH: the weights already sit on every device.

Faults: a dead device's rollout fragments restart, its TRAIN rows (running and accumulated) are
re-trained elsewhere, a broken OPTIM is re-issued; a joined device starts in rollout phase holding
version ``V``. No HYBRID device left: ``failed``.
"""

from __future__ import annotations

import logging
from collections import deque

from digenrl.errors import ConfigError
from digenrl.schedule._state import BatchState, FragInfo, FragState, Part
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

__all__ = ["ColocatedSchedule"]

log = logging.getLogger(__name__)

_ROLLOUT, _TRAIN = "rollout", "train"


class ColocatedSchedule(DispatchingSchedule):
    """Hybrid devices alternate rollout and training phases with explicit SWITCH tokens.

    Args:
        devices: HYBRID devices, optionally REWARD devices.
        workload: what the run consumes.
        options: ``colocated=True``; ``tsp`` packs training rows; sizes as in ``ScheduleOptions``.
        cost: predicted seconds per token and device; ``UniformCost()`` when ``None``.
        name: the schedule's name in reports.

    Raises:
        ConfigError: bad options, a ROLLOUT/TRAINER device, or no HYBRID device.
    """

    def __init__(
        self,
        devices: list[Device],
        workload: Workload,
        options: ScheduleOptions,
        cost: CostEstimate | None = None,
        name: str = "colocated",
    ) -> None:
        options.validate(workload)
        self.name = name
        self.failed = None
        self.w = workload
        self.opt = options
        self._speed = SpeedTracker(cost or UniformCost())
        self._role: dict[str, Role] = {}
        self._hybrids: dict[str, None] = {}
        self._rewards: dict[str, None] = {}
        self._phase: dict[str, str] = {}
        self._idle: dict[str, None] = {}
        self._idle_rewards: dict[str, None] = {}
        self._running: dict[str, Token] = {}
        self._kicked: dict[str, None] = {}  # devices to look at: just idle, or a stage changed
        for d in devices:
            self._join(d)
        if not self._hybrids:
            raise ConfigError("colocated schedules need at least one Role.HYBRID device")
        n = len(self._hybrids)
        self.sizes = resolve(options, workload, n, n)
        self._next_id = 0
        self.version = 0
        self._batch: BatchState | None = None
        self._optim_running = False
        self._stage = _ROLLOUT
        self._reward_queue: deque[tuple[int, int]] = deque()  # (fragment, epoch)
        self._local_reward: dict[str, deque[tuple[int, int]]] = {}

    def _join(self, d: Device) -> None:
        if d.role not in (Role.HYBRID, Role.REWARD):
            raise ConfigError(f"device {d.name!r} has role {d.role.value!r}: colocated schedules take "
                              "'hybrid' and 'reward' devices")
        if d.name in self._hybrids or d.name in self._rewards:
            raise ConfigError(f"device {d.name!r} is already alive in this schedule")
        if d.speed <= 0:
            raise ConfigError(f"device {d.name!r} has speed={d.speed}: must be > 0")
        self._role[d.name] = d.role
        self._speed.add(d)
        if d.role is Role.HYBRID:
            self._hybrids[d.name] = None
            self._phase[d.name] = _ROLLOUT
            self._idle[d.name] = None
            self._kicked[d.name] = None
        else:
            self._rewards[d.name] = None
            self._idle_rewards[d.name] = None

    def _begin(self) -> None:
        self._new_batch()

    def _on_joined(self, device: Device) -> None:
        self._join(device)

    # -- dispatch ------------------------------------------------------------------------------
    def _new_batch(self) -> None:
        g = self.sizes
        self._batch = BatchState(self.version, self.w, g.fragment_groups, g.fragment_members, gap=False)

    def _token(self, kind: TokenKind, device: str, **fields: object) -> Token:
        assert self._batch is not None
        token = Token(self._next_id, kind, device, self._batch.k, **fields)  # type: ignore[arg-type]
        self._next_id += 1
        for name in token.devices:
            self._running[name] = token
            self._idle.pop(name, None)
            self._idle_rewards.pop(name, None)
        return token

    def _dispatch(self, out: list[Token]) -> None:
        batch = self._batch
        assert batch is not None
        training = batch.all_scored
        want = _TRAIN if training else _ROLLOUT
        if want != self._stage:  # a stage change concerns every idle device once
            self._stage = want
            self._kicked.update(dict.fromkeys(self._idle))
        kicked, self._kicked = self._kicked, {}
        for name in kicked:
            if name not in self._idle:
                continue
            local = self._local_reward.get(name)
            if local:
                self._issue_reward(name, local, out)
            elif self._phase[name] != want:
                self._phase[name] = want
                out.append(self._token(TokenKind.SWITCH, name, switch_to=want, policy_version=self.version))
        # Every idle device has now been seen since the last stage change, so it is in phase `want`.
        while self._idle and (batch.train_queue if training else batch.unstarted):
            name = next(iter(self._idle))
            if training:
                limit = round(self.sizes.train_pack * self._speed.relative_speed(name, TokenKind.TRAIN))
                out.append(self._train_token(name, batch, batch.carve(limit, whole_samples=not self.opt.tsp)))
            else:
                out.append(self._rollout_token(name, batch))
        while self._idle_rewards and self._reward_queue:
            self._issue_reward(next(iter(self._idle_rewards)), self._reward_queue, out)
        ready = training and batch.fully_trained and not self._optim_running
        if ready and len(self._idle) == len(self._hybrids) and all(p == _TRAIN for p in self._phase.values()):
            self._optim_running = True
            group = tuple(self._hybrids)
            out.append(self._token(TokenKind.OPTIM, group[0], policy_version=self.version, group=group))

    def _rollout_token(self, name: str, batch: BatchState) -> Token:
        cap = round(self.sizes.rollout_batch * self._speed.relative_speed(name, TokenKind.ROLLOUT))
        chosen: list[FragInfo] = []
        samples = 0
        while batch.unstarted and (not chosen or samples + batch.frags[batch.unstarted[0]].geo.num_samples <= cap):
            info = batch.frags[batch.unstarted.popleft()]
            info.version = self.version
            info.state = FragState.RUNNING
            info.dispatched = self.w.num_steps
            chosen.append(info)
            samples += info.geo.num_samples
        batch.sample_steps_left -= samples * self.w.num_steps
        return self._token(TokenKind.ROLLOUT, name, fragment=chosen[0].geo.index, num_samples=samples, step_start=0,
                           step_end=self.w.num_steps, policy_version=self.version,
                           fragments=tuple(i.geo for i in chosen), sources=("",) * len(chosen))

    def _train_token(self, name: str, batch: BatchState, parts: list[Part]) -> Token:
        t = self.w.trained_steps
        rows = tuple((s, e) for _, s, e in parts)
        samples = sum((e - 1) // t - s // t + 1 for s, e in rows)
        return self._token(TokenKind.TRAIN, name, fragment=parts[0][0], num_samples=samples,
                           transitions=sum(e - s for s, e in rows), policy_version=self.version,
                           fragments=tuple(batch.frags[f].geo for f, _, _ in parts), rows=rows, packed=self.opt.tsp)

    def _issue_reward(self, name: str, queue: deque[tuple[int, int]], out: list[Token]) -> None:
        batch = self._batch
        assert batch is not None
        infos: list[FragInfo] = []
        samples = 0
        while queue and (not infos or samples < self.sizes.rollout_batch):
            f, epoch = queue.popleft()
            info = batch.frags[f]
            if info.epoch == epoch and info.state is FragState.AWAIT_REWARD:
                info.state = FragState.REWARDING
                infos.append(info)
                samples += info.geo.num_samples
        if infos:
            out.append(self._token(TokenKind.REWARD, name, fragment=infos[0].geo.index, num_samples=samples,
                                   policy_version=self.version, fragments=tuple(i.geo for i in infos),
                                   sources=tuple(i.holder for i in infos)))

    # -- events --------------------------------------------------------------------------------
    def _free(self, token: Token, skip: str = "") -> None:
        for name in token.devices:
            running = self._running.get(name)
            if name != skip and running is not None and running.id == token.id:
                del self._running[name]
                if name in self._hybrids:
                    self._idle[name] = None
                    self._kicked[name] = None
                elif name in self._rewards:
                    self._idle_rewards[name] = None

    def _on_done(self, event: TokenDone) -> None:
        running = self._running.get(event.token.device)
        if running is None or running.id != event.token.id:
            log.debug("ignoring completion of token %d: not running (device died?)", event.token.id)
            return
        token = running
        self._free(token)
        if event.observed_seconds is not None:
            self._speed.observe(token, event.observed_seconds)
        batch = self._batch
        assert batch is not None
        if token.kind is TokenKind.ROLLOUT:
            entries = []
            for geo in token.fragments:
                info = batch.frags[geo.index]
                info.state, info.step, info.holder = FragState.AWAIT_REWARD, self.w.num_steps, token.device
                entries.append((geo.index, info.epoch))
            if self._rewards:
                self._reward_queue.extend(entries)
            else:
                self._local_reward.setdefault(token.device, deque()).extend(entries)
        elif token.kind is TokenKind.REWARD:
            for geo in token.fragments:
                batch.score(geo.index)
        elif token.kind is TokenKind.TRAIN:
            batch.trained(token.device, [(g.index, s, e) for g, (s, e) in zip(token.fragments, token.rows)])
        elif token.kind is TokenKind.OPTIM:
            self._optim_running = False
            self.version += 1
            if not self.done:
                self._new_batch()

    def _on_died(self, name: str) -> None:
        if name not in self._hybrids and name not in self._rewards:
            log.debug("ignoring death of unknown or already dead device %r", name)
            return
        self._hybrids.pop(name, None)
        self._phase.pop(name, None)
        self._speed.remove(name)
        self._kicked.pop(name, None)
        self._rewards.pop(name, None)
        self._idle.pop(name, None)
        self._idle_rewards.pop(name, None)
        batch = self._batch
        assert batch is not None
        token = self._running.pop(name, None)
        if token is not None:
            self._free(token, skip=name)
            if token.kind is TokenKind.ROLLOUT:
                for geo in token.fragments:
                    batch.restart(geo.index)
            elif token.kind is TokenKind.REWARD:
                for geo in token.fragments:
                    self._lost_reward(batch, geo.index)
            elif token.kind is TokenKind.TRAIN:
                batch.requeue([(g.index, s, e) for g, (s, e) in zip(token.fragments, token.rows)])
            elif token.kind is TokenKind.OPTIM:
                self._optim_running = False
        for f, epoch in self._local_reward.pop(name, deque()):
            info = batch.frags[f]
            if info.epoch == epoch and info.state is FragState.AWAIT_REWARD:
                batch.restart(f)
        for info in batch.frags:  # latents awaiting a reward device die with their holder
            if info.holder == name and info.state is FragState.AWAIT_REWARD:
                batch.restart(info.geo.index)
        batch.lose_trainer(name)
        if not self._rewards and self._reward_queue:
            while self._reward_queue:  # the last reward device died: holders score their own
                f, epoch = self._reward_queue.popleft()
                info = batch.frags[f]
                if info.epoch == epoch and info.state is FragState.AWAIT_REWARD:
                    self._local_reward.setdefault(info.holder, deque()).append((f, epoch))
                    self._kicked[info.holder] = None
        if not self._hybrids:
            self.failed = f"no hybrid device left after {name!r} died (at version {self.version})"

    def _lost_reward(self, batch: BatchState, f: int) -> None:
        info = batch.frags[f]
        if info.holder in self._hybrids:
            info.state = FragState.AWAIT_REWARD
            if self._rewards:
                self._reward_queue.appendleft((f, info.epoch))
            else:
                self._local_reward.setdefault(info.holder, deque()).appendleft((f, info.epoch))
                self._kicked[info.holder] = None
        else:
            batch.restart(f)
