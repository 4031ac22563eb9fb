"""The forward-process seam: ODE fragments across actors, the rows a trainer draws, TSP packing, the slow copy."""

from __future__ import annotations

import pytest
import torch

from digenrl.algorithms import Backward, algorithm_for
from digenrl.config import config_from_dict
from digenrl.models import repeat_cond
from digenrl.models.lora import trainable_parameters, trainable_state_dict
from digenrl.policy import build_model
from digenrl.rl.ode import ode_sample
from digenrl.roles.fragments import FragmentData, FragmentEngine

PROMPTS = ["a red square", "a blue circle", "a green square", "a white circle"]


def _cfg(algorithm: str = "nft", **rollout: object):
    return config_from_dict({"model": {"name": "qwenimage", "preset": "tiny", "text_len": 32},
                             "rollout": {"num_steps": 5, "group_size": 2, "prompts_per_batch": 4, **rollout},
                             "train": {"algorithm": algorithm}})


@pytest.fixture(scope="module")
def engines():
    cfg = _cfg()
    return cfg, FragmentEngine(cfg, build_model(cfg)[0]), FragmentEngine(cfg, build_model(cfg)[0])


def test_an_ode_fragment_handed_over_mid_way_is_bit_exact(engines) -> None:
    """dpm2 is multistep: its previous data prediction travels with the latents (FragmentData.x0)."""
    cfg, a, b = engines
    geo = [2, 0, 1, 3, 0, 2, 2]
    whole = a.fresh(geo, 0, PROMPTS)
    a.advance([whole], 0, 5)
    part = a.fresh(geo, 0, PROMPTS)
    a.advance([part], 0, 2)
    moved = FragmentData.from_wire(part.to_wire())
    assert moved.x0 is not None
    b.advance([moved], 2, 5)
    assert torch.equal(whole.x, moved.x)
    tw, tm = whole.transitions(), moved.transitions()
    assert tw.keys() == tm.keys() == {"sample", "probe", "y"}  # no trajectory: the clean latent and the probe
    assert all(torch.equal(tw[k], tm[k]) for k in tw)
    assert torch.equal(tw["y"], whole.x) and tw["sample"].tolist() == list(range(4))
    # what goes to the trainer's store: the clean latent once, no latents beside it
    assert "x" not in whole.to_wire(with_latents=False) and "x0" not in whole.to_wire()


