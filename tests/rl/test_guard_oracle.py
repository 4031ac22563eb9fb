"""GRPO-Guard's loss against the numbers of both references' own code (``_guard_oracle.json``).

A script kept outside the repository (it executes reference source; none of it is copied here) read the git
blobs of yifan123/flow_grpo's fork zhtmike/flow_grpo @9745241 and verl-project/verl-omni @a1139ba and ran:

* the rollout: flow_grpo's ``sde_step_with_logprob`` (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``,
  ``return_sqrt_dt=True``) on a ``FlowMatchEulerDiscreteScheduler(1000, shift=3).set_timesteps(6)``, step 2,
  noise level 0.7, v_old, drawing its noise ``z`` from a seeded generator: ``x_next``, ``log_prob_old``,
  ``mean_old``; four rows, all at that step (as both references' batches are);
* the trainer: the same step with ``prev_sample = x_next`` and v_new (v_old plus noise of scale 0, 0.004, 0.02,
  0.08 per row), then flow_grpo's ``scripts/train_sd3_GRPO_Guard.py`` loss block (from ``advantages =
  torch.clamp(`` to ``policy_loss / (sqrt_dt.mean()**2)``, taken verbatim at run time, ``rationorm=True``) and
  veRL-Omni's ``GRPOGuardLoss.compute_loss`` (``verl_omni/trainer/diffusion/diffusion_algos.py``), each with
  clip 2e-4 (so rows 2 and 3 clip), ``adv_clip_max`` 5, on the four rows and on row 3 alone; ``grad_v`` is
  ``d loss / d v_new`` from ``backward()``.

Mapped onto digenrl: the reference's ``std_dev_t`` is our ``g``, ``sqrt_dt`` is ``sqrt(sigma - sigma_next)``,
their product our step std; the rollout's mean is rebuilt as ``x_next - std z`` (what GrpoGuard does with the
seeded noise). The reference's scalar is the mean over rows of our per-row loss. Tolerances: rtol 1e-5 on the
losses and gradients (the same fp32 formulas in a different operation order, divided by dt ~ 0.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digenrl.rl.guard import GuardLoss, guard_loss
from digenrl.rl.sde import gaussian_log_prob, transition_stats

FIX = json.loads((Path(__file__).parent / "_guard_oracle.json").read_text())
INP, SET = FIX["inputs"], FIX["settings"]


def _t(d: dict) -> torch.Tensor:
    return torch.tensor(d["data"], dtype=torch.float32).view(d["shape"])


def _ours(rows: list[int], bias: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss (the references' scalar), d loss / d v and the ratios of ``rows``, by digenrl's functions."""
    x, x_next, z = _t(INP["x"])[rows], _t(INP["x_next"])[rows], _t(INP["z"])[rows]
    v = _t(INP["v_new"])[rows].requires_grad_(True)
    n = len(rows)
    sigma, sigma_next = torch.full((n,), INP["sigma"]), torch.full((n,), INP["sigma_next"])
    mean, std, _ = transition_stats(x, v, sigma, sigma_next, SET["noise_level"])
    mean_old = x_next - std.view(-1, 1, 1, 1) * z  # the rollout's mean, rebuilt from its noise
    terms = guard_loss(gaussian_log_prob(x_next, mean, std), _t(INP["log_prob_old"])[rows],
                       _t(INP["advantages"])[rows], GuardLoss(clip_range=SET["clip_range"], bias=bias),
                       mean=mean, mean_old=mean_old, std=std, dt=sigma - sigma_next)
    loss = terms.loss.mean()
    loss.backward()
    return loss.detach(), v.grad, terms.sums["ratio"]


@pytest.mark.parametrize("reference,bias", [("verl_omni", "sample"), ("flow_grpo", "batch")])
def test_loss_and_gradient_match_each_reference(reference: str, bias: str) -> None:
    want = FIX[reference]["batch"]
    loss, grad, _ = _ours([0, 1, 2, 3], bias)
    assert float(loss) == pytest.approx(want["loss"], rel=1e-5)
    torch.testing.assert_close(grad, _t(want["grad_v"]), rtol=1e-5, atol=1e-7)


def test_the_references_differ_on_a_batch_and_agree_on_one_row() -> None:
    """§12's pitfall: flow_grpo's bias is one scalar per batch, veRL-Omni's per sample; the fixture shows both."""
    assert FIX["flow_grpo"]["batch"]["loss"] != pytest.approx(FIX["verl_omni"]["batch"]["loss"], rel=1e-5)
    for reference, bias in (("verl_omni", "sample"), ("flow_grpo", "batch")):
        loss, grad, _ = _ours([3], bias)
        assert float(loss) == pytest.approx(FIX[reference]["row3"]["loss"], rel=1e-5)
        torch.testing.assert_close(grad, _t(FIX[reference]["row3"]["grad_v"]), rtol=1e-5, atol=1e-7)


def test_per_sample_bias_leaves_an_on_policy_row_at_ratio_one() -> None:
    """Row 0 was trained with the weights that sampled it: its normalised ratio is 1 under the per-sample bias
    (what digenrl trains with), while flow_grpo's batch bias moves it by the other rows' drift."""
    x, x_next, z = (_t(INP[k])[:1] for k in ("x", "x_next", "z"))
    v = _t(INP["v_new"])[:1]
    sigma, sigma_next = torch.tensor([INP["sigma"]]), torch.tensor([INP["sigma_next"]])
    mean, std, _ = transition_stats(x, v, sigma, sigma_next, SET["noise_level"])
    terms = guard_loss(gaussian_log_prob(x_next, mean, std), _t(INP["log_prob_old"])[:1], torch.ones(1), GuardLoss(),
                       mean=mean, mean_old=x_next - std * z, std=std, dt=sigma - sigma_next)
    assert abs(float(terms.sums["ratio"]) - 1.0) < 1e-6
    assert abs(_t(FIX["flow_grpo"]["batch"]["ratio"])[0].item() - 1.0) > 1e-5
