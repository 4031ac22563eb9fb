"""The clipped loss, TSP packing against the per-timestep loop, and the gradient-sign test (ALGORITHM (f).4, (f).6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from digenrl.rl.advantages import group_advantages
from digenrl.rl.loss import LossConfig, grpo_loss, reduce_stats
from digenrl.rl.rollout import TransitionBatch, rollout_steps
from digenrl.rl.steps import plan_steps
from digenrl.rl.tsp import packed_backward, per_step_backward, sliced_backward


class TinyVelocity(nn.Module):
    """A small nonlinear conditional velocity on [B, T, C] latents with per-row sigma."""

    def __init__(self, c: int = 8, e: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(c, 32)
        self.emb = nn.Linear(e + 1, 32)
        self.out = nn.Linear(32, c)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.emb(torch.cat([cond["emb"], sigma[:, None]], dim=1))[:, None, :]
        # Mixing across tokens makes rows depend on all of their own tokens (as attention does).
        z = torch.tanh(self.inp(x) + h)
        return self.out(z + z.mean(dim=1, keepdim=True))


def make_batch(seed: int = 0, mode: str = "all_but_last") -> tuple[TinyVelocity, TransitionBatch, dict, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = TinyVelocity()
    b, n = 6, 5
    cond = {"emb": torch.randn(b, 6)}
    groups = [0, 0, 0, 1, 1, 1]
    plan = plan_steps(n, groups, mode=mode, fraction=0.5, seed=seed)  # type: ignore[arg-type]
    sigmas = torch.linspace(1, 0, n + 1)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, 4, 8, generator=g)
    res = rollout_steps(net, x0, cond, sigmas, plan, 0, n, noise_level=0.7, generator=g)
    adv = group_advantages(res.x.mean(dim=(1, 2)), groups, std="group").advantages
    return net, res.transitions, cond, adv, res.x


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("mode", ["all_but_last", "fraction"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_tsp_packing_equals_per_timestep_loop(mode: str, beta: float) -> None:
    net, batch, cond, adv, _ = make_batch(mode=mode)
    ref_net = TinyVelocity()
    cfg = LossConfig(clip_range=0.02, kl_beta=beta)
    # Move the policy off the behaviour weights so ratios, clipping and the KL are all non-trivial.
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    net.zero_grad()
    s_loop = reduce_stats(per_step_backward(net, batch, cond, adv, cfg, ref_velocity=ref_net))
    g_loop = grads(net)
    assert 0 < s_loop["clipfrac"] < 1 and s_loop["approx_kl"] > 0
    for rows_per_pass in (None, 7, 3):
        perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(2))
        net.zero_grad()
        s_tsp = reduce_stats(
            packed_backward(net, batch.rows(perm), cond, adv, cfg, rows_per_pass=rows_per_pass, ref_velocity=ref_net)
        )
        for a, b in zip(g_loop, grads(net), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        for k in ("policy_loss", "kl", "approx_kl", "clipfrac", "rows"):
            assert s_tsp[k] == pytest.approx(s_loop[k], rel=1e-5, abs=1e-7)


def test_stored_log_probs_recompute_and_ratio_is_one_on_policy() -> None:
    net, batch, cond, adv, _ = make_batch()
    net.zero_grad()
    stats = reduce_stats(packed_backward(net, batch, cond, adv, LossConfig(kl_beta=1.0), ref_velocity=net))
    assert stats["ratio_dev"] < 1e-5 and stats["clipfrac"] == 0
    assert stats["approx_kl"] < 1e-12 and stats["kl"] == 0


def test_loss_values_against_hand_computation() -> None:
    lp_old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    lp = torch.tensor([0.1, -0.1, 0.01, -0.01], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    terms = grpo_loss(lp, lp_old, adv, LossConfig(clip_range=0.05))
    r = torch.exp(lp.detach())
    # Row 0: A > 0 and r > 1 + eps, clipped (no gradient). Row 1: A > 0, r < 1 - eps, the unclipped
    # term is the max, so it keeps its gradient (PPO only stops pushing further in the advantage's direction).
    want = torch.tensor([-1.05, -r[1].item(), r[2].item(), r[3].item()])
    assert torch.allclose(terms.loss, want)
    assert terms.sums["clipfrac"] == 2 and terms.sums["clipfrac_gt_one"] == 1
    assert terms.sums["approx_kl"] == pytest.approx(0.5 * (0.01 + 0.01 + 1e-4 + 1e-4), rel=1e-5)
    terms.loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([0.0, -r[1].item(), r[2].item(), r[3].item()]))  # clipped row: no grad
    mean, ref = torch.zeros(2, 3), torch.ones(2, 3)
    kl = grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), LossConfig(kl_beta=1.0), mean=mean, mean_ref=ref,
                   std=torch.tensor([0.5, 1.0]), g=torch.tensor([1.0, 2.0]))
    assert torch.allclose(kl.loss, torch.tensor([2.0, 0.5]))
    kl2 = grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), LossConfig(kl_beta=1.0, kl_kind="g2"), mean=mean,
                    mean_ref=ref, std=torch.tensor([0.5, 1.0]), g=torch.tensor([1.0, 2.0]))
    assert torch.allclose(kl2.loss, torch.tensor([0.5, 0.125]))
    with pytest.raises(ValueError, match="kl_beta > 0 needs mean"):
        grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), LossConfig(kl_beta=1.0))
    with pytest.raises(ValueError, match="unknown kl_kind"):
        LossConfig(kl_kind="l2")  # type: ignore[arg-type]


class ShiftedToy(nn.Module):
    """The exact 1-D Gaussian velocity (ALGORITHM (f).1) plus a learnable per-prompt shift."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        sig = sigma.reshape(-1, 1)
        mu = (1 - sig) * 2.0
        var = (1 - sig) ** 2 * 0.25 + sig**2
        return (sig * (x - mu) - (1 - sig) * 0.25 * (x - mu)) / var - 2.0 + self.theta


