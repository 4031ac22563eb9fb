"""Deterministic ODE samplers of the forward-process methods (DiffusionNFT, AWM), as pure steps.

The rollout of a forward-process method keeps no trajectory: it integrates the probability-flow ODE from
noise to a clean latent and ships that. Two solvers, both in the flow-matching parametrisation
``x = (1 - sigma) x0 + sigma eps`` with ``x0 = x - sigma v``:

* ``"euler"``: ``x' = x + (sigma' - sigma) v`` (diffusers' ``FlowMatchEulerDiscreteScheduler``).
* ``"dpm2"``: multistep DPM-Solver of second order in data prediction (DiffusionNFT's default sampler):
  with ``lambda = log((1 - sigma) / sigma)``, ``h = lambda' - lambda_i``, ``r = (lambda_i - lambda_{i-1}) / h``,
  ``x' = (sigma' / sigma_i) x - (1 - sigma') (e^{-h} - 1) (D0 + D1 / 2)``, ``D0 = x0_i``,
  ``D1 = (x0_i - x0_{i-1}) / r``. The first and the last step are first order (Euler: the last step lands on
  sigma = 0, where lambda is infinite), as in the reference; the sigma arithmetic is float64.

A multistep solver needs the previous step's ``x0``: :func:`ode_step` takes it and returns the new one, so
that state travels with a fragment (``FragmentData.solver_state``) and any actor can run any step range.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SOLVERS", "ode_step", "ode_sample"]

SOLVERS: tuple[str, ...] = ("dpm2", "euler")


def ode_step(solver: str, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int,
             prev_x0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i`` (``sigmas[i] -> sigmas[i + 1]``) of ``solver``; returns ``(x_next, x0)`` in fp32.

    Args:
        solver: ``"euler"`` or ``"dpm2"``.
        x: ``[B, ...]`` latents at ``sigmas[i]``.
        v: ``[B, ...]`` the model's velocity there.
        sigmas: the ``N + 1`` noise levels of the run (host or device; read as float64 scalars).
        i: the step index.
        prev_x0: ``x0`` of step ``i - 1`` (what the previous call returned); ``dpm2`` needs it for ``0 < i < N - 1``.

    Raises:
        ValueError: an unknown solver, or ``dpm2`` without the previous ``x0`` where it needs it.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ODE solver {solver!r}; allowed: {', '.join(SOLVERS)}")
    x, v = x.float(), v.float()
    s = sigmas.detach().double().cpu()
    n = s.shape[0] - 1
    sig, nxt = float(s[i]), float(s[i + 1])
    x0 = x - sig * v
    if solver == "euler" or i == 0 or i == n - 1:
        return x + (nxt - sig) * v, x0
    if prev_x0 is None:
        raise ValueError(f"dpm2 step {i} needs the previous step's x0")
    lam = torch.log1p(-s[i - 1 : i + 2]) - torch.log(s[i - 1 : i + 2])  # lambda at sigma_{i-1}, sigma_i, sigma_{i+1}
    h, h0 = float(lam[2] - lam[1]), float(lam[1] - lam[0])
    scale = (1.0 - nxt) * float(torch.expm1(torch.tensor(-h, dtype=torch.float64)))  # alpha' (e^{-h} - 1)
    d1 = (x0 - prev_x0.float()) * (h / h0) if h0 != float("inf") else torch.zeros_like(x0)  # sigma_{i-1} = 1: D1 = 0
    return (nxt / sig) * x - scale * x0 - 0.5 * scale * d1, x0


@torch.no_grad()
def ode_sample(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, sigmas: torch.Tensor,
               solver: str) -> list[torch.Tensor]:
    """Integrate from ``x`` at ``sigmas[0]`` to ``sigmas[-1]``; returns the latents after each step.

    ``velocity(x, sigma[B])`` is the model's (guided) velocity.
    """
    out: list[torch.Tensor] = []
    prev: torch.Tensor | None = None
    for i in range(sigmas.shape[0] - 1):
        v = velocity(x, sigmas[i].float().expand(x.shape[0]).to(x.device))
        x, prev = ode_step(solver, x, v, sigmas, i, prev)
        out.append(x)
    return out
