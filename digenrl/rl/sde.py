"""The Flow-GRPO SDE step and its per-transition log-probability, as pure functions.

One step maps ``x_i`` at noise level ``sigma`` to ``x_{i+1}`` at ``sigma_next`` (ALGORITHM (3)-(8)):

* ``"sde"`` (Flow-GRPO): ``g = a * sqrt(sigma / (1 - sigma~))`` where ``sigma~`` is ``sigma`` except at
  ``sigma == 1``, where the next level is substituted (only the first step of a schedule has
  ``sigma == 1``, and its next level is the schedule's sigma_1, so this is Flow-GRPO's "sigma_max").
* ``"wan"``: ``g = a * sigma``. Flow-GRPO's Wan2.1 pipeline is this with ``a = sigma_1`` of the schedule
  (use :func:`wan_noise_level`).
* ``"dance"`` (DanceGRPO): ``g = a``, a constant.
* ``"cps"`` (coefficients-preserving): ``s = sigma_next * sin(a*pi/2)``; its log-prob is the unnormalised
  ``-mean((x_next - mean)^2)``.

For the first three the mean is Euler-Maruyama of the reverse SDE, ``mu = x + [v + g^2/(2 sigma) (x + (1 -
sigma) v)] * (sigma_next - sigma)``, and the step std is ``s = g * sqrt(sigma - sigma_next)``.

Everything is computed in fp32 whatever the input dtype, because the mean overflows in bf16 and the
log-prob of a peaked Gaussian loses all precision in half precision (ALGORITHM (e).1). The step never
reads scheduler state: ``sigma`` and ``sigma_next`` are passed in (per row, shape ``[B]``, or scalars),
so a latent message that carries its step index and sigmas can be advanced by any actor.

Rows whose noise level is 0 are deterministic: the step is exactly the Euler step of the probability
flow ODE (``diffusers``' ``FlowMatchEulerDiscreteScheduler.step``) and they have no log-prob (NaN per
row, or ``None`` when the whole step is deterministic). They must never be trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "SdeKind",
    "SDE_KINDS",
    "SdeStepOutput",
    "sde_step",
    "transition_stats",
    "gaussian_log_prob",
    "wan_noise_level",
]

SdeKind = Literal["sde", "wan", "dance", "cps"]
SDE_KINDS: tuple[str, ...] = ("sde", "wan", "dance", "cps")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SdeStepOutput:
    """The result of one transition.

    Attributes:
        x_next: the next latent, fp32 (this exact tensor is what the next step and the store must see).
        mean: the transition mean ``mu`` (fp32, shape of ``x``).
        std: the per-row step std ``s`` (fp32, ``[B]``); 0 for deterministic rows.
        g: the per-row drift coefficient ``g`` (fp32, ``[B]``), used by the Flow-GRPO "g^2" KL form; for
            ``"cps"`` it equals ``std``.
        log_prob: per-row log-prob of ``x_next``, a per-element mean (fp32, ``[B]``); NaN on deterministic
            rows; ``None`` when every row is deterministic.
    """

    x_next: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    g: torch.Tensor
    log_prob: torch.Tensor | None


def _per_row(value: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """A scalar or ``[B]`` value as an fp32 ``[B]`` tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        return t.expand(batch).clone()
    if t.shape != (batch,):
        raise ValueError(f"expected a scalar or shape [{batch}], got shape {tuple(t.shape)}")
    return t.float()


