"""Forward-process scenarios in the simulator: the cost model prices an algorithm from its numbers
(``profiles.RowCost``: no-grad forwards a row, latents a row and a sample, log-probs or none), and
`digenrl bench bubbles` lists and runs the DiffusionNFT scenarios beside the peers' colocated loops."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.sim.bench import DEFAULT_SCENARIOS, run_bubbles
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import TRAIN_PASSES, CostModel
from digenrl.sim.devices import device_spec
from digenrl.sim.profiles import TRAJECTORY_ROWS, clean_sample_rows, profile
from digenrl.sim.scenarios import SCENARIOS, scenario
from digenrl_cli.main import app

NFT = ("sd3-nft-8", "sd3-nft-16", "qwen-nft-16", "hetero-sd3-nft")


def _cost(prof, role: Role) -> tuple[CostModel, Device]:  # type: ignore[no-untyped-def]
    spec = device_spec("H800")
    return CostModel(prof, {"d": spec}, calibrated_params(), {"d": role}), Device("d", role)


def test_a_row_pays_its_no_grad_forwards_and_no_recompute_without_log_probs() -> None:
    base = profile("sd3")
    nft = replace(base, rows=clean_sample_rows(2))
    token = Token(0, TokenKind.TRAIN, "d", 0, num_samples=2, transitions=18)
    latency = calibrated_params().pass_latency_s

    def compute(prof, role: Role) -> float:  # type: ignore[no-untyped-def]
        cost, device = _cost(prof, role)
        return cost.seconds(token, device) - latency

    # a rollout-role device pays compute only: (4 + 2) / 4 of Flow-GRPO's rows
    assert compute(nft, Role.ROLLOUT) == pytest.approx(compute(base, Role.ROLLOUT) * (TRAIN_PASSES + 2) / TRAIN_PASSES)
    # a colocated device recomputes the old log-probs of rows that carry them, never of clean samples
    recompute = calibrated_params().old_logprob_passes
    assert compute(base, Role.HYBRID) == pytest.approx(compute(base, Role.ROLLOUT) * (TRAIN_PASSES + recompute)
                                                       / TRAIN_PASSES)
    assert compute(nft, Role.HYBRID) == pytest.approx(compute(nft, Role.ROLLOUT))
    # a dedicated trainer pulls each row's two latents (Flow-GRPO), or each sample's one (a clean sample)
    spec = device_spec("H800")
    pull = compute(nft, Role.TRAINER) - compute(nft, Role.ROLLOUT)
    assert pull == pytest.approx(2 * (base.latent_bytes + 12 + base.cond_bytes) / spec.net_bytes_per_s)
    pull = compute(base, Role.TRAINER) - compute(base, Role.ROLLOUT)
    assert pull == pytest.approx((18 * (2 * base.latent_bytes + 32) + 2 * (4 + base.cond_bytes)) / spec.net_bytes_per_s)


def test_the_nft_scenarios_carry_the_reference_recipes() -> None:
    sd3, qwen = scenario("sd3-nft-8"), scenario("qwen-nft-16")
    assert (sd3.prompts, sd3.group_size, sd3.num_steps, sd3.trained_steps, sd3.pools) == (48, 24, 10, 9, (("H800", 8),))
    assert (qwen.prompts, qwen.group_size, qwen.num_steps, qwen.trained_steps) == (24, 16, 10, 10)
    for name in NFT:
        prof = SCENARIOS[name].profile
        assert (prof.cfg_rollout, prof.cfg_train, prof.rows) == (1, 1, clean_sample_rows(2)), name
        assert name in DEFAULT_SCENARIOS
    assert scenario("hetero-sd3-nft").rollout_pool == "L40S"
    assert scenario("sd3-16").profile.rows == TRAJECTORY_ROWS and scenario("sd3-16").profile.cfg_rollout == 2
    # the SD3.5-M batch: rollout 10 forwards a sample, training 9 x (4 + 2): 5.4x the rollout's transformer passes
    cost, _ = _cost(sd3.profile, Role.HYBRID)
    w = sd3.workload(1)
    spec = device_spec("H800")
    roll, train = cost.batch_work(w.samples_per_batch, w.prompts_per_batch, w.num_steps, w.rows_per_batch, spec)
    f, p = sd3.profile.forward_flops, calibrated_params()
    per_row = (TRAIN_PASSES + 2) * f / (spec.peak_bf16_flops * p.mfu_train)
    assert train == pytest.approx(w.samples_per_batch * 9 * per_row)
    assert roll > w.samples_per_batch * 10 * f / (spec.peak_bf16_flops * p.mfu_rollout)  # + text, decode, reward


def test_bench_bubbles_lists_and_runs_the_nft_scenarios() -> None:
    listed = CliRunner().invoke(app, ["bench", "bubbles", "--list"])
    assert listed.exit_code == 0 and all(name in listed.output for name in NFT)
    report = run_bubbles(["sd3-nft-8"], ["colocated", "colocated-flowgrpo", "async1"], num_batches=3)
    rows = {r["schedule"]: r for r in report.rows}
    assert set(rows) == {"colocated", "colocated-flowgrpo", "async1"}
    sc = scenario("sd3-nft-8")
    for r in rows.values():
        assert r["kind"] == "forward" and r["samples_per_s"] > 0
        clean = sc.profile.latent_bytes + 12 + sc.profile.cond_bytes  # the latent, its index and reward, conditioning
        assert r["bytes_per_sample"] == sc.profile.boundary_bytes(9) == clean
    assert rows["colocated"]["split"]["hybrid"] == 8 and rows["async1"]["max_staleness"] <= 1
    assert "DiffusionNFT" in rows["async1"]["cost_source"]
