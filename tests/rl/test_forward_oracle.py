"""DiffusionNFT and AWM losses, NFT's ODE sampler and the schedules, against numbers from the reference code.

``_forward_oracle.json`` holds seeded inputs and what the reference implementations computed from them. A
script kept outside the repository (it executes reference source; none of it is copied here) read the git
blobs of NVlabs/DiffusionNFT @24af555 and scxue/advantage_weighted_matching @be51372 and ran:

* NFT ``scripts/train_nft_sd3.py``: ``return_decay``; the loss block of ``main()`` (lines 862-870 and
  908-980, taken verbatim into a function at run time) with stand-in tensors for the three transformer
  forwards (``forward_prediction`` = v, ``old_prediction`` = v_old, ``ref_forward_prediction`` = v_ref) and
  ``torch.randn_like`` returning the fixture's eps. Scalars come from the batch of 6 rows, ``loss_rows``
  from the same block run on each row alone, ``grad_v`` from ``loss.backward()``.
* NFT ``flow_grpo/diffusers_patch/solver.py``: ``run_sampling(solver="dpm2" | "flow", determistic=True)``
  (``"flow"`` with eta 0 is Euler) on the linear field ``v(x, sigma) = A x.flatten() + b sigma``.
* AWM ``advantage_weighted_matching/scripts/train_sd3_awm.py``: ``compute_log_prob_awm`` and the training
  block of ``main()`` (lines 1267-1369; off-policy also the ``old_log_probs`` pass, lines 1231-1240) with a
  stub transformer whose default / disabled / ``'ema'`` adapters return v / v_ref / v_ema; config
  ``weighting='ghuber'``, ``ghuber_power=0.25``, ``loss_type='exp_first'``, ``kl_weight`` and
  ``kl_ema_weight='Uniform'``, ``adv_clip_max=5``, ``advantage_max=1``, beta 1e-3, ema_beta 1,
  ``train_timesteps=1``, ``batch_size=6`` (the script also checked that 2 timesteps x 3 samples, rows
  timestep-major with tiled advantages, give the same loss); and the ``discrete_wo_init`` draw (1198-1202).

Conventions mapped onto digenrl's functions:

* NFT's ``x0`` is the CLEAN latent ``y``; its ``t`` is ``timesteps / 1000`` formed in fp32: that is our
  ``sigma``; ``xt = (1 - t) x0 + t noise`` is our ``x_t``.
* AWM's ``timestep`` is also sigma in (0, 1); ``random_noise`` is eps, ``clean_latents`` y.
* Reductions: both references reduce every non-batch dim by a mean per row, then average over rows, so the
  reference's scalar is ``terms.loss.mean()`` and a reference diagnostic is ``terms.sums[k] / sums["rows"]``.
  NFT's ``policy_loss`` includes the factor ``adv_clip_max`` (5); ``kl`` is the unweighted mean. The
  fixture's NFT ``policy_loss`` is ``(ori_policy_loss * 5).mean()``: the reference's own ``policy_loss``
  (and its logged ``loss_terms["policy_loss"]``) equals the total, because ``loss = policy_loss`` is
  followed by an in-place ``loss += beta * kl`` (kept as ``policy_loss_logged``, not tested).
* dtypes: inputs fp32. NFT forms the adaptive weights in float64, so its policy loss is float64; AWM casts
  the prediction to float64 (log-prob, ratio, KL). Gradients land on the fp32 v.
* ``ode_sample`` returns the N latents after each step (``run_sampling``'s ``all_latents[1:]``).

Tolerances: rtol 1e-6 / atol 1e-7 for losses and gradients. The sampler uses rtol 1e-5 / atol 1e-6: the
reference applies float64 coefficients to fp32 latents along its own operation order (its first step is
DDIM, not the Euler formula), and the reference run in fp32 is up to 4.8e-7 from the same run in float64
at |x| <= 5.6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from digenrl.rl.forward import (AwmLoss, NftLoss, awm_log_prob, awm_loss, awm_strata, nft_loss, nft_prob,
                                old_policy_decay)
from digenrl.rl.ode import ode_sample

FIX = json.loads((Path(__file__).parent / "_forward_oracle.json").read_text())


def _t(d: dict, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(d["data"], dtype=dtype).view(d["shape"])


def _close(actual, expected, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    a = actual.detach().double() if isinstance(actual, torch.Tensor) else torch.tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(a, torch.as_tensor(expected, dtype=torch.float64).view(a.shape), rtol=rtol, atol=atol)


def _inputs(d: dict) -> dict[str, torch.Tensor]:
    return {k: _t(x) for k, x in d.items()}


def _mean(sums: dict, key: str) -> float:
    return float(sums[key]) / sums["rows"]


def _check_nft(inp: dict, case: dict) -> None:
    v = inp["v"].clone().requires_grad_(True)
    cfg = NftLoss(beta=case["beta"], kl_beta=case["kl_beta"])
    terms = nft_loss(v, inp["v_old"], inp["v_ref"], inp["x_t"], inp["y"], inp["sigma"], inp["advantages"], cfg)
    terms.loss.mean().backward()
    assert terms.sums["rows"] == v.shape[0]
    _close(terms.loss.mean(), case["loss"])
    _close(_mean(terms.sums, "policy_loss"), case["policy_loss"])
    _close(_mean(terms.sums, "kl"), case["kl"])
    _close(v.grad, _t(case["grad_v"]))
    if "loss_rows" in case:
        _close(terms.loss, case["loss_rows"])


def test_nft_prob() -> None:
    """r = clamp(clamp(A, -c, c) / c / 2 + 1/2, 0, 1), on advantages beyond +-5 and an exact 0."""
    d = FIX["nft_r"]
    _close(nft_prob(torch.tensor(d["advantages"]), d["clip"]), d["r"], atol=0)


@pytest.mark.parametrize("case", FIX["nft"], ids=lambda c: f"beta{c['beta']}")
def test_nft_loss(case: dict) -> None:
    """Per-row loss, scalar loss, policy loss (x adv_clip), KL and dL/dv at beta 1 and 0.1, KL beta 1e-4."""
    _check_nft(_inputs(FIX["inputs"]), case)


def test_nft_weight_floor() -> None:
    """Row 0's positive and row 1's negative x0 error is 2^-21 per element, under the 1e-5 floor.

    Dyadic inputs (sigma 1/2 and 1/4, beta 1) keep every fp32 operation exact, so the floored rows do not
    depend on the order of operations: with the floor their gradient is about 20x smaller than without it.
    """
    _check_nft(_inputs(FIX["nft_floor"]["inputs"]), FIX["nft_floor"])


def test_old_policy_decay() -> None:
    """NVlabs return_decay(step, type): 0 copies; 1 min(1e-3 step, 0.5); 2 zero before 75, then 7.5e-3 up to 0.999."""
    d = FIX["decay"]
    for kind, values in d["values"].items():
        assert [old_policy_decay(s, int(kind)) for s in d["steps"]] == pytest.approx(values, rel=1e-12, abs=0)


def test_awm_log_prob() -> None:
    """compute_log_prob_awm(weighting='ghuber', p=0.25): float64, <= 0, for the policy and the EMA predictions."""
    inp = _inputs(FIX["inputs"])
    on, off = FIX["awm"]
    for v, expected in ((inp["v"], on["log_prob"]), (inp["v_ema"], off["log_prob_old"])):
        lp = awm_log_prob(v, inp["eps"], inp["y"], inp["sigma"], on["power"])
        assert lp.dtype == torch.float64 and bool((lp <= 0).all())
        _close(lp, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", FIX["awm"], ids=lambda c: c["name"])
def test_awm_loss(case: dict) -> None:
    """On-policy (ratio 1, clip range 1) and off-policy (l_old from v_ema, clip range 0.2; rows 0 and 1 clip to
    a zero policy gradient, rows 2 and 3 are outside the range on the side that keeps it)."""
    inp = _inputs(FIX["inputs"])
    v = inp["v"].clone().requires_grad_(True)
    cfg = AwmLoss(power=case["power"], clip_range=case["clip_range"], adv_clip=case["adv_clip"],
                  adv_max=case["adv_max"], kl_beta=case["kl_beta"], ema_beta=case["ema_beta"])
    old = torch.tensor(case["log_prob_old"], dtype=torch.float64) if case["off_policy"] else None
    terms = awm_loss(v, inp["eps"], inp["y"], inp["sigma"], inp["advantages"], old, inp["v_ref"], inp["v_ema"], cfg)
    terms.loss.mean().backward()
    assert terms.sums["rows"] == v.shape[0]
    _close(terms.loss, case["loss_rows"])
    _close(terms.loss.mean(), case["loss"])
    for key, ref in (("policy_loss", "policy_loss"), ("kl", "kl"), ("ema_kl", "ema_kl"), ("clipfrac", "clipfrac"),
                     ("ratio", "ratio_mean")):
        _close(_mean(terms.sums, key), case[ref])
    _close(v.grad, _t(case["grad_v"]))


@pytest.mark.parametrize("d", FIX["strata"], ids=lambda d: f"N{d['num_steps']}-L{d['levels']}")
def test_awm_strata(d: dict) -> None:
    """discrete_wo_init: cut points linspace(1, int(N * fraction), L + 1) truncated by .long(); the draw is
    lo + floor(u (hi - lo)), so index int(N * fraction) is never drawn and an empty stratum (lo == hi, the
    N = 6 case) always gives lo."""
    assert awm_strata(d["num_steps"], d["fraction"], d["levels"]) == list(zip(d["lo"], d["hi"], strict=True))


@pytest.mark.parametrize("run", FIX["sampler"]["runs"], ids=lambda r: f"{r['solver']}-N{r['n']}")
def test_ode_sample(run: dict) -> None:
    """run_sampling(determistic=True) on an SD3 shift-3 grid (linspace(1, 1/N, N) -> 3s / (1 + 2s), then 0).

    dpm2's step 0 and last step are first order; step 1 looks back to sigma = 1, where lambda = -inf, so it
    is first order too (D1 = 0). First-order DPM-Solver++ is Euler in this parametrisation, so at N = 3
    dpm2 equals Euler; N = 4 and 10 have second-order steps.
    """
    s = FIX["sampler"]
    a, b = _t(s["A"]), _t(s["b"])

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        assert sigma.shape == (x.shape[0],)
        return (x.flatten(1) @ a.T).view_as(x) + b.view(1, *x.shape[1:]) * sigma.view(-1, 1, 1, 1)

    sigmas = torch.tensor(run["sigmas"], dtype=torch.float32)
    out = ode_sample(velocity, _t(s["z"]), sigmas, run["solver"])
    assert len(out) == run["n"]
    _close(torch.stack(out), _t(run["latents"]), rtol=1e-5, atol=1e-6)
