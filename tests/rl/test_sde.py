"""The SDE step against independent math: the 1-D Gaussian toy, diffusers' Euler step, log-prob identities."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digenrl.rl.sde import gaussian_log_prob, sde_step, transition_stats, wan_noise_level

M, S = 2.0, 0.5


def exact_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Velocity of the flow from N(0,1) to N(M, S^2) (ALGORITHM (f).1), computed in fp64."""
    sig = sigma.double().reshape(-1, *([1] * (x.ndim - 1)))
    mu = (1 - sig) * M
    var = (1 - sig) ** 2 * S * S + sig**2
    xd = x.double()
    return ((sig * (xd - mu) - (1 - sig) * S * S * (xd - mu)) / var - M).float()


def shift3(n: int) -> torch.Tensor:
    u = torch.linspace(1, 0, n + 1)
    return 3 * u / (1 + 2 * u)


def run_toy(n: int, kind: str, a: float, samples: int = 100_000) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 1, generator=g)
    sig = shift3(n)
    for i in range(n):
        x = sde_step(x, exact_velocity(x, sig[i].expand(samples)), sig[i], sig[i + 1], a, kind=kind, generator=g).x_next
    return float(x.mean()), float(x.std())


# Terminal (mean, std) from ALGORITHM (f).1.
TABLE = {
    (10, "sde", 0.0): (2.000, 0.370), (40, "sde", 0.0): (2.000, 0.465), (200, "sde", 0.0): (2.000, 0.494),
    (10, "sde", 0.7): (2.000, 0.424), (40, "sde", 0.7): (1.999, 0.479), (200, "sde", 0.7): (2.002, 0.497),
    (10, "cps", 0.8): (2.000, 0.315), (40, "cps", 0.8): (2.000, 0.372), (200, "cps", 0.8): (2.000, 0.392),
}


@pytest.mark.parametrize(("n", "kind", "a"), [(10, "sde", 0.0), (40, "sde", 0.7), (10, "cps", 0.8), (40, "cps", 0.8)])
def test_gaussian_toy_matches_table(n: int, kind: str, a: float) -> None:
    mean, std = run_toy(n, kind, a)
    want_mean, want_std = TABLE[(n, kind, a)]
    assert mean == pytest.approx(want_mean, abs=0.012)
    assert std == pytest.approx(want_std, abs=0.006)


def test_sde_converges_to_target_as_steps_grow() -> None:
    runs = {n: run_toy(n, "sde", 0.7, 50_000) for n in (10, 40, 200)}
    errs = [abs(runs[n][1] - S) for n in (10, 40, 200)]
    assert errs[0] > errs[1] > errs[2]
    assert runs[200][0] == pytest.approx(TABLE[(200, "sde", 0.7)][0], abs=0.015)
    assert runs[200][1] == pytest.approx(TABLE[(200, "sde", 0.7)][1], abs=0.006)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_level_zero_is_the_diffusers_euler_step(dtype: torch.dtype) -> None:
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=g).to(dtype)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=g).to(dtype)
        ref = sched.step(v, t, x, return_dict=False)[0]
        out = sde_step(x, v, sched.sigmas[i], sched.sigmas[i + 1], 0.0)
        assert out.log_prob is None
        if dtype == torch.float32:
            assert torch.equal(out.x_next, ref)
        else:
            # diffusers rounds dt*v to bf16 before the fp32 add; we keep it in fp32 (ALGORITHM (e).1).
            assert torch.allclose(out.x_next.to(dtype).float(), ref.float(), rtol=2**-7, atol=2**-7)
        for kind in ("wan", "dance", "cps"):
            other = sde_step(x, v, sched.sigmas[i], sched.sigmas[i + 1], 0.0, kind=kind).x_next
            assert torch.equal(other, out.x_next)
        x = ref


def test_first_step_std_is_noise_level_and_sigma_one_substitution() -> None:
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    _, std, g = transition_stats(x, v, 1.0, 0.9, 0.7)
    assert torch.allclose(std, torch.full((2,), 0.7), atol=1e-6)
    assert torch.isfinite(g).all()
    _, std, g = transition_stats(x, v, 0.5, 0.4, 0.7)
    assert std[0].item() == pytest.approx(0.7 * math.sqrt(0.5 / 0.5) * math.sqrt(0.1), rel=1e-6)


def test_variants_g() -> None:
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    _, std, g = transition_stats(x, v, 0.5, 0.3, 0.3, "dance")
    assert torch.allclose(g, torch.full((2,), 0.3)) and torch.allclose(std, 0.3 * torch.sqrt(torch.tensor(0.2)))
    sig = shift3(10)
    _, std, g = transition_stats(x, v, sig[3], sig[4], wan_noise_level(sig), "wan")
    assert torch.allclose(g, torch.full((2,), float(sig[1] * sig[3])))
    mean, std, _ = transition_stats(x, v, 0.5, 0.0, 0.8, "cps")
    assert torch.equal(std, torch.zeros(2))  # CPS is deterministic at the last step
    assert torch.allclose(mean, x - 0.5 * v, atol=1e-6)  # x0 prediction


def test_log_prob_recomputed_from_stored_transition_and_its_expectation() -> None:
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(4, 16, 64, generator=g), torch.randn(4, 16, 64, generator=g)
    sigma = torch.tensor([1.0, 0.8, 0.6, 0.3])
    sigma_next = torch.tensor([0.9, 0.6, 0.3, 0.1])
    out = sde_step(x, v, sigma, sigma_next, 0.7, generator=g)
    again = sde_step(x, v, sigma, sigma_next, 0.7, x_next=out.x_next)
    assert torch.allclose(again.log_prob, out.log_prob, atol=1e-6, rtol=0)
    # On policy, E[l] = -1/2 - log s - 1/2 log 2 pi (D = 1024 elements, so the mean is tight).
    expect = -0.5 - torch.log(out.std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(out.log_prob, expect, atol=0.1)
    # Independent computation with torch.distributions.
    ref = torch.distributions.Normal(out.mean, out.std.reshape(4, 1, 1)).log_prob(out.x_next).flatten(1).mean(1)
    assert torch.allclose(out.log_prob, ref, atol=1e-5)


def test_per_row_deterministic_rows_have_nan_log_prob() -> None:
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    out = sde_step(x, v, 0.6, 0.4, torch.tensor([0.7, 0.0, 0.7]))
    assert out.log_prob is not None
    assert torch.isnan(out.log_prob[1]) and torch.isfinite(out.log_prob[[0, 2]]).all()
    assert torch.equal(out.x_next[1], x[1] + (torch.tensor(0.4) - 0.6) * v[1])


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="unknown sde kind 'ode'"):
        sde_step(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, 0.7, kind="ode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shapes differ"):
        sde_step(torch.zeros(1, 2), torch.zeros(1, 3), 0.5, 0.4, 0.7)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        sde_step(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(3), 0.4, 0.7)


def test_cps_log_prob_is_unnormalised_squared_error() -> None:
    x_next, mean = torch.randn(2, 6), torch.randn(2, 6)
    lp = gaussian_log_prob(x_next, mean, torch.tensor([0.3, 0.3]), "cps")
    assert torch.allclose(lp, -((x_next - mean) ** 2).mean(1))
