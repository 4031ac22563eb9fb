"""Wan2.2 (``models/wan22.py``): A14B's two experts per row, LoRA on both and its publication, expert offload,
the SDE window placed by the boundary, TI2V-5B, and the pretrained / random presets (tiny, CPU seconds)."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import RolloutConfig, config_from_dict
from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models.base import index_cond
from digenrl.models.experts import expert_counts, expert_rows, expert_splitter, expert_window_starts, window_range
from digenrl.models.lora import apply_lora, reference, trainable_state_dict
from digenrl.models.wan22 import Wan22Model
from digenrl.rl.loss import LossConfig, reduce_stats
from digenrl.rl.rollout import TransitionBatch
from digenrl.rl.steps import plan_steps
from digenrl.rl.tsp import packed_backward, per_step_backward


_EXPERT_KEYS = ("guidance_scale_2", "train_experts", "expert_offload")


def _tiny(**kwargs) -> Wan22Model:
    experts = {k: kwargs.pop(k) for k in _EXPERT_KEYS if k in kwargs}
    kwargs = {"resolution": (32, 32), **kwargs}
    return load_model("wan22", "tiny", text_len=8, experts=experts, **kwargs)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def cfg_model() -> Wan22Model:
    """A14B with CFG on (the variant's published scales: 4 on the high-noise expert, 3 on the low-noise one)."""
    return _tiny()


def _inputs(m: Wan22Model, sigma: list[float]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    b = len(sigma)
    x = m.prepare_latents(b, torch.Generator().manual_seed(0))
    cond = m.encode_prompts([f"prompt {i}" for i in range(b)])
    return x, torch.tensor(sigma), cond


def test_two_experts_differ_and_keep_their_published_guidance(cfg_model: Wan22Model) -> None:
    m = cfg_model
    assert m.experts == ("transformer", "transformer_2") and m.boundary_ratio == 0.875
    assert (m.guidance_scale, m.guidance_scale_2) == (4.0, 3.0)
    a, b = (dict(getattr(m.pipe, n).named_parameters()) for n in m.experts)
    assert not torch.equal(a["blocks.0.attn1.to_q.weight"], b["blocks.0.attn1.to_q.weight"])


def test_expert_of_each_row_follows_the_pipelines_boundary(cfg_model: Wan22Model) -> None:
    m = cfg_model
    # the pipeline runs `transformer` where t >= boundary_ratio * 1000, t = 1000 sigma
    sigma = torch.tensor([1.0, 0.875, 0.8749, 0.3, 0.9])
    assert m.expert_of(sigma).tolist() == [0, 0, 1, 1, 0]
    s = m.sigmas(4)  # 1, .90 | .75, .50
    assert m.boundary_step(4) == 2 and m.expert_of(s[:-1]).tolist() == [0, 0, 1, 1]
    assert [(label, rows.tolist()) for label, rows in expert_rows(m, sigma)] == [("high", [0, 1, 4]), ("low", [2, 3])]
    assert expert_counts(m, sigma) == {"rows_by_expert/high": 3.0, "rows_by_expert/low": 2.0}


def test_packed_rows_of_both_experts_equal_per_step_calls(cfg_model: Wan22Model) -> None:
    """A packed TSP batch (rows at many sigmas) gives each row its own expert's guided velocity."""
    m = cfg_model
    x, sigma, cond = _inputs(m, [1.0, 0.5, 0.9, 0.75])
    with torch.no_grad():
        packed = m.velocity(x, sigma, cond)
        for i in range(4):
            one = m.velocity(x[i:i + 1], sigma[i:i + 1], index_cond(cond, torch.tensor([i])))
            torch.testing.assert_close(packed[i:i + 1], one, rtol=0, atol=2e-6)
        # and each row is its own expert's: the other expert answers differently
        high = m._guided("transformer", x, sigma, cond)
        low = m._guided("transformer_2", x, sigma, cond)
    for i, expert in enumerate(m.expert_of(sigma).tolist()):
        mine, other = (high, low) if expert == 0 else (low, high)
        torch.testing.assert_close(packed[i], mine[i], rtol=0, atol=2e-6)
        assert not torch.allclose(packed[i], other[i], atol=1e-3)


def test_lora_on_both_experts_names_every_tensor_after_its_expert() -> None:
    m = _tiny(guidance_scale=1.0)
    params = apply_lora(m, rank=2, seed=0)
    sd = trainable_state_dict(m)
    experts = {k.split(".")[0] for k in sd}
    assert experts == {"transformer", "transformer_2"} and len(params) == len(sd)
    high = {k.split(".", 1)[1] for k in sd if k.startswith("transformer.")}
    low = {k.split(".", 1)[1] for k in sd if k.startswith("transformer_2.")}
    assert high == low and len(high) == len(sd) // 2
    # one adapter per expert, drawn one after the other: their lora_A differ
    key = next(k for k in high if "lora_A" in k)
    assert not torch.equal(sd[f"transformer.{key}"], sd[f"transformer_2.{key}"])
    # a gradient reaches both experts' LoRA through one packed pass of rows of both
    x, sigma, cond = _inputs(m, [1.0, 0.5])
    m.velocity(x, sigma, cond).square().mean().backward()
    grads = {e: sum(float(p.grad.abs().sum()) for n, p in m.transformer.named_parameters()
                    if n.startswith(f"{e}.") and "lora_B" in n and p.grad is not None) for e in m.experts}
    assert grads["transformer"] > 0 and grads["transformer_2"] > 0


@pytest.mark.parametrize("train_experts,trained", [("high", "transformer"), ("low", "transformer_2")])
def test_train_one_expert_keeps_the_other_frozen(train_experts: str, trained: str) -> None:
    m = _tiny(guidance_scale=1.0, train_experts=train_experts)
    apply_lora(m, rank=2, seed=0)
    assert {k.split(".")[0] for k in trainable_state_dict(m)} == {trained}
    frozen = next(n for n in m.experts if n != trained)
    assert not any(p.requires_grad for p in getattr(m.pipe, frozen).parameters())
    with pytest.raises(ConfigError, match="model.train_experts"):
        _tiny(train_experts="middle")


def _transitions(m: Wan22Model, sigmas: list[float]) -> tuple[TransitionBatch, dict, torch.Tensor]:
    n = len(sigmas)
    x, sigma, cond = _inputs(m, sigmas)
    step = torch.arange(n)
    batch = TransitionBatch(x=x, x_next=x * 0.9, log_prob=torch.zeros(n), sigma=sigma, sigma_next=sigma - 0.1,
                            sample=torch.arange(n), step=step, noise_level=torch.full((n,), 0.7), kind="sde",
                            policy_version=0)
    return batch, cond, torch.linspace(-1, 1, n)


def test_tsp_passes_split_by_expert_and_count_rows_by_expert() -> None:
    m = _tiny(guidance_scale=1.0)
    apply_lora(m, rank=2, seed=0)
    batch, cond, adv = _transitions(m, [1.0, 0.5, 0.9, 0.75, 0.3])
    sums = packed_backward(m.velocity, batch, cond, adv, LossConfig(), rows_per_pass=2, experts=expert_splitter(m))
    # 2 high rows (1.0, 0.9) in one pass, 3 low rows in passes of 2 + 1: no pass mixes experts
    assert [(s.get("rows_by_expert/high", 0), s.get("rows_by_expert/low", 0)) for s in sums] == [
        (2.0, 0), (0, 2.0), (0, 1.0)]
    stats = reduce_stats(sums)
    assert stats["rows_by_expert/high"] == 2 and stats["rows_by_expert/low"] == 3 and stats["rows"] == 5
    per_step = reduce_stats(per_step_backward(m.velocity, batch, cond, adv, LossConfig(), experts=expert_splitter(m)))
    assert (per_step["rows_by_expert/high"], per_step["rows_by_expert/low"]) == (2, 3)


def test_the_gradient_does_not_depend_on_the_expert_split() -> None:
    m = _tiny(guidance_scale=1.0)
    params = apply_lora(m, rank=2, seed=0)
    with torch.no_grad():  # B != 0, so both experts' A and B get gradients
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batch, cond, adv = _transitions(m, [1.0, 0.5, 0.9, 0.75])
    grads = []
    for experts in (None, expert_splitter(m)):
        for p in params:
            p.grad = None
        packed_backward(m.velocity, batch, cond, adv, LossConfig(), experts=experts)
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_expert_offload_swaps_one_expert_in_and_equals_resident() -> None:
    resident, offload = _tiny(), _tiny(expert_offload=True)
    x, sigma, cond = _inputs(resident, [1.0, 0.5, 0.9])
    with torch.no_grad():
        torch.testing.assert_close(offload.velocity(x, sigma, cond), resident.velocity(x, sigma, cond), rtol=0, atol=0)
    assert offload.swaps == 1 and resident.swaps == 0  # high rows on the resident expert, then low swapped in
    with torch.no_grad():
        offload.velocity(x[:1], sigma[:1], index_cond(cond, torch.tensor([0])))
    assert offload.swaps == 2 and offload._resident == "transformer"  # back for a high-noise row
    apply_lora(offload, rank=2, seed=0)
    lora = [p for n, p in offload.transformer.named_parameters() if "lora_" in n]
    assert lora and all(p.device == offload.device for p in lora)  # trained weights stay by their optimizer
    # under autograd one pass must not mix experts (a swap inside a graph); the TSP split keeps them apart
    with pytest.raises(RuntimeError, match="model.expert_offload"):
        offload.velocity(x, sigma, cond)
    batch, c, adv = _transitions(offload, [1.0, 0.5, 0.9])
    assert reduce_stats(packed_backward(offload.velocity, batch, c, adv, LossConfig(),
                                        experts=expert_splitter(offload)))["rows"] == 3


@pytest.mark.parametrize("placement,expected", [("any", (0, 7)), ("high", (0, 1)), ("low", (3, 7)), ("span", (2, 2))])
def test_window_starts_relative_to_the_boundary(placement: str, expected: tuple[int, int]) -> None:
    # 10 steps, window 2, the low-noise expert from step 3: starts keep the last step (9) out
    assert expert_window_starts(placement, 10, 2, 3) == expected
    lo, hi = expected
    for start in range(lo, hi + 1):
        steps = set(range(start, start + 2))
        assert {"any": True, "high": max(steps) < 3, "low": min(steps) >= 3,
                "span": min(steps) < 3 <= max(steps)}[placement]


def test_window_placement_that_cannot_fit_names_the_key() -> None:
    with pytest.raises(ConfigError, match="rollout.window_expert = 'high'.*steps 0..0"):
        expert_window_starts("high", 10, 2, 1)
    assert expert_window_starts("low", 10, 2, 3, window_range=(0, 4)) == (3, 4)


def test_window_expert_places_every_groups_window(cfg_model: Wan22Model) -> None:
    ro = RolloutConfig(num_steps=8, steps="window", window=2, window_expert="low")
    lo, hi = window_range(cfg_model, ro)  # type: ignore[misc]
    boundary = cfg_model.boundary_step(8)
    assert 0 < boundary <= lo
    plan = plan_steps(8, list(range(16)), mode="window", window=2, window_range=(lo, hi), seed=3)
    trained_sigmas = cfg_model.sigmas(8)[:-1].expand(16, 8)[plan.trained]
    assert set(cfg_model.expert_of(trained_sigmas).tolist()) == {1}
    with pytest.raises(ConfigError, match="rollout.window_expert"):
        RolloutConfig(num_steps=8, steps="all_but_last", window_expert="low")
    qwen = load_model("qwenimage", "tiny")
    with pytest.raises(ConfigError, match="no expert boundary"):
        window_range(qwen, ro)


def test_ti2v_5b_tiny_is_one_transformer_over_the_48_channel_vae() -> None:
    m = _tiny(variant="TI2V-5B")
    assert m.experts == ("transformer",) and m.boundary_ratio is None and m.guidance_scale == 5.0
    assert m.latent_shape == (48, 1, 2, 2)  # 16x spatial
    x, sigma, cond = _inputs(m, [1.0, 0.2])
    assert m.velocity(x, sigma, cond).shape == x.shape
    assert m.decode(x).shape == (2, 3, 32, 32)
    assert m.expert_of(sigma).tolist() == [0, 0] and expert_splitter(m) is None
    with pytest.raises(ConfigError, match="model.train_experts"):
        _tiny(variant="TI2V-5B", train_experts="high")
    with pytest.raises(ConfigError, match="model.expert_offload"):
        _tiny(variant="TI2V-5B", expert_offload=True)
    with pytest.raises(ConfigError, match="multiples of 32"):
        _tiny(variant="TI2V-5B", resolution=(48, 48))


def test_pretrained_round_trip_keeps_both_experts_and_the_boundary(cfg_model: Wan22Model, tmp_path) -> None:
    cfg_model.save_pretrained(tmp_path / "wan22")
    m = load_model("wan22", "pretrained", path=tmp_path / "wan22", resolution=(32, 32), text_len=8)
    assert m.experts == ("transformer", "transformer_2") and m.boundary_ratio == 0.875
    assert (m.guidance_scale, m.guidance_scale_2) == (4.0, 3.0)
    x, sigma, cond = _inputs(cfg_model, [1.0, 0.5])
    with torch.no_grad():
        torch.testing.assert_close(m.velocity(x, sigma, cond), cfg_model.velocity(x, sigma, cond), rtol=0, atol=0)


def test_random_preset_cut_to_one_block_builds_both_experts() -> None:
    m = load_model("wan22", "random", variant="A14B", layers=1, text_encoder="random-embeds", dtype=torch.bfloat16,
                   resolution=(32, 32), text_len=4)
    assert m.experts == ("transformer", "transformer_2") and m.boundary_ratio == 0.875
    a, b = m.pipe.transformer, m.pipe.transformer_2
    assert a.config.num_attention_heads == 40 and len(a.blocks) == 1 and len(b.blocks) == 1
    assert not torch.equal(a.blocks[0].attn1.to_q.weight, b.blocks[0].attn1.to_q.weight)
    x, sigma, cond = _inputs(m, [1.0, 0.5])
    with torch.no_grad():
        assert torch.isfinite(m.velocity(x.bfloat16(), sigma, cond).float()).all()


async def test_rollout_actor_receives_and_applies_both_experts_lora() -> None:
    """Publication carries both experts' LoRA: the rollout actor's digest equals the trainer's after one update,
    and both its experts answer differently than before (one probe row per expert)."""
    from digenrl.actors import ActorSystem
    from digenrl.data.prompts import load_prompts
    from digenrl.recipes.disaggregated import start_cluster, tiny_cpu_cost
    from digenrl.roles.coordinator import Coordinator

    cfg = config_from_dict({
        "model": {"name": "wan22", "preset": "tiny", "resolution": [32, 32], "text_len": 8},
        "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 2},
        "train": {"iterations": 1, "lr": 1e-2, "clip_range": 1e-2, "adv_std": "group"},
        "schedule": {"name": "disaggregated"},
        "transport": {"actors": "inproc"},
    })
    async with ActorSystem(transport="inproc") as system:
        c = await start_cluster(system, cfg)
        trainer, rollout = c.refs["trainer-0"], c.refs["rollout-0"]
        history = await Coordinator(cfg, "disaggregated", c.devices, c.refs, load_prompts("color"),
                                    cost=tiny_cpu_cost(), is_dead=c.is_dead).run()
        assert history[0]["rows_by_expert/high"] > 0 and history[0]["rows_by_expert/low"] > 0
        info = await trainer.weights_info.call()
        assert info["version"] == 1
        before = await rollout.probe_velocity.call(0)  # the initial weights (version 0), which sampled the batch
        old = (await rollout.weights_info.call(0))["digest"]
        await trainer.publish.call(info["version"], ["rollout-0"])
        after = await rollout.probe_velocity.call(info["version"])
        state = await rollout.weights_info.call()
        assert state["digest"] == info["digest"] != old
        assert torch.equal(after, await trainer.probe_velocity.call())
        for row, expert in enumerate(("high", "low")):  # row 0 at the first sigma, row 1 at the last nonzero one
            assert not torch.allclose(after[row], before[row]), f"the {expert}-noise expert's LoRA did not arrive"
