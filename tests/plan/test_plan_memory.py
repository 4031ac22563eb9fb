"""The memory plan: byte counts from independent arithmetic, shipped configs fit, refusals name the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.plan.memory import check_memory, lora_params, memory_plan
from digenrl_cli.main import app

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PUBLISHED = {"qwenimage": 20.43e9, "flux": 11.90e9, "wan21": 1.42e9, "hunyuanvideo": 12.82e9}


@pytest.mark.parametrize("name", ["qwenimage", "flux", "wan21", "hunyuanvideo"])
def test_shipped_config_counts_the_published_model_and_fits_an_h100(name: str, tmp_path: Path) -> None:
    file = {"wan21": "wan21", "hunyuanvideo": "hunyuanvideo"}.get(name, name)
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(CONFIGS / f"{file}.toml"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())
    assert abs(plan["model"]["transformer_params"] / PUBLISHED[name] - 1) < 0.02
    assert plan["device"]["type"] == "H100"
    for role in ("rollout", "trainer"):
        assert plan["roles"][role]["fits"] is True
        assert 0 < plan["roles"][role]["bytes_per_device"] < 78e9


def test_trainer_bytes_follow_the_arithmetic() -> None:
    cfg = load_config(CONFIGS / "qwenimage.toml")
    plan = memory_plan(cfg)
    tr, n = plan.roles["trainer"], plan.transformer_params
    lora = tr.trainable_params
    assert tr.weights == n * 2  # bf16, replicated (LoRA, ddp)
    assert tr.trainable == lora * 2 + lora * 4  # bf16 adapters + fp32 master
    assert tr.grads == lora * 4 and tr.optimizer == lora * 8  # fp32 grads, Adam's two fp32 moments
    assert tr.reference == 0  # LoRA's reference is the base with adapters off
    fsdp = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["train.shard=fsdp"])).roles["trainer"]
    assert fsdp.grads == lora * 4 // 4 and fsdp.optimizer == lora * 8 // 4  # split over 4 trainers
    assert n * 2 // 4 < fsdp.weights < n * 2 // 4 + 2e9  # a quarter, plus two gathered blocks
    no_master = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["train.fp32_master=false"])).roles["trainer"]
    assert no_master.trainable == lora * 2 and no_master.grads == lora * 2


def test_lora_count_matches_peft_on_the_tiny_model() -> None:
    from digenrl.models import load_model
    from digenrl.models.lora import apply_lora

    for name, targets in (("qwenimage", "[]"), ("flux", "[]"), ("qwenimage", '["to_q", "proj_out"]')):
        cfg = load_config(CONFIGS / "tiny-qwenimage.toml", [f"model.name={name}", f"model.lora_targets={targets}"])
        model = load_model(name, "tiny")
        expected = lora_params(cfg, model.transformer)
        params = apply_lora(model, rank=cfg.model.lora_rank, target_modules=cfg.model.lora_targets or None)
        assert sum(p.numel() for p in params) == expected


def test_activations_grow_with_rows_and_shrink_with_checkpointing() -> None:
    base = memory_plan(load_config(CONFIGS / "flux.toml", ["train.rows_per_pass=8"])).train_activations
    more = memory_plan(load_config(CONFIGS / "flux.toml", ["train.rows_per_pass=16"])).train_activations
    off = memory_plan(load_config(CONFIGS / "flux.toml", ["train.rows_per_pass=8", "train.grad_checkpointing=false"]))
    assert 1.8 < more / base < 2.1
    assert off.train_activations > 5 * base


@pytest.mark.parametrize("overrides,key", [
    (["schedule.name=colocated"], "schedule.name"),
    (["train.grad_checkpointing=false"], "train.grad_checkpointing"),
    (["train.rows_per_pass=64"], "train.rows_per_pass"),
    (["model.finetune=full", "train.shard=ddp"], "train.shard"),
])
def test_a_config_that_does_not_fit_names_the_key(overrides: list[str], key: str) -> None:
    cfg = load_config(CONFIGS / "qwenimage.toml", overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_memory(cfg)


def test_run_checks_memory_before_spawning_anything(tmp_path: Path) -> None:
    # the tiny model at 4096^2 on this host: one pass over the whole batch's rows cannot fit its memory
    res = CliRunner().invoke(app, ["run", str(CONFIGS / "tiny-qwenimage.toml"), "--set", "model.resolution=[4096, 4096]",
                                   "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "memory: the rollout role needs" in res.output and "schedule.fragment_groups" in res.output
    assert not (tmp_path / "run").exists()  # nothing was started


def test_advice_only_names_changes_that_can_fit() -> None:
    # 396 GB of activations without checkpointing: splitting ~48 GB of weights and states cannot help
    with pytest.raises(ConfigError, match="grad_checkpointing") as err:
        check_memory(load_config(CONFIGS / "qwenimage.toml", ["train.grad_checkpointing=false"]))
    assert "fsdp" not in str(err.value)
    # a 24 GB card cannot hold Qwen-Image's 41 GB of weights: smaller fragments would not help
    with pytest.raises(ConfigError, match=r"weights and VAE alone do not fit: change placement\.gpu") as err:
        check_memory(load_config(CONFIGS / "qwenimage.toml", ['placement.gpu="RTX4090"']))
    assert "fragment_groups" not in str(err.value)
    # full fine-tuning: 368 GB of weights and states need ~7 H100s to split over, not the configured 4
    with pytest.raises(ConfigError, match=r"train\.shard = 'fsdp' with placement\.trainer = (\d+) or more") as err:
        check_memory(load_config(CONFIGS / "qwenimage.toml", ['model.finetune="full"', 'train.shard="fsdp"']))
    need = int(re.search(r"placement\.trainer = (\d+)", str(err.value)).group(1))
    check_memory(load_config(CONFIGS / "qwenimage.toml", ['model.finetune="full"', 'train.shard="fsdp"',
                                                          f"placement.trainer={need}"]))


def test_decode_batch_bounds_the_decode_peak() -> None:
    # DanceGRPO's HunyuanVideo recipe (G = 24): decoding a fragment's 24 videos at once needs ~155 GB
    recipe = ["rollout.prompts_per_batch=16", "rollout.group_size=24", "rollout.num_steps=16", "rollout.window=3",
              "schedule.fragment_groups=1", "rollout.decode_batch=0"]
    with pytest.raises(ConfigError, match=r"rollout\.decode_batch = (\d+) or less") as err:
        check_memory(load_config(CONFIGS / "hunyuanvideo.toml", recipe))
    most = int(re.search(r"decode_batch = (\d+)", str(err.value)).group(1))
    fits = memory_plan(load_config(CONFIGS / "hunyuanvideo.toml", [*recipe, f"rollout.decode_batch={most}"]))
    over = memory_plan(load_config(CONFIGS / "hunyuanvideo.toml", [*recipe, f"rollout.decode_batch={most + 1}"]))
    assert fits.roles["rollout"].fits and not over.roles["rollout"].fits
    assert fits.roles["rollout"].activations == max(fits.rollout_forward, most * fits.decode_sample)


def test_colocated_baseline_of_a_real_config_does_not_fit() -> None:
    with pytest.raises(ConfigError, match=r"colocated role needs .* schedule\.name"):
        check_memory(load_config(CONFIGS / "qwenimage.toml", ["schedule.name=colocated"]))


def test_tiny_config_fits_this_host() -> None:
    plan = check_memory(load_config(CONFIGS / "tiny-qwenimage.toml"))
    assert plan.device == "cpu" and plan.fits


def test_linear_traces_equal_exact_traces() -> None:
    """A plan search prices candidates from two traced batch sizes: on meta the peak is affine in the batch."""
    from digenrl.plan.memory import traces_for

    cfg = load_config(CONFIGS / "hunyuanvideo.toml")
    linear, exact = traces_for(cfg, linear=True), traces_for(cfg)
    for rows in (5, 12):
        assert linear.train(rows) == exact.train(rows)
        assert linear.forward(rows) == exact.forward(rows)


def test_sd3_config_plans_sd35_medium_at_real_size(tmp_path: Path) -> None:
    """configs/sd3.toml: SD3.5 Medium's parameters (2.243 B; its checkpoint also holds the 0.227 B position table,
    tests/models/test_full.py) and its three text encoders (CLIP-L, CLIP-G, T5-XXL), fitting an H100."""
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(CONFIGS / "sd3.toml"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())
    assert plan["model"]["transformer_params"] == 2_243_171_520 and plan["model"]["variant"] == "medium"
    assert abs(plan["model"]["text_encoder_params"] / 5.58e9 - 1) < 0.01
    assert all(plan["roles"][role]["fits"] for role in ("rollout", "trainer"))
