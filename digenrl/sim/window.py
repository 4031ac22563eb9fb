"""A sliding SDE window's arithmetic: where the window is at each policy version, and what a rollout then runs.

MixGRPO (ALGORITHMS-FORWARD §2, Tencent-Hunyuan/MixGRPO ``GRPOTrainingStates``) samples the SDE only in a window of
``W`` steps, Euler ODE elsewhere, and trains the window's transitions. The window's start advances with the trainer:
it is ``0`` for the first ``shift_every`` optimizer steps, then ``1``, ... , up to ``N - 2 - W``, then back to
``0``. ``shift_every = 0`` keeps it at ``0`` (MixGRPO-Flash*). The reference trains steps up to ``N - 3`` (its
``max_timesteps = N - 2`` is exclusive) and lets the start run on to ``N - 2`` with the window cut there, shrinking
to one step, then none, before it rolls back; here the window rolls back where the reference's would be cut, so
every window has ``W`` steps and every sample trains the same number of transitions. The published recipes (300
iterations, a move every 25 or 20) never reach that end.

Flash: the ``N - e`` ODE steps after the window (``e`` its end) are replaced by ``K`` steps of a second-order solver,
``K + 1 = max(int((N - e + 1) ratio), 2)`` noise levels (the reference's count, which at ``1`` would stop short of
a clean sample: at least one step here). A sample then costs ``e + K`` transformer forwards instead of ``N``; the
steps at and past index ``e + K`` run nothing. Pure integers, for the rollout (``digenrl.rl.flash``), the trainer's
bookkeeping and the simulator alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.errors import ConfigError

__all__ = ["SlidingWindow"]


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """The window of ``window`` SDE steps out of ``num_steps`` that moves every ``shift_every`` versions.

    Attributes:
        num_steps: ``N``, denoising steps of the run's grid.
        window: ``W``, SDE (and trained) steps per sample.
        shift_every: optimizer steps between moves of the window's start (0: it stays at 0).
        tail_ratio: Flash's compression of the steps after the window (None: they run as they are).
    """

    num_steps: int
    window: int
    shift_every: int
    tail_ratio: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.window <= self.num_steps - 2 or self.shift_every < 0:
            raise ConfigError(f"a sliding window of {self.window} steps moving every {self.shift_every} versions does "
                              f"not fit {self.num_steps} steps (window in 1..{self.num_steps - 2}, shift_every >= 0)")
        if self.tail_ratio is not None and not 0 < self.tail_ratio <= 1:
            raise ConfigError(f"the window's ODE tail ratio must be in (0, 1], got {self.tail_ratio}")

    @property
    def positions(self) -> int:
        """How many starts the window takes before it goes back to 0: ``0 .. N - 2 - W``."""
        return self.num_steps - 1 - self.window

    def start(self, version: int) -> int:
        """The window's first step for samples drawn with policy ``version``."""
        if self.shift_every == 0:
            return 0
        return (version // self.shift_every) % self.positions

    def end(self, version: int) -> int:
        """One past the window's last step."""
        return self.start(version) + self.window

    def tail_steps(self, version: int) -> int:
        """Solver steps after the window: ``N - e`` as they are, ``K`` compressed (Flash)."""
        rest = self.num_steps - self.end(version)
        if self.tail_ratio is None:
            return rest
        return max(int((rest + 1) * self.tail_ratio), 2) - 1

    def forwards(self, version: int) -> int:
        """Transformer forwards a sample's rollout runs (per CFG pass): steps ``0 .. forwards - 1`` run, the rest
        of the ``N`` step indices run nothing."""
        return self.end(version) + self.tail_steps(version)

    def forwards_in(self, version: int, start: int, stop: int) -> int:
        """Forwards among step indices ``[start, stop)``."""
        f = self.forwards(version)
        return max(0, min(stop, f) - min(start, f))

    def mean_forwards(self) -> float:
        """Forwards per sample averaged over one cycle of the window (each start held equally long)."""
        starts = [self.shift_every * p for p in range(self.positions if self.shift_every else 1)]
        return sum(self.forwards(v) for v in starts) / len(starts)
