"""Flow-GRPO (and its Fast window, DanceGRPO's share of steps, the Dance and CPS samplers): PPO over SDE transitions.

The rollout records each trained transition ``(x_i, x_{i+1}, sigma_i, sigma_{i+1}, l_old)``; the trainer
recomputes ``l_theta`` on them and takes the clipped surrogate plus KL (:mod:`digenrl.rl.loss`, ALGORITHM.md).
"""

from __future__ import annotations

from typing import Any

import torch

from digenrl.algorithms.base import Algorithm, Backward
from digenrl.models import reference
from digenrl.rl.loss import LossConfig, Sums
from digenrl.rl.rollout import TransitionBatch
from digenrl.rl.tsp import parity_recompute

__all__ = ["FlowGrpo", "reference_velocity"]


def reference_velocity(model: Any) -> Any:
    """``v_ref(x, sigma, cond)``: ``model``'s velocity with its adapters off (or its frozen copy), no gradient."""
    def ref(x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        with reference(model):
            return model.velocity(x, sigma, cond)

    return ref


class FlowGrpo(Algorithm):
    name = "flow_grpo"

    @classmethod
    def kl_weight(cls, cfg: Any) -> float:
        return float(cfg.train.kl_beta)

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        t = cfg.train
        self.loss_cfg = LossConfig(clip_range=t.clip_range, kl_beta=t.kl_beta, kl_kind=t.kl)

    def token_rows(self, trans: dict[str, torch.Tensor], rows: tuple[int, int], keep: torch.Tensor, batch: int,
                   sample_ids: list[int], version: int) -> TransitionBatch | None:
        s, e = rows
        sel = torch.arange(s, e)
        sel = sel[keep[trans["sample"][s:e]]]
        if not sel.numel():
            return None
        return TransitionBatch(**{k: trans[k][sel] for k in trans}, kind=self.cfg.rollout.sde,
                               policy_version=version)

    def backward(self, batch: TransitionBatch, cond: dict[str, torch.Tensor], adv: torch.Tensor, plan: Backward, *,
                 version: int) -> list[Sums]:
        ref = reference_velocity(self.model) if self.loss_cfg.kl_beta > 0 else None
        on_policy = batch.policy_version == version  # then the training forward also measures parity
        return plan.run(self.model.velocity, batch, cond, adv, self.loss_cfg, ref_velocity=ref, parity=on_policy)

    def parity_recompute(self, batch: TransitionBatch, cond: dict[str, torch.Tensor], max_rows: int) -> Sums:
        return parity_recompute(self.model.velocity, batch, cond, max_rows)
