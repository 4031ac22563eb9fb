"""GRPO-Guard (arXiv 2510.22319): Flow-GRPO's sampler and transitions, a normalised ratio and a 1/dt reweighting.

The ratio needs the rollout's step mean ``mu_old`` of each trained transition. It is not shipped: a sample's
transition noise ``z`` is drawn from its own seed (:mod:`digenrl.rl.noise`), so the trainer redraws it and
rebuilds ``mu_old = x_next - s z`` exactly as the rollout formed ``x_next``; the payload is Flow-GRPO's. The
loss (:func:`digenrl.rl.guard.guard_loss`) uses veRL-Omni's per-sample bias (that module says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from digenrl.algorithms.base import Backward
from digenrl.algorithms.flow_grpo import FlowGrpo, reference_velocity
from digenrl.models import index_cond
from digenrl.rl.guard import GuardLoss, guard_loss
from digenrl.rl.loss import Sums, parity_sums
from digenrl.rl.noise import transition_noise
from digenrl.rl.rollout import TransitionBatch
from digenrl.rl.sde import gaussian_log_prob, transition_stats

__all__ = ["GrpoGuard", "GuardRows"]


@dataclass(frozen=True)
class GuardRows(TransitionBatch):
    """Transitions with each row's rollout noise ``z`` (``noise``: ``[R, ...]`` fp32), redrawn from its seed."""

    noise: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def to(self, device: torch.device | str) -> GuardRows:
        return replace(super().to(device), noise=self.noise.to(device))

    def rows(self, index: torch.Tensor | slice | list[int]) -> GuardRows:
        return replace(super().rows(index), noise=self.noise[index])

    @staticmethod
    def cat(parts: list[GuardRows], sample_offsets: list[int] | None = None) -> GuardRows:  # type: ignore[override]
        return replace(TransitionBatch.cat(parts, sample_offsets), noise=torch.cat([p.noise for p in parts]))


class GrpoGuard(FlowGrpo):
    name = "grpo_guard"

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        t = cfg.train
        self.guard = GuardLoss(clip_range=cfg.guard.clip_range, kl_beta=t.kl_beta, kl_kind=t.kl)

    def token_rows(self, trans: dict[str, torch.Tensor], rows: tuple[int, int], keep: torch.Tensor, batch: int,
                   sample_ids: list[int], version: int) -> GuardRows | None:
        base = super().token_rows(trans, rows, keep, batch, sample_ids, version)
        if base is None:
            return None
        like = torch.empty(1, *base.x.shape[1:])  # host draws, the rollout's (transition_noise)
        z = [transition_noise(self.cfg.log.seed, batch, [sample_ids[i]], s, like)
             for i, s in zip(base.sample.tolist(), base.step.tolist(), strict=True)]
        return GuardRows(**{k: getattr(base, k) for k in TransitionBatch.__dataclass_fields__},
                         noise=torch.cat(z).to(base.x.device))

    def backward(self, batch: GuardRows, cond: dict[str, torch.Tensor], adv: torch.Tensor, plan: Backward, *,
                 version: int) -> list[Sums]:
        ref = reference_velocity(self.model) if self.guard.kl_beta > 0 else None
        return plan.run(self.model.velocity, batch, cond, adv, self.guard, ref_velocity=ref,
                        parity=batch.policy_version == version, backward=self.rows_backward)

    def rows_backward(self, velocity: Any, batch: GuardRows, cond: dict[str, torch.Tensor], advantages: torch.Tensor,
                      cfg: GuardLoss, *, normalizer: float, ref_velocity: Any, parity: bool) -> Sums:
        """One pass over ``batch``: the trainer's step means, the rollout's rebuilt, the loss, ``backward()``."""
        if len(batch) == 0:
            return {"rows": 0.0}
        rows_cond = index_cond(cond, batch.sample)
        mean_ref = None
        if ref_velocity is not None:
            with torch.no_grad():
                v_ref = ref_velocity(batch.x, batch.sigma, rows_cond)
                mean_ref, _, _ = transition_stats(batch.x, v_ref, batch.sigma, batch.sigma_next, batch.noise_level,
                                                  batch.kind)
        v = velocity(batch.x, batch.sigma, rows_cond)
        mean, std, g = transition_stats(batch.x, v, batch.sigma, batch.sigma_next, batch.noise_level, batch.kind)
        log_prob = gaussian_log_prob(batch.x_next, mean, std, batch.kind)
        s = std.detach().reshape(-1, *([1] * (batch.x.ndim - 1)))
        mean_old = batch.x_next.float() - s * batch.noise.float()
        terms = guard_loss(log_prob, batch.log_prob, advantages[batch.sample].float(), cfg, mean=mean,
                           mean_old=mean_old, std=std, dt=batch.sigma - batch.sigma_next, mean_ref=mean_ref, g=g)
        (terms.loss.sum() / normalizer).backward()
        return {**terms.sums, **parity_sums(log_prob, batch.log_prob)} if parity else terms.sums
