"""MixGRPO-Flash's ODE tail: after the SDE window, fewer steps of a second-order solver to the clean sample.

The trainer never sees these steps (ALGORITHMS-FORWARD §2 (d)), so the rollout may integrate them however it likes;
the reference (Tencent-Hunyuan/MixGRPO ``run_sample_step``, ``dpm_apply_strategy = "post"``) runs multistep
DPM-Solver++ of second order (midpoint) on ``K`` steps (:attr:`digenrl.sim.window.SlidingWindow.tail_steps`) from
the window's end ``e`` to 0, spaced uniformly in the schedule's own time before its shift. That is
:func:`digenrl.rl.ode.ode_step` (``"dpm2"``) on the grid :func:`tail_sigmas` returns: the run's levels up to ``e``,
then ``K`` new ones. Its first step is second order with the window's last data prediction ``x - sigma v``, as in
the reference, whose solver state the window's steps fill; its last (to 0) is first order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from digenrl.rl.ode import ode_step

__all__ = ["tail_sigmas", "run_tail"]


def tail_sigmas(sigmas: Callable[[int], torch.Tensor], num_steps: int, end: int, tail: int) -> torch.Tensor:
    """The grid of a rollout whose steps after ``end`` are ``tail`` solver steps: ``[end + tail + 1]`` levels.

    ``sigmas(n)`` is the model's schedule of ``n`` steps (``GeneratorModel.sigmas``). The new levels are that
    schedule at ``num_steps x tail`` steps, indices ``end x tail + k (num_steps - end)``: the unshifted times
    ``(1 - end / N)(1 - k / tail)``, exactly for a schedule that is a fixed map of a uniform time (the reference's
    shift, FLUX's resolution-dependent one), its own finer grid otherwise.

    Raises:
        ValueError: ``end`` outside ``1 .. num_steps - 1`` or ``tail < 1``.
    """
    if not 1 <= end < num_steps or tail < 1:
        raise ValueError(f"a tail of {tail} steps after step {end} does not fit {num_steps} steps")
    run = sigmas(num_steps).float()
    fine = sigmas(num_steps * tail).float()
    idx = end * tail + torch.arange(tail + 1) * (num_steps - end)
    return torch.cat([run[:end], fine[idx]])


@torch.no_grad()
def run_tail(velocity: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor], x: torch.Tensor,
             cond: dict[str, torch.Tensor], grid: torch.Tensor, prev_x0: torch.Tensor, start: int,
             stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps ``[start, stop)`` of the tail on ``grid`` (:func:`tail_sigmas`); indices past its last step are free.

    Args:
        velocity: the policy's guided velocity ``v(x, sigma[B], cond)``.
        x: ``[B, ...]`` latents at ``grid[start]``.
        cond: their conditioning.
        grid: the tail's grid (the run's levels up to the window's end, then the tail's).
        prev_x0: the previous step's data prediction (the window's last ``x - sigma v`` at the tail's first step).
        start, stop: step indices, at or after the window's end.

    Returns:
        ``(x, x0)``: the latents after the last step run and its data prediction (the solver's state).
    """
    sigmas = grid.float().to(x.device)
    for i in range(start, min(stop, grid.shape[0] - 1)):
        v = velocity(x, sigmas[i].expand(x.shape[0]), cond)
        x, prev_x0 = ode_step("dpm2", x, v, grid, i, prev_x0)
    return x, prev_x0
