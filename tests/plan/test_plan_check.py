"""`bench bubbles --real --plan-check`: the planner's placements run for real and the verdict read off them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.sim.measured import AllReduce, MeasuredCost
from digenrl_cli.main import app
from digenrl_cli.plan_check import candidate_overrides, run_plan_check, sign_test_p


def test_plan_check_runs_every_split_and_reads_the_verdict_off_the_measurements(tmp_path: Path) -> None:
    fits = {"rollout": (0.002, 3e-4), "reward": (0.001, 9e-4), "train": (0.002, 9e-4), "optim": (0.005, 0.0),
            "publish": (0.003, 0.0)}
    report = tmp_path / "bubbles.json"
    report.write_text(json.dumps({"calibration": {**MeasuredCost(fits, 0.001, AllReduce(1e5, 2e8, 5e-5))
                                                  .to_calibration(), "plan_error": 0.05,
                                                  "placement_error": 0.02}}))
    small = ["rollout.prompts_per_batch=4", "schedule.fragment_groups=2", "schedule.train_pack=16"]
    out = tmp_path / "check"
    check = run_plan_check(overrides=small, num_batches=2, repeats=1, top=1, out=out, costs=report)
    rows = check["candidates"]
    # the planner's first choice first, the shipped placement and both splits of 2 devices among those run
    assert rows[0]["split"] == check["plan"]["candidates"][0]["split"]
    assert any(r["shipped"] for r in rows)
    assert {r["split"] for r in rows} == {"rollout 1xmeasured / trainer 1xmeasured", "rollout 0 / trainer 2xmeasured",
                                          "colocated-tsp 2xmeasured (each samples, trains)"}  # and no split
    assert check["tolerance"] == 0.02  # the error on the ratio of two splits, what the planner compares
    measured = [r["measured_samples_per_s"] for r in rows]
    assert all(m > 0 for m in measured) and all(len(r["samples_per_s_runs"]) == 1 for r in rows)
    best = measured.index(max(measured))
    assert check["measured_best"] == best and check["agrees_exactly"] == (best == 0)
    assert check["agrees"] == (rows[best]["split"] == rows[0]["split"])
    assert check["first_vs_best"] == measured[0] / measured[best]
    assert json.loads((out / "plan-check.json").read_text())["agrees"] == check["agrees"]
    # one round can never separate two placements: at most 1 of 1 wins, p = 0.5
    assert check["best_wins_rounds"] == int(best != 0) and not check["separated"]


def test_sign_test_counts_every_outcome_of_the_rounds() -> None:
    """By enumeration of all 2^n win/lose sequences: 3 rounds cannot separate two placements (3 of 3:
    p = 1/8); 7 of 7 can (1/128), 6 of 7 cannot (8/128)."""
    from itertools import product

    for n in range(1, 9):
        for wins in range(n + 1):
            tail = sum(sum(seq) >= wins for seq in product((0, 1), repeat=n)) / 2 ** n
            assert sign_test_p(wins, n) == pytest.approx(tail, rel=1e-12)
    assert sign_test_p(3, 3) == 0.125 and sign_test_p(7, 7) < 0.05 < sign_test_p(6, 7)


def test_candidate_overrides_are_what_plan_write_sets() -> None:
    from digenrl.plan.fleet import Candidate

    cand = Candidate({}, {"measured": 2}, tag_steps=1, fragment_groups=8, rows_per_pass=64)
    assert candidate_overrides(cand) == ["placement.rollout=0", "placement.trainer=2", "schedule.tag_steps=1",
                                         "schedule.fragment_groups=8", "train.rows_per_pass=64"]


def test_plan_check_needs_real_and_refuses_an_old_costs_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "bubbles", "--plan-check"])
    assert result.exit_code == 2 and "--real" in result.output
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"calibration": {"measured_costs": {"rollout": {"overhead_s": 0, "per_unit_s": 1e-3}}}}))
    result = CliRunner().invoke(app, ["bench", "bubbles", "--real", "--plan-check", "--costs", str(old)])
    assert result.exit_code == 2 and "costs_version" in result.output
