"""Forward-process RL (DiffusionNFT, AWM): the rows a trainer draws from clean samples, and their losses.

Notation (ALGORITHMS-FORWARD.md): ``y`` is the clean latent the rollout shipped, ``sigma`` in (0, 1] a noise
level of the rollout's own grid, ``eps`` fresh standard normal noise, ``x_t = (1 - sigma) y + sigma eps``
and the flow-matching target ``v* = eps - y``. A *row* is one (sample, noise level); the losses return a
per-row loss whose mean over the rows of an update is the reference's scalar loss (both references average
over samples and noise levels), so rows can be packed into passes of any size (TSP) and summed over tokens.

* DiffusionNFT (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``): implicit positive / negative velocities
  ``v+ = beta v + (1 - beta) v_old``, ``v- = (1 + beta) v_old - beta v``; x0-space errors ``e = x_t - sigma v - y``
  with adaptive weights ``w = max(mean_d |e|, 1e-5)`` (no gradient, float64); the advantage mapped to a
  probability ``r = clip(A / c / 2 + 1/2, 0, 1)``; per row ``c (r mean_d(e+^2 / w+) + (1 - r) mean_d(e-^2 / w-)) / beta
  + kl_beta mean_d (v - v_ref)^2``.
* AWM (scxue/advantage_weighted_matching ``compute_log_prob_awm``, weighting ``ghuber``, loss ``exp_first``):
  ``l = -sigma ((m + 1e-10)^p - 1e-10^p) / p`` with ``m = mean_d (v - v*)^2`` (float64), the ratio
  ``exp(l - l_old)`` (on-policy ``l_old = sg(l)``), the PPO clip, ``A^ = clip(A, c) / c * adv_max``, and
  ``kl_beta mean_d (v - v_ref)^2 + ema_beta mean_d (v - v_ema)^2``.

Which noise levels a sample trains is drawn per sample (:func:`digenrl.rl.noise.level_indices`), so a
resumed or re-issued fragment trains the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from digenrl.rl.loss import LossTerms

__all__ = ["ForwardRows", "velocity_probe", "NftLoss", "AwmLoss", "nft_prob", "nft_loss", "awm_log_prob", "awm_loss",
           "old_policy_decay", "linear_decay", "awm_strata", "nft_levels"]

_TINY = 1e-10  # AWM's offset inside the generalised Huber power


@dataclass(frozen=True)
class ForwardRows:
    """Training rows of clean samples, one per (sample, noise level).

    ``sample`` (the sample's row in its batch: it picks conditioning and advantages) and ``step`` (the grid
    index of the row's sigma) are host indices; the values live where the model computes.

    Attributes:
        sample: ``[R]`` long.
        step: ``[R]`` long, the grid index ``i`` with ``sigma = sigmas[i]``.
        y: ``[R, ...]`` fp32 clean latents.
        eps: ``[R, ...]`` fp32 fresh noise.
        sigma: ``[R]`` fp32.
        sample_id: ``[R]`` long (host), the sample's id in its logical batch (it seeds the sample's noise).
        probe: ``[R]`` fp32, the rollout's :func:`velocity_probe` of the sample's first step (parity).
        batch: the logical batch.
        policy_version: the version that sampled the rows.
    """

    sample: torch.Tensor
    step: torch.Tensor
    y: torch.Tensor
    eps: torch.Tensor
    sigma: torch.Tensor
    sample_id: torch.Tensor
    probe: torch.Tensor
    batch: int = 0
    policy_version: int = 0

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    @property
    def x(self) -> torch.Tensor:
        """``x_t = (1 - sigma) y + sigma eps``: what the model sees."""
        s = self.sigma.view(-1, *[1] * (self.y.ndim - 1))
        return (1 - s) * self.y + s * self.eps

    def to(self, device: torch.device | str) -> ForwardRows:
        return replace(self, y=self.y.to(device), eps=self.eps.to(device), sigma=self.sigma.to(device),
                       probe=self.probe.to(device))

    def rows(self, index: torch.Tensor | slice | list[int]) -> ForwardRows:
        return replace(self, sample=self.sample[index], step=self.step[index], y=self.y[index], eps=self.eps[index],
                       sigma=self.sigma[index], sample_id=self.sample_id[index], probe=self.probe[index])

    @staticmethod
    def cat(parts: list[ForwardRows], sample_offsets: list[int] | None = None) -> ForwardRows:
        """Concatenate row sets; ``sample_offsets`` shift sample indices.

        Raises:
            ValueError: no parts, or parts of different versions.
        """
        if not parts:
            raise ValueError("cannot concatenate zero row sets")
        versions = {(p.policy_version, p.batch) for p in parts}
        if len(versions) > 1:
            raise ValueError(f"cannot mix policy versions or batches {versions} in one batch")
        offs = sample_offsets or [0] * len(parts)

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts])

        return replace(parts[0], sample=torch.cat([p.sample + o for p, o in zip(parts, offs, strict=True)]),
                       step=cat("step"), y=cat("y"), eps=cat("eps"), sigma=cat("sigma"), sample_id=cat("sample_id"),
                       probe=cat("probe"))


def velocity_probe(v: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``[B]``: each velocity projected on a fixed unit-variance direction, ``sum_d v u / sqrt(d)`` (fp32).

    A forward-process rollout keeps no log-prob; this scalar of its first step's velocity is what the trainer
    recomputes with the same weights to measure rollout/trainer parity (its difference reads in units of the
    velocity's rms: ~1e-7 for equal numbers, ~lr for a version apart).
    """
    flat = v.float().flatten(1)
    return (flat * direction.reshape(1, -1).to(flat.device)).sum(dim=1) / flat.shape[1] ** 0.5


