"""AWM, Advantage Weighted Matching (scxue/advantage_weighted_matching, ICML'26): advantage-signed flow matching.

The rollout samples with the trained weights. Each row's loss (:func:`digenrl.rl.forward.awm_loss`) is a PPO
form over AWM's flow-matching "log-prob": on-policy the ratio is against its own detached value (1, with
gradient: robustly reweighted flow matching signed by the advantage); a one-step-stale sample (``async1``)
is ratioed against the EMA policy's log-prob at the same row, computed here (the reference's ``off_policy``
path), and ``awm.clip_range`` then clips. KL terms to the reference (``awm.kl_beta``) and to the EMA policy
(``awm.ema_beta``), which follows the trained weights after each optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from digenrl.algorithms.forward import ForwardProcess
from digenrl.models import index_cond
from digenrl.rl.forward import AwmLoss, ForwardRows, awm_log_prob, awm_loss, awm_strata, linear_decay
from digenrl.rl.loss import Sums

__all__ = ["Awm"]


class Awm(ForwardProcess):
    name = "awm"
    level_mode = "strata"
    copy_name = "ema"

    @classmethod
    def kl_weight(cls, cfg: Any) -> float:
        return float(cfg.awm.kl_beta)

    @classmethod
    def nograd_forwards(cls, cfg: Any, stale: bool) -> int:
        # the reference's; the EMA policy's for its KL, or for a stale row's ratio
        return int(cls.kl_weight(cfg) > 0) + int(cfg.awm.ema_beta > 0 or stale)

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        a = cfg.awm
        self.loss_cfg = AwmLoss(power=a.power, clip_range=a.clip_range, adv_clip=cfg.train.adv_clip,
                                adv_max=a.adv_max, kl_beta=a.kl_beta, ema_beta=a.ema_beta)
        self.kl_beta = a.kl_beta

    def decay(self, steps: int) -> float:
        a = self.cfg.awm
        return a.ema_decay if a.ema_decay_type == "constant" else linear_decay(steps, 0, 1e-3, a.ema_decay)

    def strata(self) -> list[tuple[int, int]]:
        a = self.cfg.awm
        return awm_strata(self.cfg.rollout.num_steps, a.level_fraction, a.levels)

    def rows_backward(self, velocity: Any, batch: ForwardRows, cond: dict[str, torch.Tensor], advantages: torch.Tensor,
                      cfg: AwmLoss, *, normalizer: float, ref_velocity: Any, parity: bool, on_policy: bool) -> Sums:
        if len(batch) == 0:
            return {"rows": 0.0}
        rows_cond, x = index_cond(cond, batch.sample), batch.x
        v_ema = self.copy_velocity(velocity, x, batch.sigma, rows_cond) if cfg.ema_beta > 0 or not on_policy else None
        old = None if on_policy else awm_log_prob(v_ema, batch.eps, batch.y, batch.sigma, cfg.power)
        v_ref = ref_velocity(x, batch.sigma, rows_cond) if ref_velocity is not None else None
        v = velocity(x, batch.sigma, rows_cond)
        terms = awm_loss(v, batch.eps, batch.y, batch.sigma, advantages[batch.sample], old, v_ref,
                         v_ema if cfg.ema_beta > 0 else None, cfg)
        (terms.loss.sum() / normalizer).backward()
        return terms.sums