def _expected_reward(net: nn.Module) -> float:
    sigmas = 3 * torch.linspace(1, 0, 9) / (1 + 2 * torch.linspace(1, 0, 9))
    plan = plan_steps(8, [0] * 4000)
    g = torch.Generator().manual_seed(123)
    res = rollout_steps(net, torch.randn(4000, 1, generator=g), {}, sigmas, plan, 0, 8, noise_level=0.7, generator=g)
    return float(res.x.mean())


@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_gradient_sign(sign: float) -> None:
    """+A raises the reward (here: the final sample value), -A lowers it, A = 0 leaves theta alone."""
    torch.manual_seed(0)
    net = ShiftedToy()
    sigmas = 3 * torch.linspace(1, 0, 9) / (1 + 2 * torch.linspace(1, 0, 9))
    groups = [0] * 8 + [1] * 8
    plan = plan_steps(8, groups)
    g = torch.Generator().manual_seed(7)
    res = rollout_steps(net, torch.randn(16, 1, generator=g), {}, sigmas, plan, 0, 8, noise_level=0.7, generator=g)
    adv = sign * group_advantages(res.x.flatten(), groups, std="group").advantages
    before = _expected_reward(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=1e-4)
    for _ in range(3):
        opt.zero_grad()
        packed_backward(net, res.transitions, {}, adv, LossConfig(clip_range=1.0))
        opt.step()
    after = _expected_reward(net)
    if sign > 0:
        assert after > before + 0.05
    elif sign < 0:
        assert after < before - 0.05
    else:
        assert math.isclose(float(net.theta.detach()), 0.0, abs_tol=1e-12)


def test_parity_metrics_measure_the_rollout_log_probs_against_the_recompute() -> None:
    """Max |dl| and max |r - 1| are the largest per-row gaps; the recompute of a sample agrees with the pass."""
    from dataclasses import replace

    from digenrl.rl.tsp import parity_recompute
    from digenrl.telemetry.metrics import parity_fields, parity_warning

    net, batch, cond, adv, _ = make_batch()
    shift = torch.zeros(len(batch))
    shift[3] = 0.01  # one row's stored log-prob off by 0.01: what a rollout/trainer numerics drift looks like
    drifted = replace(batch, log_prob=batch.log_prob + shift)
    stats = reduce_stats(packed_backward(net, drifted, cond, adv, LossConfig(), rows_per_pass=4))
    assert stats["parity_rows"] == len(batch)
    assert stats["parity_logp_diff_max"] == pytest.approx(0.01, abs=1e-6)
    assert stats["parity_ratio_dev_max"] == pytest.approx(1 - math.exp(-0.01), abs=1e-6)
    assert stats["parity_ratio"] == pytest.approx((len(batch) - 1 + math.exp(-0.01)) / len(batch), abs=1e-6)
    line = {"step": 7, **parity_fields(stats)}
    warning = parity_warning(line, 1e-3)
    assert warning is not None and "train.parity_tolerance" in warning and "step 7" in warning
    assert parity_warning(line, 0.1) is None
    # A pass that does not measure parity (stale rows) adds nothing; a recompute of every row matches.
    assert "parity_rows" not in packed_backward(net, batch, cond, adv, LossConfig(), parity=False)[0]
    again = reduce_stats([parity_recompute(net, drifted, cond, max_rows=len(batch))])
    assert again["parity_logp_diff_max"] == pytest.approx(0.01, abs=1e-6)
    assert parity_fields(reduce_stats([parity_recompute(net, batch.rows([]), cond, 4)]))["parity_ratio"] is None


@pytest.mark.parametrize(("world", "rows_per_pass"), [(2, None), (3, 4), (4, 2), (40, 1)])
def test_sliced_backward_over_ranks_sums_to_the_packed_gradient(world: int, rows_per_pass: int | None) -> None:
    """FSDP's data split: every rank runs the same passes; summed over ranks, the gradient of the whole batch."""
    net, batch, cond, adv, _ = make_batch()
    ref_net = TinyVelocity()
    cfg = LossConfig(clip_range=0.02, kl_beta=0.5)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    n = len(batch)
    net.zero_grad()
    s_packed = reduce_stats(packed_backward(net, batch, cond, adv, cfg, normalizer=n, ref_velocity=ref_net))
    g_packed = grads(net)
    net.zero_grad()
    calls = []
    counting = lambda x, s, c: calls.append(len(x)) or net(x, s, c)  # noqa: E731
    sums = []
    for rank in range(world):
        before = len(calls)
        sums += sliced_backward(counting, batch, cond, adv, cfg, rank=rank, world=world, rows_per_pass=rows_per_pass,
                                normalizer=n, ref_velocity=ref_net)
        passes = len(calls) - before
        if rank == 0:
            first = passes
        assert passes == first  # the same number of forward passes on every rank (FSDP's collectives match)
    for a, b in zip(g_packed, grads(net), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    s_sliced = reduce_stats(sums)
    for k in ("policy_loss", "kl", "clipfrac", "rows"):
        assert s_sliced[k] == pytest.approx(s_packed[k], rel=1e-5, abs=1e-7)
