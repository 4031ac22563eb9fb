"""The RL core on the real tiny diffusers models with LoRA (ALGORITHM (f).3, (f).4), and TSP on a real transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.data.prompts import load_prompts
from digenrl.models import MODEL_NAMES, load_model, repeat_cond
from digenrl.models.lora import apply_lora, reference, trainable_parameters
from digenrl.rl.advantages import group_advantages
from digenrl.rl.loss import LossConfig, reduce_stats
from digenrl.rl.rollout import rollout_steps
from digenrl.rl.sde import sde_step
from digenrl.rl.steps import plan_steps
from digenrl.rl.tsp import packed_backward, per_step_backward

PROMPTS = ["a red square", "a blue circle"]
G = 2


# an edit model's prompts carry their input images (the shipped example's first two)
EDIT_PROMPTS = load_prompts(prompt_file=str(Path(__file__).parents[2] / "examples/edit/prompts.jsonl"))[:2]


def _rollout(model, steps: int = 4, seed: int = 0):  # noqa: ANN001, ANN202
    cond = repeat_cond(model.encode_prompts(EDIT_PROMPTS if model.name == "qwenimage_edit" else PROMPTS), G)
    groups = torch.arange(len(PROMPTS)).repeat_interleave(G)
    gen = torch.Generator().manual_seed(seed)
    x0 = model.prepare_latents(len(groups), generator=gen)
    sigmas = model.sigmas(steps)
    plan = plan_steps(steps, groups)
    res = rollout_steps(model.velocity, x0, cond, sigmas, plan, 0, steps, noise_level=0.7, generator=gen)
    return cond, groups, sigmas, res


def _ref(model):  # noqa: ANN001, ANN202
    def ref(x, s, c):  # noqa: ANN001, ANN202
        with reference(model):
            return model.velocity(x, s, c)

    return ref


@pytest.fixture(scope="module")
def qwen_cfg():  # noqa: ANN201
    """Tiny Qwen-Image with true CFG (w = 4) and LoRA: the production guidance path."""
    model = load_model("qwenimage", "tiny", guidance_scale=4.0)
    apply_lora(model, rank=4, seed=0)
    return model


def test_ratio_one_and_kl_zero_before_the_first_update(qwen_cfg) -> None:  # noqa: ANN001
    model = qwen_cfg
    cond, groups, _, res = _rollout(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    model.transformer.zero_grad()
    stats = reduce_stats(packed_backward(model.velocity, res.transitions, cond, adv, LossConfig(kl_beta=0.04),
                                         ref_velocity=_ref(model)))
    assert stats["rows"] == 4 * 3
    assert stats["ratio_dev"] < 1e-5 and stats["clipfrac"] == 0
    assert stats["approx_kl"] < 1e-10
    assert stats["kl"] == 0.0  # LoRA B = 0: the adapter adds exactly zero
    grads = [p.grad for p in trainable_parameters(model)]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)
    assert all(p.requires_grad for p in trainable_parameters(model))  # the reference context restored them


def test_stored_log_probs_recompute_with_same_weights(qwen_cfg) -> None:  # noqa: ANN001
    model = qwen_cfg
    cond, _, _, res = _rollout(model, seed=1)
    tb = res.transitions
    for step in tb.step.unique().tolist():
        rows = (tb.step == step).nonzero().flatten()
        sub = tb.rows(rows)
        with torch.no_grad():
            v = model.velocity(sub.x, sub.sigma, {k: t[sub.sample] for k, t in cond.items()})
        again = sde_step(sub.x, v, sub.sigma, sub.sigma_next, sub.noise_level, x_next=sub.x_next)
        assert torch.allclose(again.log_prob, sub.log_prob, atol=1e-6, rtol=0)


def test_tsp_equals_per_step_loop_on_real_transformer(qwen_cfg) -> None:  # noqa: ANN001
    model = qwen_cfg
    cond, groups, _, res = _rollout(model, seed=2)
    params = trainable_parameters(model)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():  # move off B = 0 so every LoRA weight has a gradient and ratios differ from 1
        g = torch.Generator().manual_seed(0)
        for p in params:
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    try:
        adv = group_advantages(torch.tensor([0.1, 0.3, 0.2, 0.0]), groups, std="group").advantages
        cfg = LossConfig(clip_range=1e-3, kl_beta=0.1)
        model.transformer.zero_grad()
        s1 = reduce_stats(per_step_backward(model.velocity, res.transitions, cond, adv, cfg, ref_velocity=_ref(model)))
        g1 = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        model.transformer.zero_grad()
        s2 = reduce_stats(packed_backward(model.velocity, res.transitions, cond, adv, cfg, rows_per_pass=5,
                                          ref_velocity=_ref(model)))
        g2 = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        assert s1["kl"] > 0 and s1["ratio_dev"] > 0
        for a, b in zip(g1, g2, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
        assert s2["kl"] == pytest.approx(s1["kl"], rel=1e-4)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_preset_runs_a_rollout_and_a_training_step(name: str) -> None:
    try:
        model = load_model(name, "tiny")
    except ImportError as exc:  # the adapter module has not landed yet
        pytest.skip(f"{name} adapter not available: {exc}")
    params = apply_lora(model, rank=2, seed=0)
    cond, groups, _, res = _rollout(model, steps=3)
    images = model.decode(res.x)
    assert images.shape[0] == 4 and images.shape[1] == 3 and torch.isfinite(images).all()
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    packed_backward(model.velocity, res.transitions, cond, adv, LossConfig(clip_range=1e-2))
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
