"""`plan --fleet` compares every split with colocated-tsp (the same devices, each sampling then training) and
proposes whichever the simulator says is faster; the simulator prices colocated-tsp as decompose's TSP link."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.plan.fleet import plan_fleet, scenario_config, write_config
from digenrl.sim.bench import run_bubbles, simulate_pair
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.decompose import decompose
from digenrl.sim.scenarios import scenario
from digenrl.sim.user import Pool
from digenrl.telemetry.stats import summarize

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _plan(name: str):
    sc = scenario(name)
    cfg = scenario_config(sc)
    return sc, cfg, plan_fleet(cfg, tuple(Pool(t, n) for t, n in sc.pools), top=3, batches=4, final_batches=8,
                               prof=sc.profile)


@pytest.mark.slow  # ~20 s here: a split search on 16 devices
def test_homogeneous_fleet_where_colocated_tsp_is_faster_stays_colocated(tmp_path: Path) -> None:
    sc, cfg, result = _plan("qwen-16")
    best = result.best
    assert best.schedule == "colocated-tsp" and best.trainer == {"H800": 16} and not best.rollout
    # the bench's own simulation of the scenario under colocated-tsp (scenarios.placement, its default sizes)
    bench = summarize(simulate_pair(sc, "colocated-tsp", 8)).steady.samples_per_s
    assert best.samples_per_s == pytest.approx(bench, rel=1e-9)
    splits = [c for c in result.candidates if c.schedule != "colocated-tsp"]
    assert splits and max(c.samples_per_s for c in splits) < best.samples_per_s
    (note,) = [n for n in result.notes if n.startswith("no split")]
    ratio = best.samples_per_s / splits[0].samples_per_s
    assert f"{ratio:.2f}x the best async1 placement ({splits[0].split}" in note
    assert f"{best.samples_per_s:.3f} samples/s" in note and f"{splits[0].samples_per_s:.3f} samples/s" in note
    written = write_config(CONFIGS / "qwenimage.toml", [], best, tmp_path / "coloc.toml")  # loads back: runnable
    assert (written.schedule.name, written.placement.rollout, written.placement.trainer) == ("colocated-tsp", 0, 16)


def test_heterogeneous_fleet_where_a_split_is_faster_splits() -> None:
    """SD3.5-M DiffusionNFT on 8 H800 + 4 L40S: the cheap GPUs generating beats every GPU sampling and training."""
    _, _, result = _plan("hetero-sd3-nft")
    best = result.best
    assert best.schedule == "" and best.rollout.get("L40S") == 4
    (hybrid,) = [c for c in result.candidates if c.schedule == "colocated-tsp"]
    assert hybrid.trainer == {"H800": 8, "L40S": 4} and hybrid.samples_per_s < best.samples_per_s
    (note,) = [n for n in result.notes if n.startswith("split:")]
    assert f"is predicted {best.samples_per_s / hybrid.samples_per_s:.2f}x colocated-tsp on 8xH800+4xL40S" in note


def test_colocated_tsp_is_decompose_tsp_link_and_within_the_packing_bound() -> None:
    """The bench rows of Flow-GRPO's loop with and without TSP packing, against decompose's own runs and the most
    packing can give (every device's training shortened by ``tsp_train_saving``, its rollout not)."""
    report = run_bubbles(["qwen-16"], ["colocated-flowgrpo", "colocated-tsp"], 6, decomposition=False)
    rows = {r["schedule"]: r for r in report.rows}
    assert rows["colocated-tsp"]["split"] == {"rollout": 0, "trainer": 0, "hybrid": 16}
    ratio = rows["colocated-tsp"]["samples_per_s"] / rows["colocated-flowgrpo"]["samples_per_s"]
    links = decompose(scenario("qwen-16"), 6)["colocated-flowgrpo"]["links"]
    (tsp,) = [link for link in links if link["cause"] == "timestep packing (TSP)"]
    assert tsp["run"] == "colocated-tsp" and tsp["factor"] == pytest.approx(ratio, rel=1e-12)
    assert 1.0 < ratio <= 1.0 / (1.0 - calibrated_params().tsp_train_saving)
