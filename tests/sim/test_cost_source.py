"""Every simulated output names what priced it: the fitted veRL-Omni utilisations on a model profile by default,
or a `bench bubbles --real` report given with --costs, which then sets the predicted rate (and is refused for
device types it did not measure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.errors import ConfigError
from digenrl.sim.bench import run_bubbles
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.measured import AllReduce, MeasuredCost
from digenrl_cli.main import app

PER_UNIT = {"rollout": 0.01, "reward": 0.02, "train": 0.03}  # seconds per sample-step, sample, transition
PROMPTS, G, STEPS, TRAINED = 4, 4, 4, 2


def _report(path: Path, scale: float = 1.0, testbed: str = "measured") -> Path:
    """A `bench bubbles --real` report whose costs are per-unit only (no overheads), times ``scale``."""
    fits = {k: (0.0, v * scale) for k, v in PER_UNIT.items()} | {"optim": (0.0, 0.0), "publish": (0.0, 0.0),
                                                                   "switch": (0.0, 0.0)}
    cost = MeasuredCost(fits, 0.0, AllReduce(0.0, 1.0, 0.0))
    path.write_text(json.dumps({"rows": [{"scenario": "real-colocated", "testbed": testbed, "model": "qwenimage-tiny"}],
                                "calibration": cost.to_calibration()}))
    return path


def _scenario(path: Path, pools: str) -> Path:
    path.write_text(f'model = "qwen-image"\nprompts = {PROMPTS}\ngroup_size = {G}\nnum_steps = {STEPS}\n'
                    f"trained_steps = {TRAINED}\n{pools}")
    return path


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_table_and_json_name_the_fitted_utilisations_and_the_profile(tmp_path: Path) -> None:
    p = calibrated_params()
    fitted = f"fitted veRL-Omni utilisations (rollout MFU {p.mfu_rollout:.3f}, train {p.mfu_train:.3f})"
    assert fitted == "fitted veRL-Omni utilisations (rollout MFU 0.379, train 0.162)"  # SYSTEMS.md §9
    res = CliRunner().invoke(app, ["bench", "bubbles", "--scenario", "qwen-16", "--schedule", "async1", "--batches",
                                   "3", "--no-decomposition", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert f"costs qwen-16: {fitted} on the Qwen-Image-20B profile (512x512, 64 text tokens" in _flat(res.output)
    data = json.loads((tmp_path / "bubbles.json").read_text())
    assert data["cost_source"] == fitted
    (row,) = data["rows"]
    assert row["cost_source"].startswith(f"{fitted} on the Qwen-Image-20B profile") and row["variant"] == "20B"


def test_measured_costs_set_the_rate_and_doubling_them_halves_it(tmp_path: Path) -> None:
    """Two `measured` devices, colocated, costs per unit only: each device runs its share of every token in turn,
    so by hand samples/s = 2 / (steps x rollout + reward + trained x train) seconds per sample = 16.67; a file with
    every per-unit cost doubled halves it. The fitted profile would give another rate (a 20B model on a CPU)."""
    file = _scenario(tmp_path / "cpu.toml", '[[pools]]\ndevice = "measured"\ncount = 2\n')
    per_sample = STEPS * PER_UNIT["rollout"] + PER_UNIT["reward"] + TRAINED * PER_UNIT["train"]
    rates = {}
    for scale in (1.0, 2.0):
        costs = _report(tmp_path / f"costs-{scale:g}.json", scale)
        out = tmp_path / f"out-{scale:g}"
        res = CliRunner().invoke(app, ["bench", "bubbles", "--scenario", str(file), "--schedule", "colocated",
                                       "--batches", "4", "--costs", str(costs), "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert f"costs cpu: measured: {costs}" in _flat(res.output)
        data = json.loads((out / "bubbles.json").read_text())
        (row,) = data["rows"]
        assert data["cost_source"] == row["cost_source"] == (
            f"measured: {costs} (`bench bubbles --real` token costs, qwenimage-tiny's tokens on measured devices)")
        rates[scale] = row["samples_per_s"]
    # within the floors no file scales: 0.1 ms per phase switch and optimizer step
    assert rates[1.0] == pytest.approx(2 / per_sample, rel=1e-3)
    assert rates[2.0] == pytest.approx(rates[1.0] / 2, rel=1e-3)
    fitted = run_bubbles([str(file)], ["colocated"], 4, decomposition=False).rows[0]
    assert fitted["cost_source"].startswith("fitted") and fitted["samples_per_s"] != pytest.approx(rates[1.0], rel=0.5)


def test_measured_costs_price_only_the_device_type_they_measured(tmp_path: Path) -> None:
    measured = MeasuredCost.from_report(_report(tmp_path / "costs.json"))
    assert measured.device == "measured" and measured.model == "qwenimage-tiny"
    with pytest.raises(ConfigError, match=r"costs measured on measured devices .* do not price H800: simulate "
                                          r"scenario qwen-16 \(16xH800\) with the fitted utilisations"):
        run_bubbles(["qwen-16"], ["async1"], 3, measured=measured)
    mixed = _scenario(tmp_path / "mixed.toml", '[[pools]]\ndevice = "measured"\ncount = 1\n'
                                               '[[pools]]\ndevice = "L40S"\ncount = 1\n')
    with pytest.raises(ConfigError, match=r"price a fleet of one device type; scenario mixed .* mixes L40S, measured"):
        run_bubbles([str(mixed)], ["async1"], 3, measured=measured)
    # a report whose rows name no device type still prices one type only
    unnamed = MeasuredCost.from_report(_report(tmp_path / "unnamed.json", testbed="2xH800+1xL40S"))
    assert unnamed.device == ""
    with pytest.raises(ConfigError, match="measured on one device type price a fleet of one device type"):
        run_bubbles([str(mixed)], ["async1"], 3, measured=unnamed)
    with pytest.raises(ConfigError, match="a peer is modelled as changes to the fitted cost model"):
        run_bubbles([str(mixed)], ["unirl"], 3, measured=measured)
    with pytest.raises(ConfigError, match="name the scenarios"):
        run_bubbles(None, ["async1"], 3, measured=measured)
    res = CliRunner().invoke(app, ["bench", "bubbles", "--real", "--costs", str(tmp_path / "costs.json")])
    assert res.exit_code == 2 and "a real run measures its own costs" in res.output


def test_plan_fleet_refuses_costs_of_another_device_type(tmp_path: Path) -> None:
    from digenrl.config import load_config
    from digenrl.plan.fleet import plan_fleet
    from digenrl.sim.user import fleet_pools

    measured = MeasuredCost.from_report(_report(tmp_path / "costs.json"))
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml")
    with pytest.raises(ConfigError, match=r"do not price H100: simulate the fleet 2xH100"):
        plan_fleet(cfg, fleet_pools("2xH100"), batches=3, measured=measured)
