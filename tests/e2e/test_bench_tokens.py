"""`digenrl bench tokens`: the tiny config's tokens measured here, with small sweep caps; its costs file is
what `digenrl plan --fleet 2xmeasured --costs` plans with, and its FLOPs, MFU and ratios check against an
independent computation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.recipes.bench_tokens import catalog_allreduce, fit_line
from digenrl.sim.cost import TRAIN_PASSES
from digenrl.sim.measured import MeasuredCost
from digenrl_cli.main import app
from tests.conftest import gpu_test

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
CAPS = ["--max-batch", "4", "--max-rows", "2", "--repeats", "2"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("tokens") / "tokens.json"
    res = CliRunner().invoke(app, ["bench", "tokens", str(CONFIG), *CAPS, "--json", str(out)])
    assert res.exit_code == 0, res.output
    return out, json.loads(out.read_text()), res.output


def _rows(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [m for m in report["rows"] if m["kind"] == kind]


def test_prints_the_table_and_measures_every_token(bench: tuple[Path, dict[str, Any], str]) -> None:
    out, report, output = bench
    assert "digenrl bench tokens" in output and "MFU" in output and "rollout step" in output
    assert f"--fleet 2xmeasured --costs {out}" in output.replace("\n", "")
    assert [m["size"] for m in _rows(report, "rollout step")] == [1, 2, 4]
    assert [m["size"] for m in _rows(report, "train pass")] == [1, 2]
    assert [m["size"] for m in _rows(report, "decode")] == [1, 2, 4]
    for kind in ("rollout start", "stale-batch parity", "reward score", "optimizer step", "publication (zmq)",
                 "weight load (rollout)", "all-reduce (2 trainers)"):
        assert _rows(report, kind), kind
    assert all(m["seconds"] > 0 for m in report["rows"])
    assert set(_rows(report, "publication (zmq)")[0]["parts"]) == {"pack", "send_receive", "stage"}


def test_the_costs_file_is_what_plan_reads(bench: tuple[Path, dict[str, Any], str], tmp_path: Path) -> None:
    out, report, _ = bench
    cal = report["calibration"]
    cost = MeasuredCost.from_report(out)
    step = fit_line([(m["size"], m["seconds"]) for m in _rows(report, "rollout step")])
    assert cost.step_s == pytest.approx(step[0]) and cost.fits["rollout"][1] == pytest.approx(step[1])
    assert cost.fits["optim"][0] == pytest.approx(_rows(report, "optimizer step")[0]["seconds"])
    assert cost.fits["publish"][0] == pytest.approx(_rows(report, "publication (zmq)")[0]["seconds"])
    # what one process cannot measure is said, with what the planner falls back to
    assert cost.dispatch_s == 0.0 and cost.contention is None
    assert {"dispatch_s", "contention", "placement_error"} <= set(cal["not_measured"])
    assert cal["allreduce"]["source"].startswith("measured: 2 gloo processes")
    assert cost.allreduce.seconds(2) == pytest.approx(_rows(report, "all-reduce (2 trainers)")[0]["seconds"])

    plan = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(CONFIG), "--fleet", "2xmeasured", "--costs", str(out), "--batches", "3",
                                   "--json", str(plan)])
    assert res.exit_code == 0, res.output
    notes = json.loads(plan.read_text())["notes"]
    assert any(n.startswith("measured costs: from `digenrl bench tokens`") for n in notes)
    assert any("not measured: dispatch_s" in n for n in notes)
    assert any(f"optimizer step {cost.fits['optim'][0] * 1e3:.1f} ms" in n for n in notes)  # priced with them


def test_flops_mfu_and_ratios_against_an_independent_count(bench: tuple[Path, dict[str, Any], str]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.models import repeat_cond
    from digenrl.models.lora import sampling
    from digenrl.policy import build_model

    _, report, _ = bench
    model, _ = build_model(load_config(CONFIG))
    x = model.prepare_latents(4)
    cond = repeat_cond(model.encode_prompts(["a red circle on a blue background"]), 4)
    with sampling(model), torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.velocity(x, model.sigmas(3)[:1].expand(4), cond)
    step = _rows(report, "rollout step")[-1]
    assert step["size"] == 4 and step["flops"] == counter.get_total_flops() == step["flops_counted"]
    assert step["flops_source"].startswith("simulator")
    peak = report["peak"]["flops_per_s"]
    for m in report["rows"]:
        if m["flops"]:
            assert m["mfu"] == pytest.approx(m["flops"] / (m["seconds"] * peak))
        if m["predicted_s"]:
            assert m["ratio"] == pytest.approx(m["seconds"] / m["predicted_s"])
    # a train row as the cost model charges it: TRAIN_PASSES (4) forwards of one sample's velocity, plus the KL
    # reference's forward (tiny-qwenimage.toml: train.kl_beta = 0.1), counted on the trainer's pass
    train = _rows(report, "train pass")[0]
    assert report["per_sample"]["nograd_forwards_per_row"] == 1.0
    assert train["size"] == 1 and train["flops"] == (TRAIN_PASSES + 1) * step["flops"] / step["size"]
    assert report["peak"]["source"].startswith("measured here: float32 matmul")


def test_fit_line_and_the_allreduce_fallback() -> None:
    assert fit_line([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0, 0.0), abs=1e-12)
    a, b, _ = fit_line([(1, 1.0), (2, 1.5), (4, 4.5)])  # least squares would cut the axis below 0
    assert a >= 0 and b > 0
    assert fit_line([(1, 2.0), (4, 1.0)])[1] == 0.0  # no growth: a constant
    ar, why = catalog_allreduce(64e6, "H100", "--no-allreduce")
    assert ar.bytes_per_s == 450e9 and why.startswith("--no-allreduce: charged as the simulator's ring")


@gpu_test()
def test_bench_tokens_on_cuda(tmp_path: Path) -> None:
    """The CUDA paths (synchronisation, the catalog peak, the all-reduce fallback); never run on a GPU yet."""
    out = tmp_path / "tokens.json"
    res = CliRunner().invoke(app, ["bench", "tokens", str(CONFIG), "--set", "model.device=cuda", *CAPS, "--json",
                                   str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["prediction"]["catalog_device"] in ("H100", "H200", "H800", "A100", "L40S", "RTX4090")
    assert all(m["mfu"] is not None for m in report["rows"] if m["flops"])
    assert report["calibration"]["allreduce"]["source"].startswith("on a GPU the trainers' NCCL all-reduce")
    MeasuredCost.from_report(out)


def test_bench_tokens_on_a_forward_process_config(tmp_path: Path) -> None:
    """`--set train.algorithm=nft`: the rollout step is the ODE's, a train row runs fwd + bwd and the two no-grad
    forwards DiffusionNFT's loss needs (old policy, reference; counted on the trainer's pass), and the report gives
    one sample's cost on each side and their ratio."""
    from digenrl.policy import trained_steps

    out = tmp_path / "nft.json"
    res = CliRunner().invoke(app, ["bench", "tokens", str(CONFIG), "--set", 'train.algorithm="nft"', "--max-batch", "2",
                                   "--max-rows", "4", "--repeats", "1", "--no-allreduce", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["model"]["algorithm"] == "nft" and "trainer:rollout" in res.output
    step = _rows(report, "rollout step")[-1]
    assert step["note"].endswith("ODE step (dpm2)")
    per = report["per_sample"]
    rows = trained_steps(load_config(CONFIG, ['train.algorithm="nft"']))  # floor(0.99 x 3) = 2 noise levels
    assert (per["rows"], per["nograd_forwards_per_row"], per["num_steps"]) == (rows, 2.0, 3)
    for train in _rows(report, "train pass"):
        assert train["flops"] == train["size"] * (TRAIN_PASSES + 2) * step["flops"] / step["size"]
        assert "2 no-grad forward(s) a row" in train["note"]
    cost = MeasuredCost.from_report(out)
    assert per["train_s"] == pytest.approx(rows * cost.fits["train"][1])
    assert per["rollout_s"] == pytest.approx(3 * cost.fits["rollout"][1])
    assert per["passes"]["train_to_rollout"] == pytest.approx(rows * (TRAIN_PASSES + 2) / 3)
    if per["rollout_s"]:
        assert per["train_to_rollout"] == pytest.approx(per["train_s"] / per["rollout_s"])