def _mean_d(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(dim=1)


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *[1] * (like.ndim - 1))


# -- DiffusionNFT ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class NftLoss:
    """DiffusionNFT's loss hyper-parameters (``[nft]``, ``train.adv_clip``)."""

    beta: float = 1.0
    kl_beta: float = 1e-4
    adv_clip: float = 5.0
    weight_floor: float = 1e-5


def nft_prob(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """The optimality probability ``r = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1)`` of each advantage."""
    a = advantages.float().clamp(-clip, clip)
    return (a / clip / 2.0 + 0.5).clamp(0.0, 1.0)


def _weighted_error(x0: torch.Tensor, y: torch.Tensor, floor: float) -> torch.Tensor:
    """``mean_d (x0 - y)^2 / w`` with the adaptive weight ``w = max(mean_d |x0 - y|, floor)`` (no gradient, float64)."""
    with torch.no_grad():
        w = _bcast(_mean_d((x0.double() - y.double()).abs()).clamp(min=floor), x0)
    return _mean_d((x0 - y) ** 2 / w)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor | None, x_t: torch.Tensor, y: torch.Tensor,
             sigma: torch.Tensor, advantages: torch.Tensor, cfg: NftLoss) -> LossTerms:
    """Per-row DiffusionNFT loss and its diagnostics.

    Args:
        v: ``[R, ...]`` the trained velocity at ``x_t`` (with grad).
        v_old: the old policy's velocity there (no grad).
        v_ref: the reference's (adapters off), or None when ``kl_beta == 0``.
        x_t, y: the noised and the clean latents.
        sigma: ``[R]`` the rows' noise levels.
        advantages: ``[R]`` the rows' samples' advantages.
        cfg: the loss config.

    Returns:
        :class:`LossTerms`: ``loss`` ``[R]`` (float64), sums of ``policy_loss``, ``kl``, ``old_deviate``
        (``mean_d (v - v_old)^2``), ``nft_pos`` / ``nft_neg`` (the two weighted errors) and ``rows``.

    Raises:
        ValueError: ``kl_beta > 0`` without ``v_ref``.
    """
    beta, s = cfg.beta, _bcast(sigma.float(), v)
    v_old = v_old.detach()
    r = nft_prob(advantages, cfg.adv_clip).double()
    pos = _weighted_error(x_t - s * (beta * v + (1 - beta) * v_old), y, cfg.weight_floor)
    neg = _weighted_error(x_t - s * ((1 + beta) * v_old - beta * v), y, cfg.weight_floor)
    policy = cfg.adv_clip * (r * pos / beta + (1 - r) * neg / beta)
    kl = torch.zeros_like(policy)
    if cfg.kl_beta > 0:
        if v_ref is None:
            raise ValueError("nft kl_beta > 0 needs the reference velocity")
        kl = _mean_d((v - v_ref.detach()) ** 2).double()
    loss = policy + cfg.kl_beta * kl
    with torch.no_grad():
        sums = {"policy_loss": policy.detach().sum(), "kl": kl.detach().sum(),
                "old_deviate": _mean_d((v.detach() - v_old) ** 2).sum(), "nft_pos": pos.detach().sum(),
                "nft_neg": neg.detach().sum(), "rows": float(v.shape[0])}
    return LossTerms(loss=loss, sums=sums)


def old_policy_decay(step: int, kind: int) -> float:
    """DiffusionNFT's old-policy decay after ``step`` optimizer steps: type 0 copies, 1 is the default, 2 the OCR one."""
    flat, rate, hold = {0: (0, 0.0, 0.0), 1: (0, 1e-3, 0.5), 2: (75, 7.5e-3, 0.999)}[kind]
    return linear_decay(step, flat, rate, hold)


