"""MixGRPO (and MixGRPO-Flash): Flow-GRPO's loss on a sliding SDE window whose start follows the trainer.

ALGORITHMS-FORWARD §2 (Tencent-Hunyuan/MixGRPO): the SDE runs in ``mixgrpo.window`` steps, Euler ODE elsewhere,
and only the window's transitions are stored and trained, with Flow-GRPO's clipped surrogate
(:class:`~digenrl.algorithms.flow_grpo.FlowGrpo`). Where the window is comes from the policy version that samples a
fragment (:class:`digenrl.sim.window.SlidingWindow`), never from a counter: the version travels with the fragment,
so a one-step-stale sample, a fragment re-run after its holder died and a resumed run all train exactly the
transitions that were sampled. Flash replaces the ODE steps after the window with fewer second-order ones
(:mod:`digenrl.rl.flash`); the trainer never sees them.
"""

from __future__ import annotations

from typing import Any

import torch

from digenrl.algorithms.flow_grpo import FlowGrpo
from digenrl.rl.flash import tail_sigmas
from digenrl.rl.steps import StepPlan, plan_steps

__all__ = ["MixGrpo"]


class MixGrpo(FlowGrpo):
    name = "mixgrpo"

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        self.window = cfg.mixgrpo.sliding(cfg.rollout.num_steps)
        self._grids: dict[tuple[int, int], torch.Tensor] = {}  # Flash's grids by (window end, tail steps)

    @classmethod
    def rollout_window(cls, cfg: Any) -> Any:
        return cfg.mixgrpo.sliding(cfg.rollout.num_steps)

    def step_plan(self, groups: list[int], sample_ids: list[int], seed: int, version: int) -> StepPlan:
        s = self.window.start(version)
        return plan_steps(self.window.num_steps, groups, sample_ids, mode="window", window=self.window.window,
                          window_range=(s, s), seed=seed)

    def ode_tail(self, version: int) -> tuple[int, torch.Tensor] | None:
        if self.window.tail_ratio is None:
            return None
        key = (self.window.end(version), self.window.tail_steps(version))
        if key not in self._grids:
            self._grids[key] = tail_sigmas(self.model.sigmas, self.window.num_steps, *key)
        return key[0], self._grids[key]

    def after_step(self, steps: int) -> dict[str, float]:
        # the window the new version samples with, and what a sample then costs
        return {"window_start": float(self.window.start(steps)), "rollout_forwards": float(self.window.forwards(steps))}