def _bcast(row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` reshaped to broadcast against ``like`` (``[B, ...]``)."""
    return row.reshape(row.shape[0], *([1] * (like.ndim - 1)))


def wan_noise_level(sigmas: torch.Tensor) -> float:
    """The noise level that makes ``"wan"`` equal Flow-GRPO's Wan2.1 sampler: ``sigma_1`` of the schedule."""
    return float(sigmas[1])


def transition_stats(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float | torch.Tensor,
    kind: SdeKind = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, per-row std and per-row ``g`` of the transition from ``x`` (fp32).

    Args:
        x: latents ``[B, ...]`` at ``sigma``.
        v: the (guided) velocity at ``x``, same shape.
        sigma: current noise level, scalar or ``[B]``; must be > 0.
        sigma_next: next noise level, scalar or ``[B]``; ``0 <= sigma_next < sigma``.
        noise_level: ``a``, scalar or ``[B]``; 0 makes a row deterministic (Euler).
        kind: one of :data:`SDE_KINDS`.

    Returns:
        ``(mean, std, g)``.

    Raises:
        ValueError: for an unknown ``kind`` or mismatched shapes.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown sde kind {kind!r}; allowed: {', '.join(SDE_KINDS)}")
    if x.shape != v.shape:
        raise ValueError(f"x and v shapes differ: {tuple(x.shape)} vs {tuple(v.shape)}")
    b, dev = x.shape[0], x.device
    xf, vf = x.float(), v.float()
    s_row, sn_row = _per_row(sigma, b, dev), _per_row(sigma_next, b, dev)
    a_row = _per_row(noise_level, b, dev)
    s, sn = _bcast(s_row, xf), _bcast(sn_row, xf)
    dt = sn - s
    if kind == "cps":
        std_row = sn_row * torch.sin(a_row * (math.pi / 2))
        x0 = xf - s * vf
        x1 = xf + (1 - s) * vf
        noise_coef = torch.sqrt((sn_row**2 - std_row**2).clamp_min(0.0))
        mean = (1 - sn) * x0 + _bcast(noise_coef, xf) * x1
        # CPS with a = 0 is sn*x1 + (1-sn)*x0 = x + dt*v algebraically, but not bitwise; use Euler there.
        det = _bcast(a_row == 0, xf)
        mean = torch.where(det, xf + dt * vf, mean)
        return mean, std_row, std_row
    if kind == "sde":
        # sigma == 1 only at the first step, whose next level is the schedule's sigma_1 (ALGORITHM (3)).
        denom = torch.where(s_row >= 1.0, sn_row, s_row)
        g_row = a_row * torch.sqrt(s_row / (1 - denom))
    elif kind == "wan":
        g_row = a_row * s_row
    else:  # dance
        g_row = a_row
    g = _bcast(g_row, xf)
    mean = xf + (vf + g**2 / (2 * s) * (xf + (1 - s) * vf)) * dt
    std_row = g_row * torch.sqrt(s_row - sn_row)
    return mean, std_row, g_row


def gaussian_log_prob(
    x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, kind: SdeKind = "sde"
) -> torch.Tensor:
    """Per-row log-prob of ``x_next`` under the transition, averaged over elements (fp32, ``[B]``).

    ``"cps"`` uses Flow-GRPO's unnormalised ``-mean((x_next - mean)^2)``. Rows with ``std == 0`` give NaN:
    a deterministic step has no density and must not be trained.
    """
    diff = (x_next.float() - mean.float()).flatten(1)
    if kind == "cps":
        lp = -(diff**2).mean(dim=1)
        return torch.where(std > 0, lp, torch.full_like(lp, float("nan")))
    safe = torch.where(std > 0, std, torch.ones_like(std))
    lp = -(diff**2).mean(dim=1) / (2 * safe**2) - torch.log(safe) - _HALF_LOG_2PI
    return torch.where(std > 0, lp, torch.full_like(lp, float("nan")))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    *,
    kind: SdeKind = "sde",
    x_next: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SdeStepOutput:
    """One SDE transition with its log-prob (ALGORITHM (4)-(7)).

    Args:
        x: latents ``[B, ...]`` at ``sigma``.
        v: guided velocity at ``x``.
        sigma: current noise level (scalar or ``[B]``).
        sigma_next: next noise level (scalar or ``[B]``).
        noise_level: ``a`` (scalar or ``[B]``); rows with 0 are deterministic Euler steps.
        noise: the standard normal ``z`` to use (same shape as ``x``); drawn from ``generator`` if None.
        kind: the noise schedule, one of :data:`SDE_KINDS`.
        x_next: if given, the step is not sampled: its log-prob under the current ``v`` is evaluated
            (this is how training recomputes ``l(theta)`` from a stored transition).
        generator: RNG for ``z`` when ``noise`` is None.

    Returns:
        An :class:`SdeStepOutput`.

    Raises:
        ValueError: for an unknown ``kind`` or mismatched shapes.
    """
    mean, std, g = transition_stats(x, v, sigma, sigma_next, noise_level, kind)
    if x_next is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        elif noise.shape != x.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} differs from x {tuple(x.shape)}")
        x_next = mean + _bcast(std, mean) * noise.float()
    else:
        x_next = x_next.float()
    log_prob = None if _deterministic(noise_level, std) else gaussian_log_prob(x_next, mean, std, kind)
    return SdeStepOutput(x_next=x_next, mean=mean, std=std, g=g, log_prob=log_prob)


def _deterministic(noise_level: float | torch.Tensor, std: torch.Tensor) -> bool:
    """Every row an ODE step (no log-prob)? Read from host noise levels, so a GPU step is never waited on."""
    if isinstance(noise_level, torch.Tensor) and noise_level.device.type != "cpu":
        return bool((std == 0).all())
    return bool((torch.as_tensor(noise_level) == 0).all())
