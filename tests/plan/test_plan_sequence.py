"""Sequence parallelism in the plan: memory per SP rank against a hand computation, the refusal that names the
degree that fits, the long-video config, and the degrees the fleet planner chooses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.plan.memory import memory_plan, memory_problems, traces_for
from digenrl.plan.sequence import sequence_tokens, sp_candidates
from digenrl.sim.user import fleet_pools

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_memory_per_sp_rank_divides_activations_only() -> None:
    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    traces = traces_for(cfg)
    one = memory_plan(cfg, traces)
    two = memory_plan(load_config(CONFIGS / "tiny-qwenimage.toml", ["placement.trainer_sp=2"]), traces)
    s = sequence_tokens(cfg)
    share = math.ceil(s / 2) / s  # a rank's share of the padded sequence
    t1, t2 = one.roles["trainer"], two.roles["trainer"]
    assert t2.sp == 2 and t2.devices == 2 * t1.devices
    assert two.train_activations == int(one.train_activations * share)
    assert abs(t2.activations - t1.activations * share) <= 8  # (rounded per term)
    for part in ("weights", "trainable", "grads", "optimizer", "vae", "text_encoders"):
        assert getattr(t2, part) == getattr(t1, part), part  # whole on every rank (DDP / LoRA)
    assert one.roles["rollout"].activations == two.roles["rollout"].activations  # the rollout's SP is its own
    assert any("sequence parallel (Ulysses) over 2 devices" in n for n in t2.notes)


def test_long_video_config_needs_trainer_sp_2_on_an_h100() -> None:
    cfg = load_config(CONFIGS / "wan_long.toml")
    assert sequence_tokens(cfg) == 21 * 30 * 52
    traces = traces_for(cfg)
    plan = memory_plan(cfg, traces)
    assert plan.fits and plan.roles["trainer"].sp == 2 and plan.roles["trainer"].bytes_per_device < 78e9
    sp1 = load_config(CONFIGS / "wan_long.toml", ["placement.trainer_sp=1"])
    refused = memory_plan(sp1, traces)
    assert not refused.roles["trainer"].fits
    (problem,) = memory_problems(sp1, refused)
    gb = plan.roles["trainer"].bytes_per_device / 1e9
    assert "the trainer role needs" in problem and f"placement.trainer_sp = 2 " in problem
    assert f"fits: {gb:.1f} GB per device" in problem
    # at SP 2 the trainer's activations are half of SP 1's (32760 tokens split evenly), its weights the same
    t1, t2 = refused.roles["trainer"], plan.roles["trainer"]
    assert t2.weights == t1.weights and abs(t2.activations - t1.activations / 2) < 1e6


def test_fleet_tries_sp_only_where_it_is_needed_or_can_pay() -> None:
    cfg = load_config(CONFIGS / "sd3.toml")  # SD3.5-M at 512^2: 1229 tokens a row
    pairs, notes = sp_candidates(cfg, fleet_pools("16xH800"), traces_for(cfg, linear=True))
    assert pairs == [(1, 1)] and "cannot pay, not tried" in notes[0]
    pairs, notes = sp_candidates(cfg, fleet_pools("16xH800"), None, measured=True)
    assert pairs == [(1, 1)]


@pytest.mark.slow  # ~85 s on 2 cores: three split searches of Wan2.1-14B at 81 frames
def test_fleet_planner_chooses_sp_for_long_video(tmp_path: Path) -> None:
    from digenrl.plan.fleet import write_config
    from digenrl.plan.sequence import plan_fleet_sp

    cfg = load_config(CONFIGS / "wan_long.toml")
    result = plan_fleet_sp(cfg, fleet_pools("16xH100"), top=3, batches=4, final_batches=6)
    best = result.best
    assert best.trainer_sp == 2 and best.rollout_sp in (1, 2)
    assert any("trainer: SP 2 is the smallest degree" in n for n in result.notes)
    assert any(n.startswith("chose placement.rollout_sp") for n in result.notes)
    written = write_config(CONFIGS / "wan_long.toml", [], best, tmp_path / "planned.toml")
    assert written.placement.sp_of("trainer") == 2 and memory_plan(written).fits


@pytest.mark.slow  # ~30 s: one split search of SD3.5-M
def test_fleet_planner_keeps_sp_1_for_a_short_config() -> None:
    from digenrl.plan.sequence import plan_fleet_sp

    result = plan_fleet_sp(load_config(CONFIGS / "sd3.toml"), fleet_pools("8xH800"), top=2, batches=4,
                           final_batches=6)
    assert (result.best.rollout_sp, result.best.trainer_sp) == (1, 1)
    assert any("chose placement.rollout_sp = 1, placement.trainer_sp = 1" in n for n in result.notes)


def test_full_fine_tuning_keeps_trainers_at_sp_1() -> None:
    """Several full-fine-tuning trainers shard with FSDP, which SP trainers refuse: the fleet search never
    proposes trainer_sp > 1 for them (it used to, and `plan --fleet` stopped on the refusal)."""
    cfg = load_config(CONFIGS / "flux.toml", ["model.finetune=full"])
    pairs, notes = sp_candidates(cfg, fleet_pools("16xH100"), traces_for(cfg, linear=True))
    assert {trainer for _, trainer in pairs} == {1}
    assert "trainer: SP 1 (full fine-tuning shards over several trainers with FSDP" in notes[0]
