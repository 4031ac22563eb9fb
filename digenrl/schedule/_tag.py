"""TAG of the disaggregated schedule: when an idle trainer generates, decided BTS-style.

A mixin of ``DisaggregatedSchedule``. An idle trainer with no training work ready may take a short
step-range ROLLOUT token (``tag_steps``) of the oldest batch it may generate for: batch ``V`` at its
own version ``V`` or, with ``staleness=1``, batch ``V + 1`` (staleness 1 at training time, the same
bound the rollout devices obey). Training is always dispatched before helping.

The decision (BTS, verl-omni#321: "insert TAG only where it lowers the predicted makespan") compares
the predicted finish of the batches up to the token's one, with and without the token:

- rollout term: sample-steps not yet completed over the rollout devices' capacity, plus the tail
  (the last fragment's training after it is generated);
- the helped fragment's own path: the token, then its remaining steps on one device;
- training term: untrained rows over the trainers' capacity, plus the training the helper forgoes
  while it generates and while it switches.

Switch cost: a trainer entering helper mode onloads the rollout engine's state and must offload it
before it trains again; both are charged to the token when the cost estimate offers
``helper_switch_seconds(device)`` (``base.SwitchCost``; the simulator's cost model does). A trainer
already in helper mode pays only the way back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from digenrl.schedule._state import BatchState
from digenrl.schedule.base import Device, Role, Token, TokenKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from digenrl.schedule.base import Workload
    from digenrl.schedule.cost import SpeedTracker
    from digenrl.schedule.options import ResolvedSizes, ScheduleOptions

__all__ = ["TagMixin"]


class TagMixin:
    """Trainer-assisted generation; state lives in ``DisaggregatedSchedule``."""

    w: Workload
    opt: ScheduleOptions
    sizes: ResolvedSizes
    version: int
    _opened: int
    _speed: SpeedTracker
    _batches: dict[int, BatchState]
    _idle: dict[Role, dict[str, None]]
    _alive: dict[Role, dict[str, None]]
    _optim_running: bool
    _roll_capacity: float | None
    _train_capacity: float | None
    _helping: set[str]  # trainers set up as helpers (rollout state onloaded)
    _switch_fn: Callable[[Device], float] | None
    _switch_cache: dict[str, float]
    _devices: dict[str, Device]

    if TYPE_CHECKING:
        def _train_ready(self) -> bool: ...
        def _pick(self, versions: tuple[int, ...], only: int | None = None) -> tuple[int, int, int] | None: ...
        def _rollout_token(self, name: str, pick: tuple[int, int, int], cap: int, chunk: int,
                           helper: bool) -> Token: ...
        def _undo_rollout(self, token: Token) -> None: ...

    def _dispatch_helpers(self, out: list[Token]) -> None:
        idle = self._idle[Role.TRAINER]
        if not idle or self._optim_running or self._train_ready():
            return
        # A trainer holds only version V, so a fragment it starts for batch V + 1 must be finishable by
        # rollout devices (they keep V as their previous version once V + 1 is published).
        last = min(self._opened, self.version + (self.opt.staleness if self._alive[Role.ROLLOUT] else 0))
        for name in list(idle):
            for b in range(self.version, last + 1):
                batch = self._batches.get(b)
                if batch is None or batch.all_scored:
                    continue
                pick = self._pick((self.version,), only=b)
                if pick is not None:
                    break
            else:
                return  # nothing a trainer may generate
            if self._training_bound(pick[1]):
                return  # no helper token can shorten these batches (see _training_bound)
            cap = round(self.sizes.rollout_batch * self._speed.relative_speed(name, TokenKind.ROLLOUT))
            token = self._rollout_token(name, pick, cap, self.sizes.tag_steps, helper=True)
            if not self._helper_pays(token, name):
                self._undo_rollout(token)
                return  # the other idle trainers would get the same answer
            self._helping.add(name)
            out.append(token)

    def _capacities(self) -> tuple[float, float]:
        if self._roll_capacity is None or self._train_capacity is None:
            self._roll_capacity = sum(self._effective_rollout_rate(n) for n in self._alive[Role.ROLLOUT])
            self._train_capacity = sum(self._speed.train_rate(n) for n in self._alive[Role.TRAINER])
        return self._roll_capacity, self._train_capacity

    def _effective_rollout_rate(self, name: str) -> float:
        """Sample-steps per second of a rollout device, counting the scoring it also does.

        Without REWARD devices the device holding the final latents decodes and scores them, so
        each sample costs ``num_steps`` sample-steps plus one reward; ignoring that makes a
        rollout-bound pipeline look training-bound (and TAG would never help).
        """
        rate = self._speed.rollout_rate(name)
        if self._alive[Role.REWARD] or rate <= 0:
            return rate
        n = 64
        probe = Token(-1, TokenKind.REWARD, name, 0, num_samples=n)
        per_sample = self._speed.seconds(probe, name) / n
        steps = self.w.num_steps
        return steps / (steps / rate + per_sample)

    def helper_switch(self, name: str) -> float:
        """Predicted seconds of one onload or offload of the rollout state on trainer ``name``."""
        secs = self._switch_cache.get(name)
        if secs is None:
            fn = self._switch_fn
            secs = self._switch_cache[name] = fn(self._devices[name]) if fn is not None else 0.0
        return secs

    def _work_left(self, upto: int) -> tuple[int, int]:
        """Sample-steps not yet completed and rows not yet trained of batches ``V..upto``.

        Running rollout tokens count as work left: in a pipeline that runs ahead, most of the next
        batch is handed out long before it is generated, and trainers still wait for it.
        """
        left = rows_left = 0
        for b in range(self.version, upto + 1):
            batch = self._batches.get(b)
            if batch is not None:
                left += batch.sample_steps_undone
                rows_left += batch.rows_total - batch.rows_done
        return left, rows_left

    def _training_bound(self, upto: int) -> bool:
        """Training alone outlasts the remaining rollout: ``_helper_pays`` would say no to any token.

        Its with-help makespan is at least the training term plus the forgone training, which is
        more than the without-help makespan once that equals the training term.
        """
        roll, train = self._capacities()
        if roll <= 0:
            return False
        left, rows_left = self._work_left(upto)
        tail = self.sizes.rollout_batch * self.w.trained_steps / train
        return rows_left / train >= left / roll + tail

    def _helper_pays(self, token: Token, name: str) -> bool:
        """BTS-like test: do the batches up to ``token.batch`` finish sooner with this helper token?"""
        roll, train = self._capacities()
        if roll <= 0:
            return True  # no rollout device left: helping is the only way to finish
        switch = self.helper_switch(name)
        secs = self._speed.seconds(token, name) + switch + (0.0 if name in self._helping else switch)
        helped = token.num_samples * (token.step_end - token.step_start)
        left, rows_left = self._work_left(token.batch)  # includes the token's own sample-steps
        # After the last sample-step is generated, its fragment still has to be trained.
        tail = token.num_samples * self.w.trained_steps / train
        without = max(left / roll + tail, rows_left / train)
        one_device = max(roll / max(1, len(self._alive[Role.ROLLOUT])), self._speed.rollout_rate(name))
        rest = token.num_samples * (self.w.num_steps - token.step_end) / one_device
        with_help = max((left - helped) / roll + tail, secs + rest + tail,
                        rows_left / train + secs * self._speed.train_rate(name) / train)
        return with_help < without