def linear_decay(step: int, flat: int, rate: float, hold: float) -> float:
    """``0`` before ``flat`` steps, then ``min((step - flat) rate, hold)``."""
    return 0.0 if step < flat else min((step - flat) * rate, hold)


def nft_levels(num_steps: int, levels: int) -> int:
    """Noise levels trained per sample: ``levels``, or the reference's ``floor(0.99 num_steps)`` for 0."""
    return levels or max(1, int(num_steps * 0.99))


# -- AWM ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AwmLoss:
    """AWM's loss hyper-parameters (``[awm]``, ``train.adv_clip``)."""

    power: float = 0.25
    clip_range: float = 1.0
    adv_clip: float = 5.0
    adv_max: float = 1.0
    kl_beta: float = 1e-3
    ema_beta: float = 1.0


def awm_log_prob(v: torch.Tensor, eps: torch.Tensor, y: torch.Tensor, sigma: torch.Tensor, power: float) -> torch.Tensor:
    """AWM's per-row "log-prob" ``-sigma ((m + 1e-10)^p - 1e-10^p) / p``, ``m = mean_d (v - (eps - y))^2`` (float64, <= 0)."""
    m = _mean_d((v.double() - (eps.double() - y.double())) ** 2)
    return -((m + _TINY) ** power - _TINY**power) * sigma.double() / power


def awm_strata(num_steps: int, fraction: float, levels: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` grid-index strata AWM draws one level from each (``discrete_wo_init``): the cut
    points ``linspace(1, floor(fraction N), levels + 1)`` truncated to integers. An empty stratum
    (``lo == hi``) gives ``lo``."""
    cuts = torch.linspace(1, int(num_steps * fraction), levels + 1).long().tolist()
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def awm_loss(v: torch.Tensor, eps: torch.Tensor, y: torch.Tensor, sigma: torch.Tensor, advantages: torch.Tensor,
             log_prob_old: torch.Tensor | None, v_ref: torch.Tensor | None, v_ema: torch.Tensor | None,
             cfg: AwmLoss) -> LossTerms:
    """Per-row AWM loss and its diagnostics.

    Args:
        v: ``[R, ...]`` the trained velocity at ``x_t`` (with grad).
        eps, y: the rows' noise and clean latents (``v* = eps - y``).
        sigma: ``[R]``.
        advantages: ``[R]``.
        log_prob_old: ``[R]`` the behaviour "log-prob" (one-step-stale rows: under the EMA policy), or None
            on-policy: the ratio is then against its own detached value (exactly 1, with gradient).
        v_ref, v_ema: the reference's and the EMA policy's velocities (None where their beta is 0).
        cfg: the loss config.

    Returns:
        :class:`LossTerms`: ``loss`` ``[R]`` (float64); sums of ``policy_loss``, ``kl``, ``ema_kl``,
        ``approx_kl``, ``clipfrac``, ``ratio``, ``ratio_dev`` and ``rows``.

    Raises:
        ValueError: a beta > 0 without its velocity.
    """
    log_prob = awm_log_prob(v, eps, y, sigma, cfg.power)
    old = log_prob.detach() if log_prob_old is None else log_prob_old.detach().double()
    ratio = torch.exp(log_prob - old)
    adv = advantages.double().clamp(-cfg.adv_clip, cfg.adv_clip) / cfg.adv_clip * cfg.adv_max
    c = cfg.clip_range
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - c, 1.0 + c))
    terms = {}
    for name, beta, other in (("kl", cfg.kl_beta, v_ref), ("ema_kl", cfg.ema_beta, v_ema)):
        if beta > 0 and other is None:
            raise ValueError(f"awm {name} weight > 0 needs its velocity")
        terms[name] = _mean_d((v.double() - other.detach().double()) ** 2) if beta > 0 else torch.zeros_like(policy)
    loss = policy + cfg.kl_beta * terms["kl"] + cfg.ema_beta * terms["ema_kl"]
    with torch.no_grad():
        r, d = ratio.detach(), (log_prob - old).detach()
        sums = {"policy_loss": policy.detach().sum(), "kl": terms["kl"].detach().sum(),
                "ema_kl": terms["ema_kl"].detach().sum(), "approx_kl": (0.5 * d**2).sum(),
                "clipfrac": ((r - 1.0).abs() > c).double().sum(), "ratio": r.sum(), "ratio_dev": (r - 1.0).abs().sum(),
                "rows": float(v.shape[0])}
    return LossTerms(loss=loss, sums=sums)
