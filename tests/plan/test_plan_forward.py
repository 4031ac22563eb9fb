"""A forward-process config (DiffusionNFT, AWM) as the planner prices it: its ODE rollout without CFG, its rows' no-grad
forwards, the bytes a sample moves beside Flow-GRPO's, the slow copy in memory, and the planner's fixes for the
paper scenarios (a split whose default fragments do not fit, the train token size); every number against an
independent computation from the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.plan.fleet import config_profile, plan_scenario
from digenrl.plan.memory import memory_plan, traces_for
from digenrl.plan.rows import nograd_forwards, row_cost, slow_copies
from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import TRAIN_PASSES, CostModel
from digenrl.sim.devices import device_spec
from digenrl.sim.flops import SampleShape, forward_flops

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SD3_NFT = CONFIGS / "sd3_nft.toml"
TINY = CONFIGS / "tiny-qwenimage.toml"
LATENT = 4 * 16 * 64 * 64  # fp32, 16 channels, 512 px / 8
COND = (77 + 128) * 4096 * 2 + 2048 * 2  # bf16 prompt embeddings (CLIP 77 + T5 128 tokens, 4096 wide) + pooled 2048


@pytest.fixture(scope="module")
def nft_plan():  # type: ignore[no-untyped-def]
    return memory_plan(load_config(SD3_NFT))


def test_no_grad_forwards_per_row_follow_the_algorithm_and_its_keys() -> None:
    def n(*overrides: str) -> int:
        return nograd_forwards(load_config(TINY, list(overrides)))

    assert n() == 1 and n("train.kl_beta=0.0") == 0  # Flow-GRPO: the reference with a KL term
    assert n('train.algorithm="nft"') == 2 and n('train.algorithm="nft"', "nft.kl_beta=0.0") == 1  # + the old policy
    assert n('train.algorithm="awm"') == 2  # reference + EMA policy
    # AWM without its EMA term still forwards the EMA policy for a one-step-stale sample's ratio (async1), not on-policy
    assert n('train.algorithm="awm"', "awm.kl_beta=0.0", "awm.ema_beta=0.0") == 1
    assert n('train.algorithm="awm"', "awm.kl_beta=0.0", "awm.ema_beta=0.0", 'schedule.name="tag"') == 0
    cfg = load_config(SD3_NFT)
    rows = row_cost(cfg)
    assert (rows.nograd_forwards, rows.row_latents, rows.sample_latents, rows.logprob_rows) == (2, 0, 1, False)
    assert slow_copies(cfg) == 1 and slow_copies(load_config(TINY)) == 0
    assert row_cost(load_config(TINY)).row_latents == 2 and row_cost(load_config(TINY)).logprob_rows


def test_an_nft_plan_prices_the_ode_rollout_and_the_rows_from_the_config() -> None:
    cfg = load_config(SD3_NFT)
    prof = config_profile(cfg, traces_for(cfg, linear=True))
    # independently: SD3.5-M at 512 px, 77 + 128 text tokens; guidance 1.0 -> one pass per step and per row
    f = forward_flops("sd3", SampleShape.from_pixels(1, 512, 512, 77 + 128), variant="medium")
    assert (prof.forward_flops, prof.cfg_rollout, prof.cfg_train) == (f, 1, 1)
    spec, p = device_spec("H800"), calibrated_params()
    cost = CostModel(prof, {"r": spec, "t": spec}, p, {"r": Role.ROLLOUT, "t": Role.TRAINER})
    # a rollout token of 24 samples over steps 1..9 (no prompt encoding): 24 x 9 x 1 pass x F
    roll = Token(0, TokenKind.ROLLOUT, "r", 0, num_samples=24, step_start=1, step_end=10)
    assert cost.seconds(roll, Device("r", Role.ROLLOUT)) == pytest.approx(
        24 * 9 * f / (spec.peak_bf16_flops * p.mfu_rollout) + 9 * p.pass_latency_s)
    # a train token on a rollout-role device (no network): 9 rows x (fwd + bwd + recompute + old policy + reference)
    train = Token(0, TokenKind.TRAIN, "r", 0, num_samples=1, transitions=9)
    assert cost.seconds(train, Device("r", Role.ROLLOUT)) == pytest.approx(
        9 * (TRAIN_PASSES + 2) * f / (spec.peak_bf16_flops * p.mfu_train) + p.pass_latency_s)
    # a dedicated trainer also pulls the sample's clean latent and conditioning (no trajectory latents)
    extra = cost.seconds(train, Device("t", Role.TRAINER)) - cost.seconds(train, Device("r", Role.ROLLOUT))
    assert extra == pytest.approx((LATENT + 12 + COND) / spec.net_bytes_per_s)
    # a batch: 48 x 24 samples x 10 steps of rollout; 9 rows a sample x 6 passes of training
    _, work = cost.batch_work(48 * 24, 48, 10, 48 * 24 * 9, spec)
    assert work == pytest.approx(48 * 24 * 9 * (TRAIN_PASSES + 2) * f / (spec.peak_bf16_flops * p.mfu_train))


def test_bytes_per_sample_beside_flow_grpo(nft_plan) -> None:  # type: ignore[no-untyped-def]
    b = nft_plan.boundary
    assert (b.latent, b.conditioning, b.rows, b.flow_grpo_rows) == (LATENT, COND, 9, 9)
    assert b.bytes == LATENT + 12 + COND  # the clean latent, its index and reward, the conditioning once
    assert b.flow_grpo_bytes == 9 * (2 * LATENT + 32) + 4 + COND  # 9 transitions x (x_i, x_{i+1} + 32 B of scalars)
    # the simulator's profile of the same config says the same
    cfg = load_config(SD3_NFT)
    assert config_profile(cfg, traces_for(cfg, linear=True)).boundary_bytes(9) == b.bytes
    assert "Flow-GRPO on this model: 6.402 MB" in b.describe() and "1.946 MB per sample" in b.describe()


def test_the_slow_copy_is_in_the_trainer_memory(nft_plan) -> None:  # type: ignore[no-untyped-def]
    trainer = nft_plan.roles["trainer"]
    # a second LoRA adapter in fp32 (train.fp32_master); the rollout samples with the one it was sent
    assert trainer.slow_copy == 4 * trainer.trainable_params > 0 and nft_plan.roles["rollout"].slow_copy == 0
    assert trainer.bytes_per_device - trainer.slow_copy == trainer.weights + trainer.trainable + trainer.grads + \
        trainer.optimizer + trainer.activations + trainer.vae + trainer.text_encoders + trainer.reward_models
    # the two no-grad forwards' fp32 velocities are held through the training pass
    assert nft_plan.train_peak == nft_plan.train_activations + 2 * nft_plan.rows_per_pass * LATENT
    assert memory_plan(load_config(CONFIGS / "sd3.toml")).roles["trainer"].slow_copy == 0  # Flow-GRPO keeps none


def test_full_fine_tuning_keeps_a_second_transformer() -> None:
    cfg = load_config(SD3_NFT, ['model.finetune="full"'])
    plan = memory_plan(cfg)
    trainer, n = plan.roles["trainer"], cfg.placement.trainer
    assert plan.shard == "fsdp"  # shard "auto": full fine-tuning -> fsdp, each member its shards
    assert trainer.slow_copy == 4 * plan.transformer_params // n  # fp32 shards (fp32_master)
    assert trainer.reference == 2 * plan.transformer_params // n  # nft.kl_beta > 0: the frozen bf16 reference


def test_the_wan_split_the_default_fragments_kept_out_is_found() -> None:
    """wan-16 planned 3 + 13 H800 at 91.8% of its bound: the splits with fewer rollout devices, whose default
    fragments (4 prompts at 480x832x33 frames) do not fit an H800, were never simulated; with one prompt per
    fragment they fit and lead."""
    from digenrl.sim.bench import _bound, simulate_pair
    from digenrl.sim.scenarios import scenario
    from digenrl.telemetry.stats import summarize

    sc = scenario("wan-16")
    split, result = plan_scenario(sc, final_batches=8)
    assert sum(n for _, n in split.rollout) < 3 and dict(split.options)["fragment_groups"] <= 2
    colocated = summarize(simulate_pair(sc, "colocated", 8)).steady.samples_per_s
    planned = summarize(simulate_pair(sc, "async1", 8, split)).steady.samples_per_s
    assert planned / colocated / _bound(sc, colocated) >= 0.97


def test_plan_prints_the_slow_copy_and_the_bytes_per_sample() -> None:
    from typer.testing import CliRunner

    from digenrl_cli.main import app

    res = CliRunner().invoke(app, ["plan", str(SD3_NFT)])
    assert res.exit_code == 0, res.output
    assert "slow copy" in res.output and "rollout -> trainer: 1.946 MB per sample" in res.output


@pytest.mark.slow  # (a fleet search: 16-50 s here; bench bubbles' NFT rows run in tests/sim)
def test_plan_fleet_splits_the_mixed_fleet(tmp_path: Path) -> None:
    """`digenrl plan configs/sd3_nft.toml --fleet 8xH800+16xL40S` (16 s here, 50 s with the cores shared)."""
    import json

    from typer.testing import CliRunner

    from digenrl_cli.main import app

    out = tmp_path / "fleet.json"
    res = CliRunner().invoke(app, ["plan", str(SD3_NFT), "--fleet", "8xH800+16xL40S", "--batches", "3", "--json",
                                   str(out)])
    assert res.exit_code == 0, res.output
    best = json.loads(out.read_text())["candidates"][0]
    # the cheap GPUs sample; an NFT batch's training is ~5x its rollout, so the H800s (and some L40S) train
    assert set(best["rollout"]) == {"L40S"} and best["trainer"].get("H800") == 8
