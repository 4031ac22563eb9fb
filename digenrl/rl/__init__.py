"""The Flow-GRPO core: the SDE step, rollout over step ranges, step plans, advantages, loss and TSP packing.

Pure tensor code: nothing here does I/O or knows about actors, so every piece is testable against
independent math (ALGORITHM.md (f)).
"""

from __future__ import annotations

from digenrl.rl.advantages import AdvantageResult, CompletedGroup, GroupAssembler, group_advantages
from digenrl.rl.loss import LossConfig, LossTerms, grpo_loss, reduce_stats
from digenrl.rl.rollout import RolloutResult, TransitionBatch, rollout_steps
from digenrl.rl.sde import SdeStepOutput, gaussian_log_prob, sde_step, transition_stats, wan_noise_level
from digenrl.rl.steps import StepPlan, plan_steps
from digenrl.rl.tsp import packed_backward, per_step_backward

__all__ = [
    "AdvantageResult",
    "CompletedGroup",
    "GroupAssembler",
    "LossConfig",
    "LossTerms",
    "RolloutResult",
    "SdeStepOutput",
    "StepPlan",
    "TransitionBatch",
    "gaussian_log_prob",
    "group_advantages",
    "grpo_loss",
    "packed_backward",
    "per_step_backward",
    "plan_steps",
    "reduce_stats",
    "rollout_steps",
    "sde_step",
    "transition_stats",
    "wan_noise_level",
]
