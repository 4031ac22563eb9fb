"""Which denoising steps are stochastic and which are trained (ALGORITHM (16), (e).6, (e).15).

A :class:`StepPlan` holds two boolean masks of shape ``[B, N]`` (sample x step):

* ``stochastic``: the step uses the SDE with the configured noise level; elsewhere it is a plain Euler
  (ODE) step with no log-prob.
* ``trained``: the transition is stored at rollout and enters the loss. Always a subset of
  ``stochastic`` and never the last step (its density is extremely peaked; ALGORITHM (e).6).

Modes:

* ``"all_but_last"`` (Flow-GRPO standard): SDE everywhere, train steps ``0 .. N-2``.
* ``"window"`` (Flow-GRPO-Fast / MixGRPO): SDE and training only inside a contiguous window of ``W``
  steps; its start is drawn per *group* from a generator seeded by ``(seed, group id)``, so every member
  of a group shares it and any actor recomputes it identically; the starts are recorded in the plan.
* ``"fraction"`` (DanceGRPO / DDPO): SDE everywhere, train a random ``fraction`` of steps ``0 .. N-2``
  per sample (at least one), seeded per ``(seed, sample id)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["StepMode", "STEP_MODES", "StepPlan", "plan_steps"]

StepMode = Literal["all_but_last", "window", "fraction"]
STEP_MODES: tuple[str, ...] = ("all_but_last", "window", "fraction")

# Large odd multipliers decorrelate the per-group / per-sample seeds derived from one run seed.
_GROUP_MIX = 1_000_003
_SAMPLE_MIX = 7_919


@dataclass(frozen=True)
class StepPlan:
    """Per-sample step masks for one batch.

    Attributes:
        stochastic: ``[B, N]`` bool, steps sampled with the SDE.
        trained: ``[B, N]`` bool, steps whose transitions are stored and trained.
        window_start: ``[B]`` long, the window start per sample (``-1`` outside window mode).
    """

    stochastic: torch.Tensor
    trained: torch.Tensor
    window_start: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @property
    def num_steps(self) -> int:
        """``N``, the number of denoising steps."""
        return int(self.stochastic.shape[1])

    def trained_count(self) -> int:
        """Total number of (sample, step) transitions to train."""
        return int(self.trained.sum())

    def index(self, rows: torch.Tensor | list[int]) -> StepPlan:
        """The plan restricted to some samples (for splitting a batch into fragments)."""
        return StepPlan(self.stochastic[rows], self.trained[rows], self.window_start[rows])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)


def plan_steps(
    num_steps: int,
    group_ids: list[int] | torch.Tensor,
    sample_ids: list[int] | torch.Tensor | None = None,
    *,
    mode: StepMode = "all_but_last",
    window: int = 2,
    window_range: tuple[int, int] | None = None,
    fraction: float = 0.6,
    seed: int = 0,
) -> StepPlan:
    """Build the step plan for a batch.

    Args:
        num_steps: ``N``.
        group_ids: per-sample prompt-group id (``[B]``); window starts are shared per group.
        sample_ids: per-sample globally unique ids, for ``"fraction"``; defaults to ``0..B-1``.
        mode: one of :data:`STEP_MODES`.
        window: ``W`` for ``"window"``.
        window_range: ``(lo, hi)``, the window start is drawn uniformly from ``lo .. hi`` inclusive;
            defaults to ``(0, N - 1 - W)`` so the window never contains the last step.
        fraction: for ``"fraction"``, the share of steps ``0..N-2`` trained per sample.
        seed: the run seed (combine it with the iteration number so windows change over training).

    Returns:
        The :class:`StepPlan`.

    Raises:
        ValueError: for an unknown mode or out-of-range window / fraction.
    """
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (the last step is never trained), got {num_steps}")
    gids = torch.as_tensor(group_ids, dtype=torch.long)
    b = gids.shape[0]
    sids = torch.arange(b) if sample_ids is None else torch.as_tensor(sample_ids, dtype=torch.long)
    stochastic = torch.ones(b, num_steps, dtype=torch.bool)
    trained = torch.zeros(b, num_steps, dtype=torch.bool)
    starts = torch.full((b,), -1, dtype=torch.long)
    if mode == "all_but_last":
        trained[:, : num_steps - 1] = True
    elif mode == "window":
        lo, hi = window_range if window_range is not None else (0, num_steps - 1 - window)
        if window < 1 or lo < 0 or hi < lo or hi + window > num_steps - 1:
            raise ValueError(
                f"window {window} with start range ({lo}, {hi}) must fit in steps 0..{num_steps - 2}"
            )
        stochastic[:] = False
        cache: dict[int, int] = {}
        for j, gid in enumerate(gids.tolist()):
            if gid not in cache:
                g = _gen(seed * _GROUP_MIX + gid)
                cache[gid] = int(torch.randint(lo, hi + 1, (1,), generator=g))
            starts[j] = cache[gid]
            stochastic[j, cache[gid] : cache[gid] + window] = True
        trained = stochastic.clone()
    elif mode == "fraction":
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        k = max(1, round(fraction * (num_steps - 1)))
        for j, sid in enumerate(sids.tolist()):
            perm = torch.randperm(num_steps - 1, generator=_gen(seed * _SAMPLE_MIX + sid + 1))
            trained[j, perm[:k]] = True
    else:
        raise ValueError(f"unknown step mode {mode!r}; allowed: {', '.join(STEP_MODES)}")
    return StepPlan(stochastic=stochastic, trained=trained, window_start=starts)