def test_the_rollout_is_the_plain_ode_from_the_seeded_noise(engines) -> None:
    cfg, a, _ = engines
    geo = [0, 0, 0, 1, 0, 2, 2]
    frag = a.fresh(geo, 0, PROMPTS)
    x0 = frag.x.clone()
    a.advance([frag], 0, 5)
    cond = frag.cond
    ref = ode_sample(lambda x, s: a.model.velocity(x, s, cond), x0, a.sigmas, "dpm2")[-1]
    assert torch.allclose(frag.x, ref, atol=1e-6)  # (the engine merges LoRA for sampling: last-bit differences)
    assert not torch.equal(frag.x[0], frag.x[1])  # a deterministic sampler never shares x_0 within a group


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_a_tokens_rows_are_the_same_however_the_fragment_is_cut(algorithm: str) -> None:
    cfg = _cfg(algorithm)
    model, _ = build_model(cfg)
    algo = algorithm_for(cfg, model)
    k, n = algo.rows_per_sample, 4
    trans = {"sample": torch.arange(n), "y": torch.randn(n, *model.prepare_latents(1).shape[1:]),
             "probe": torch.randn(n)}
    keep, sids = torch.ones(n, dtype=torch.bool), [4, 5, 6, 7]
    whole = algo.token_rows(trans, (0, n * k), keep, 3, sids, 1)
    parts = [algo.token_rows(trans, (s, min(s + 5, n * k)), keep, 3, sids, 1) for s in range(0, n * k, 5)]
    cut = algo.cat_rows(parts, [0] * len(parts))
    for name in ("sample", "step", "y", "eps", "sigma", "sample_id"):
        assert torch.equal(getattr(whole, name), getattr(cut, name)), name
    levels = whole.step.view(n, k)
    if algorithm == "nft":  # a permutation's first levels: distinct grid indices
        assert all(len(set(row)) == k for row in levels.tolist())
    else:  # one level per stratum of grid indices 1..floor(0.9 N)
        assert levels.min() >= 1 and levels.max() <= int(0.9 * cfg.rollout.num_steps)
    assert not torch.equal(levels[0], levels[1]) or algorithm == "awm"
    other = algo.token_rows(trans, (0, n * k), keep, 4, sids, 1)  # another batch: other noise
    assert not torch.equal(other.eps, whole.eps)
    dropped = algo.token_rows(trans, (0, n * k), torch.tensor([True, False, True, False]), 3, sids, 1)
    assert dropped.sample.unique().tolist() == [0, 2] and len(dropped) == 2 * k


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in trainable_parameters(model)])


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_packed_per_level_and_sliced_passes_give_one_gradient(algorithm: str) -> None:
    """TSP over forward-process rows: one pass, passes of 3 rows, one pass per noise level and two FSDP-style
    slices summed all give the same gradient (the loss is a sum over rows)."""
    cfg = _cfg(algorithm)
    model, _ = build_model(cfg)
    with torch.no_grad():  # a trained LoRA (B != 0) that the slow copy does not equal: every term is live
        for p in trainable_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    algo = algorithm_for(cfg, model)
    with torch.no_grad():
        for p in trainable_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    n = 4
    trans = {"sample": torch.arange(n), "y": torch.randn(n, *model.prepare_latents(1).shape[1:]), "probe": torch.zeros(n)}
    rows = algo.token_rows(trans, (0, n * algo.rows_per_sample), torch.ones(n, dtype=torch.bool), 0, list(range(n)), 0)
    cond = repeat_cond(model.encode_prompts(PROMPTS[:2]), 2)
    adv = torch.tensor([1.5, -0.5, 0.3, -1.2])
    out = {}
    for name, plans in {"one": [Backward("packed")], "threes": [Backward("packed", 3)],
                        "levels": [Backward("per_step")],
                        "sliced": [Backward("sliced", 2, rank=r, world=2) for r in (0, 1)]}.items():
        model.transformer.zero_grad(set_to_none=True)
        for plan in plans:
            algo.backward(rows, cond, adv, plan, version=1)  # stale rows: AWM ratios against the EMA policy
        out[name] = _grads(model)
    assert out["one"].abs().sum() > 0
    for name in ("threes", "levels", "sliced"):
        assert torch.allclose(out[name], out["one"], rtol=1e-5, atol=1e-8), name


def test_the_old_policy_follows_and_is_what_rollouts_sample_with() -> None:
    cfg = _cfg("nft")
    model, _ = build_model(cfg)
    algo = algorithm_for(cfg, model)
    start = trainable_state_dict(model)
    with torch.no_grad():
        for p in trainable_parameters(model):
            p.add_(0.1)
    trained = trainable_state_dict(model)
    d = algo.after_step(200)["old_decay"]
    assert d == pytest.approx(0.2)  # NVlabs type 1: min(0.001 step, 0.5)
    published = algo.sampling_state()
    for k in start:
        assert torch.allclose(published[k], d * start[k] + (1 - d) * trained[k], atol=1e-7)
    x = model.prepare_latents(2, generator=torch.Generator().manual_seed(0))
    cond = repeat_cond(model.encode_prompts(["a red square"]), 2)
    sigma = torch.full((2,), 0.7)
    with algo.sampling():
        v_old = model.velocity(x, sigma, cond)
    assert all(torch.equal(v, trained[k]) for k, v in trainable_state_dict(model).items())  # swapped back exactly
    v = model.velocity(x, sigma, cond)
    assert not torch.allclose(v, v_old)
