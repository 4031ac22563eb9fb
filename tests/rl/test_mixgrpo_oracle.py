"""MixGRPO's window schedule and MixGRPO-Flash's ODE tail against numbers from the reference code.

``_mixgrpo_oracle.json`` holds what Tencent-Hunyuan/MixGRPO @e5cdd6a computed; a script kept outside the
repository (it imports the reference's own modules from its git blobs; none of their code is here) ran:

* ``fastvideo/utils/grpo_states.py::GRPOTrainingStates`` as ``train_grpo_flux.py`` builds it (``progressive``,
  ``prog_overlap``, ``roll_back``, ``max_timesteps = N - 2``): ``get_current_timesteps()`` then
  ``update_iteration()`` per iteration, for the MixGRPO recipe (25 iterations a move, step 1), Flash*'s
  (``prog_overlap_step = 0``) and a small one (N = 8, W = 2, 2 iterations a move).
* ``fastvideo/utils/sampling_utils.py::run_sample_step`` with ``dpm_algorithm_type = "dpmsolver++"``,
  ``dpm_apply_strategy = "post"``, order 2, ``midpoint``, ``flow_grpo_sampling``, on the shift-3 grid
  ``sd3_time_shift(3, linspace(1, 0, N + 1))``, a stand-in transformer ``v = 0.6 tanh(z) - 0.25 z + 0.1`` and
  ``flow_grpo_step`` forced deterministic (its window noise is the global RNG's): ``grid`` is the sigma schedule
  the reference's DPM-Solver steps on, ``latents`` every step's ``z``, ``final`` the sample.

Where digenrl departs, on purpose (``digenrl/sim/window.py``): the reference's window start runs on to ``N - 2``
with the window cut at step ``N - 3`` (then empty) before rolling back; digenrl's start stops at ``N - 1 - W``
so every window has W steps. The published recipes (300 iterations) stay below both ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digenrl.rl.flash import run_tail, tail_sigmas
from digenrl.rl.ode import ode_step
from digenrl.sim.window import SlidingWindow

FIX = json.loads((Path(__file__).parent / "_mixgrpo_oracle.json").read_text())


def _shifted(shift: float):  # the reference's schedule: a fixed shift of a uniform time grid
    def sigmas(n: int) -> torch.Tensor:
        t = torch.linspace(1, 0, n + 1)
        return shift * t / (1 + (shift - 1) * t)
    return sigmas


def _velocity(x: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
    return 0.6 * torch.tanh(x) - 0.25 * x + 0.1


@pytest.mark.parametrize("case", FIX["windows"], ids=lambda c: f"N{c['num_steps']}-W{c['window']}-step{c['overlap_step']}")
def test_the_window_moves_as_the_reference_moves_it(case: dict) -> None:
    n, w = case["num_steps"], case["window"]
    every = case["iters_per_group"] if case["overlap_step"] else 0  # a step of 0 keeps it at 0 (Flash*)
    sw = SlidingWindow(n, w, every)
    full = [k for k, ts in enumerate(case["timesteps"]) if len(ts) == w]
    assert full, "the fixture has full windows"
    for k in full[: next((i for i, k in enumerate(full) if k != i), len(full))]:  # the first cycle up to the cut
        assert list(range(sw.start(k), sw.end(k))) == case["timesteps"][k], k
    if every:  # the reference then cuts the window short; digenrl rolls back to step 0 with W steps
        cut = next(k for k, ts in enumerate(case["timesteps"]) if len(ts) < w)
        assert cut == (n - 1 - w) * every and sw.start(cut) == 0 and sw.end(cut - 1) == n - 2
        assert case["timesteps"][(n - 1) * every] == list(range(w))  # and it rolls back after N - 1 starts


@pytest.mark.parametrize("case", FIX["flash"], ids=lambda c: f"N{c['num_steps']}-s{c['start']}-r{c['ratio']}")
def test_flash_grid_and_sample_equal_the_reference(case: dict) -> None:
    n, w, s = case["num_steps"], case["window"], case["start"]
    sw = SlidingWindow(n, w, 1, case["ratio"])
    assert sw.start(s) == s
    e, k = sw.end(s), sw.tail_steps(s)
    assert sw.forwards(s) == len(case["grid"]) - 1 == e + k  # the forwards a Flash sample costs
    sigmas = _shifted(case["shift"])
    assert torch.allclose(sigmas(n), torch.tensor(case["sigmas"]), atol=1e-7)
    grid = tail_sigmas(sigmas, n, e, k)
    assert torch.allclose(grid, torch.tensor(case["grid"]), rtol=1e-6, atol=1e-7)
    # the window run deterministic (as the fixture's), then the tail from the window's last data prediction
    x, prev = torch.tensor(case["x0"]), None
    for i in range(e):
        x, prev = ode_step("euler", x, _velocity(x, None, {}), grid, i, prev)
    ref = torch.tensor(case["latents"])
    assert torch.allclose(x, ref[e], rtol=1e-5, atol=1e-6)
    x, _ = run_tail(_velocity, x, {}, grid, prev, e, n)  # indices past the tail's last step run nothing
    assert torch.allclose(x, torch.tensor(case["final"]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(x, ref[-2], atol=1e-3)  # (the sample moved on the tail's last step)


def test_the_tail_always_reaches_a_clean_sample() -> None:
    """The reference's tail of one noise level (``int(max(.., 1))`` = 1) would stop at the window's end; digenrl's
    has at least one step, to sigma 0."""
    sw = SlidingWindow(25, 4, 1, 0.4)
    for v in range(sw.positions):
        grid = tail_sigmas(_shifted(3.0), 25, sw.end(v), sw.tail_steps(v))
        assert grid[-1] == 0 and sw.tail_steps(v) >= 1 and torch.all(grid[1:] < grid[:-1])
    assert [sw.forwards(v) for v in (0, 10, 19, 20)] == [11, 17, 24, 11]  # 20: back at step 0
