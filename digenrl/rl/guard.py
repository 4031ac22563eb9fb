"""GRPO-Guard's clipped surrogate (arXiv 2510.22319): the normalised ratio and the 1/dt reweighting.

Per trained transition (one row) with step std ``s = g sqrt(dt)``, ``dt = sigma - sigma_next``, the trainer's
mean ``mu_theta`` and the rollout's ``mu_old``, ``delta = mu_theta - mu_old``:

* bias ``b = mean_d delta^2 / (2 s^2)``;
* ratio ``r = exp((l_theta - l_old + b) s)``; since ``x_next = mu_old + s z`` this is ``exp(mean_d delta z)``:
  zero log-ratio on-policy and a scale that no longer grows as ``s`` shrinks, hence a clip of ~2e-6;
* loss ``max(-A r, -A clip(r, 1 - eps, 1 + eps)) / dt`` (the paper's "1/dt" reweighting), plus
  ``beta KL`` as Flow-GRPO's (:func:`digenrl.rl.loss.grpo_loss`, not reweighted).

The two references differ in ``b``: veRL-Omni's ``GRPOGuardLoss`` computes it per sample, flow_grpo's
``train_sd3_GRPO_Guard.py`` reduces it over the whole batch (a ``mean`` over an empty dim tuple) into one
scalar shared by every row. ``bias = "sample"`` (the default, and what the algorithm trains with) is
veRL-Omni's: it is the paper's formula, and a row's ratio then never depends on which other rows share its
pass, which a packed, sliced or re-batched TSP pass would otherwise change. ``bias = "batch"`` is flow_grpo's,
kept to compare the two (they agree on a batch of one row). Both references take ``s`` and ``dt`` as batch
means of rows at one timestep; here they are per row, equal to those on such a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from digenrl.rl.loss import LossConfig, LossTerms, ppo_sums

__all__ = ["GuardLoss", "guard_loss"]


@dataclass(frozen=True)
class GuardLoss:
    """GRPO-Guard's loss hyper-parameters.

    Attributes:
        clip_range: the clip of the normalised ratio (the reference's 2e-6).
        kl_beta: weight of the KL to the reference (0: none, the reference's default).
        kl_kind: ``"exact"`` or ``"g2"`` (the reference's form), as :class:`~digenrl.rl.loss.LossConfig`.
        bias: ``"sample"`` (veRL-Omni) or ``"batch"`` (flow_grpo): module docstring.
    """

    clip_range: float = 2e-6
    kl_beta: float = 0.0
    kl_kind: str = "exact"
    bias: str = "sample"

    def __post_init__(self) -> None:
        LossConfig(self.clip_range, self.kl_beta, self.kl_kind)  # type: ignore[arg-type]  # the same checks
        if self.bias not in ("sample", "batch"):
            raise ValueError(f"bias must be 'sample' or 'batch', got {self.bias!r}")


def guard_loss(log_prob: torch.Tensor, log_prob_old: torch.Tensor, advantages: torch.Tensor, cfg: GuardLoss, *,
               mean: torch.Tensor, mean_old: torch.Tensor, std: torch.Tensor, dt: torch.Tensor,
               mean_ref: torch.Tensor | None = None, g: torch.Tensor | None = None) -> LossTerms:
    """Per-row GRPO-Guard loss (module docstring).

    Args:
        log_prob: ``[R]`` ``l_theta`` (with grad).
        log_prob_old: ``[R]`` the stored behaviour log-probs.
        advantages: ``[R]`` per-row advantages (already clipped).
        cfg: the loss config.
        mean: ``[R, ...]`` ``mu_theta`` (with grad).
        mean_old: ``[R, ...]`` ``mu_old``, the rollout's step mean (no grad).
        std: ``[R]`` the step std ``s``.
        dt: ``[R]`` ``sigma - sigma_next``.
        mean_ref: ``[R, ...]`` ``mu_ref`` (no grad), needed when ``kl_beta > 0``.
        g: ``[R]`` the drift coefficient (``kl_kind = "g2"``).

    Returns:
        :class:`~digenrl.rl.loss.LossTerms` with :func:`~digenrl.rl.loss.grpo_loss`'s diagnostics (``approx_kl``
        of the normalised log-ratio).

    Raises:
        ValueError: mismatched shapes, or the KL inputs missing while ``kl_beta > 0``.
    """
    if not log_prob.shape == log_prob_old.shape == advantages.shape == std.shape == dt.shape:
        raise ValueError(f"per-row shapes differ: log_prob {tuple(log_prob.shape)}, old {tuple(log_prob_old.shape)}, "
                         f"advantages {tuple(advantages.shape)}, std {tuple(std.shape)}, dt {tuple(dt.shape)}")
    s = std.float()
    sq = ((mean.float() - mean_old.detach().float()) ** 2).flatten(1).mean(dim=1)
    bias = sq / (2 * s**2)
    if cfg.bias == "batch":
        bias = bias.mean().expand_as(bias)
    log_ratio = (log_prob - log_prob_old.float() + bias) * s
    ratio = torch.exp(log_ratio)
    adv, eps = advantages.float(), cfg.clip_range
    policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)) / dt.float()
    kl = torch.zeros_like(policy)
    if cfg.kl_beta > 0:
        denom = std if cfg.kl_kind == "exact" else g
        if mean_ref is None or denom is None:
            raise ValueError(f"kl_beta > 0 needs mean_ref and {'std' if cfg.kl_kind == 'exact' else 'g'}")
        kl = ((mean - mean_ref.detach()) ** 2).flatten(1).mean(dim=1) / (2 * denom.float() ** 2)
    return LossTerms(loss=policy + cfg.kl_beta * kl, sums=ppo_sums(policy, kl, log_ratio, ratio, eps))
