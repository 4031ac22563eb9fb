"""The clipped GRPO surrogate with a KL penalty to the reference policy (ALGORITHM (12)-(15)).

Per trained transition (one row): ``r = exp(l_theta - l_old)``,
``L_clip = max(-A r, -A clip(r, 1 - eps, 1 + eps))`` and ``L = L_clip + beta * KL``, with

* ``kl="exact"`` (default): the exact KL between the two Gaussian transitions of equal std,
  ``mean_d (mu_theta - mu_ref)^2 / (2 s^2)`` (Flow-GRPO's Wan2.1 code);
* ``kl="g2"``: Flow-GRPO's SD3/FLUX/Qwen form, ``mean_d (mu_theta - mu_ref)^2 / (2 g^2)`` (no ``-dt``
  factor; beta values are not interchangeable between the two).

The reference mean comes from the same network with the LoRA adapter disabled (or a frozen copy), fed
the same guidance. This module only does the arithmetic; :mod:`digenrl.rl.tsp` runs the forwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["KlKind", "KL_KINDS", "LossConfig", "LossTerms", "Sums", "grpo_loss", "host_sums", "parity_sums", "ppo_sums",
           "reduce_stats"]

KlKind = Literal["exact", "g2"]
KL_KINDS: tuple[str, ...] = ("exact", "g2")
#: Diagnostic sums of some rows: 0-dim tensors on the rows' device, or floats (counts); :func:`host_sums` reads them.
Sums = dict[str, "torch.Tensor | float"]


@dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters.

    Attributes:
        clip_range: PPO ``eps`` on the ratio. ALGORITHM (13): 1e-4 for per-element-mean log-probs.
        kl_beta: weight of the KL term (0 disables the reference forward).
        kl_kind: ``"exact"`` or ``"g2"``.
    """

    clip_range: float = 1e-4
    kl_beta: float = 0.0
    kl_kind: KlKind = "exact"

    def __post_init__(self) -> None:
        if not self.clip_range > 0:
            raise ValueError(f"clip_range must be > 0, got {self.clip_range}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"unknown kl_kind {self.kl_kind!r}; allowed: {', '.join(KL_KINDS)}")


@dataclass(frozen=True)
class LossTerms:
    """Per-row loss (with grad) and per-row diagnostics (detached sums, to be reduced over a batch).

    Attributes:
        loss: ``[R]`` the per-row loss ``L_clip + beta * KL``.
        sums: detached sums over the rows of ``policy_loss``, ``kl``, ``approx_kl`` (``1/2 dl^2``),
            ``clipfrac``, ``clipfrac_gt_one``, ``clipfrac_lt_one``, ``ratio``, ``ratio_dev``
            (``|r - 1|``): 0-dim tensors on the rows' device (:func:`host_sums` reads them); ``rows``
            (a float: it is a shape).
    """

    loss: torch.Tensor
    sums: Sums


def grpo_loss(
    log_prob: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    mean: torch.Tensor | None = None,
    mean_ref: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
) -> LossTerms:
    """Per-row clipped surrogate plus KL.

    Args:
        log_prob: ``[R]`` ``l_theta`` (with grad).
        log_prob_old: ``[R]`` stored behaviour log-probs.
        advantages: ``[R]`` per-row advantages.
        cfg: the loss config.
        mean: ``[R, ...]`` ``mu_theta`` (with grad), needed when ``kl_beta > 0``.
        mean_ref: ``[R, ...]`` ``mu_ref`` (no grad), needed when ``kl_beta > 0``.
        std: ``[R]`` step std ``s`` (for ``kl="exact"``).
        g: ``[R]`` drift coefficient (for ``kl="g2"``).

    Returns:
        :class:`LossTerms`.

    Raises:
        ValueError: if the KL inputs are missing while ``kl_beta > 0``, or shapes differ.
    """
    if not log_prob.shape == log_prob_old.shape == advantages.shape:
        raise ValueError(
            f"shapes differ: log_prob {tuple(log_prob.shape)}, old {tuple(log_prob_old.shape)}, "
            f"advantages {tuple(advantages.shape)}"
        )
    delta = log_prob - log_prob_old.float()
    ratio = torch.exp(delta)
    adv = advantages.float()
    eps = cfg.clip_range
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
    policy = torch.maximum(unclipped, clipped)
    kl = torch.zeros_like(policy)
    if cfg.kl_beta > 0:
        if mean is None or mean_ref is None:
            raise ValueError("kl_beta > 0 needs mean and mean_ref")
        denom = std if cfg.kl_kind == "exact" else g
        if denom is None:
            raise ValueError(f"kl_kind={cfg.kl_kind!r} needs {'std' if cfg.kl_kind == 'exact' else 'g'}")
        sq = ((mean - mean_ref.detach()) ** 2).flatten(1).mean(dim=1)
        kl = sq / (2 * denom.float() ** 2)
    return LossTerms(loss=policy + cfg.kl_beta * kl, sums=ppo_sums(policy, kl, delta, ratio, eps))


def ppo_sums(policy: torch.Tensor, kl: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor,
             eps: float) -> dict[str, torch.Tensor | float]:
    """The diagnostics a clipped-ratio loss reports, summed over its ``[R]`` rows (:class:`LossTerms`).

    Tensors stay on the rows' device: they are read on the host once per token (``host_sums``).
    """
    with torch.no_grad():
        d, r = log_ratio.detach(), ratio.detach()
        return {
            "policy_loss": policy.detach().sum(),
            "kl": kl.detach().sum(),
            "approx_kl": (0.5 * d**2).sum(),
            "clipfrac": ((r - 1.0).abs() > eps).float().sum(),
            "clipfrac_gt_one": (r > 1.0 + eps).float().sum(),
            "clipfrac_lt_one": (r < 1.0 - eps).float().sum(),
            "ratio": r.sum(),
            "ratio_dev": (r - 1.0).abs().sum(),
            "rows": float(r.numel()),
        }


def parity_sums(log_prob: torch.Tensor, log_prob_old: torch.Tensor) -> Sums:
    """Rollout/trainer numerics parity of rows whose trainer weights are the ones that sampled them.

    ``log_prob`` is the trainer's recompute under the behaviour weights, ``log_prob_old`` what the
    rollout stored: with equal weights and equal numerics the ratio is exactly 1. Returns detached sums
    (``parity_rows``, ``parity_ratio``) and maxima (``parity_ratio_dev_max`` = max |r - 1|,
    ``parity_logp_diff_max`` = max |l - l_old|) as tensors on the rows' device, reduced by
    :func:`reduce_stats`.
    """
    with torch.no_grad():
        d = (log_prob.detach().float() - log_prob_old.float())
        r = torch.exp(d)
        n = d.numel()
        return {
            "parity_rows": float(n),
            "parity_ratio": r.sum(),
            "parity_ratio_dev_max": (r - 1.0).abs().max() if n else 0.0,
            "parity_logp_diff_max": d.abs().max() if n else 0.0,
        }


def host_sums(sums: list[Sums]) -> list[dict[str, float]]:
    """The diagnostics of :func:`grpo_loss` / :func:`parity_sums` as floats, read in one copy per device.

    A GPU then waits for its queued passes once per TRAIN token instead of once per value (a dozen
    times a pass). A ``meta`` tensor (a shape-only run: the CPU suite's device tests put the model
    there) has no value to read: it reads as NaN.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for s in sums:
        for v in s.values():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append(v)
    read: dict[int, float] = {}
    for device, tensors in by_device.items():
        if device.type == "meta":
            values = [math.nan] * len(tensors)
        else:
            values = torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
        read.update((id(t), v) for t, v in zip(tensors, values, strict=True))
    return [{k: read[id(v)] if isinstance(v, torch.Tensor) else float(v) for k, v in s.items()} for s in sums]


def reduce_stats(sums: list[Sums]) -> dict[str, float]:
    """Turn accumulated per-row sums into means over all rows (``rows`` stays a count).

    ``*_max`` keys reduce by maximum; ``parity_*`` sums are means over ``parity_rows`` (see
    :func:`parity_sums`), which stays a count, as do ``rows_by_expert/<label>`` (``digenrl.rl.tsp``).
    Tensor values are read first (:func:`host_sums`).
    """
    total: dict[str, float] = {}
    for s in host_sums(sums):
        for k, v in s.items():
            total[k] = max(total.get(k, v), v) if k.endswith("_max") else total.get(k, 0.0) + v
    n = max(total.get("rows", 0.0), 1.0)
    n_parity = max(total.get("parity_rows", 0.0), 1.0)
    out = {}
    for k, v in total.items():
        if k in ("rows", "parity_rows") or k.endswith("_max") or k.startswith("rows_by_expert/"):
            out[k] = v
        else:
            out[k] = v / (n_parity if k.startswith("parity_") else n)
    return out
