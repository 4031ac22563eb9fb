"""What the CLI prints through rich reaches the screen as written: rich reads ``[ray]`` or ``[lab]`` as a
style tag and drops it, so an install hint, a config value or a scenario name in brackets must survive."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from digenrl_cli.main import app

TINY = "configs/tiny-qwenimage.toml"


def _invoke(args: list[str]) -> Any:
    # wide enough that no table cell or message wraps in the middle of what a test looks for
    return CliRunner(env={"COLUMNS": "250"}).invoke(app, args)


def test_the_ray_install_hint_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: without Ray, `digenrl run --launcher ray` printed `pip install 'digenrl'` (rich ate `[ray]`)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the [ray] extra were not installed
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # the launcher sets it before importing ray
    result = _invoke(["run", TINY, "--launcher", "ray", "--out", str(tmp_path / "run")])
    assert result.exit_code in (1, 2), result.output  # refused by the checks before the run (2) or by the launcher (1)
    line = " ".join(result.output.split())
    assert "cluster.launcher = 'ray' needs Ray, which is not installed" in line
    assert "pip install 'digenrl[ray]'" in line and "pip install -e '.[ray]'" in line


def test_the_run_summary_prints_its_output_directory_as_written(tmp_path: Path) -> None:
    out = tmp_path / "[lab]"
    result = _invoke(["run", TINY, "--out", str(out), "--set", "schedule.name=colocated", "--set", "train.iterations=1",
                      "--set", "rollout.prompts_per_batch=2", "--set", "rollout.group_size=2",
                      "--set", "log.image_every=0"])
    assert result.exit_code == 0, result.output
    assert f"outputs in {out}" in " ".join(result.output.split())


@pytest.mark.parametrize("args, shown", [
    (["bench", "bubbles", "--scenario", "[lab]"], "error: unknown scenario '[lab]'"),
    (["bench", "bubbles", "--plan", "--scenario", "[lab]"], "error: unknown scenario '[lab]'"),
    (["bench", "bubbles", "--real", "--set", "schedule.name='[lab]'"], "error: schedule.name: '[lab]' is not allowed"),
    (["bench", "bubbles", "--real", "--plan-check", "--set", "schedule.name='[lab]'"],
     "error: schedule.name: '[lab]' is not allowed"),
    (["run", TINY, "--set", "schedule.name='[lab]'"], "config error: schedule.name: '[lab]' is not allowed"),
    (["validate", TINY, "--set", "schedule.name='[lab]'"], "config error: schedule.name: '[lab]' is not allowed"),
    (["plan", TINY, "--fleet", "[lab]"], "plan error: --fleet '[lab]'"),
])
def test_config_errors_print_bracketed_values_as_written(args: list[str], shown: str) -> None:
    result = _invoke(args)
    assert result.exit_code == 2, result.output
    assert shown in " ".join(result.output.split())


def test_a_scenario_name_in_brackets_survives_the_bench_tables(tmp_path: Path) -> None:
    scenario = tmp_path / "lab.toml"
    scenario.write_text('name = "[lab] flux"\nmodel = "flux"\nprompts = 8\ngroup_size = 4\nnum_steps = 4\n'
                        'trained_steps = 2\n\n[[pools]]\ndevice = "H800"\ncount = 4\n')
    result = _invoke(["bench", "bubbles", "--scenario", str(scenario), "--schedule", "async1", "--batches", "3",
                      "--out", str(tmp_path / "[out]")])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]  # the table and the decomposition
    assert len(rows) >= 2 and all(line.startswith("│ [lab] flux ") for line in rows), result.output
    assert f"wrote {tmp_path / '[out]'}" in " ".join(result.output.split())


def _plan_check_report() -> dict[str, Any]:
    """What `run_plan_check` returns, for two placements and two rounds (the measured best second)."""
    def row(rank: int, split: str, shipped: bool, predicted: float, runs: list[float]) -> dict[str, Any]:
        median = sum(runs) / len(runs)
        return {"planner_rank": rank, "split": split, "shipped": shipped, "tag_steps": 1, "fragment_groups": 2,
                "rows_per_pass": 16, "predicted_samples_per_s": predicted, "measured_samples_per_s": median,
                "samples_per_s_runs": runs, "sim_error": predicted / median - 1.0}
    candidates = [row(1, "rollout 1xmeasured / trainer 1xmeasured", True, 300.0, [290.0, 310.0]),
                  row(2, "rollout 0 / trainer 2xmeasured [lab]", False, 295.0, [302.0, 318.0])]
    return {"fleet": "2xmeasured", "tolerance": 0.018, "candidates": candidates, "measured_best": 1,
            "plan": {"notes": ["kept the shipped placement: set [placement] rollout to change it"]},
            "first_vs_best": 300.0 / 310.0, "agrees": False, "agrees_exactly": False, "separated": False,
            "best_wins_rounds": 2, "sign_test_p": 0.25}


def test_the_plan_check_table_names_its_units_and_prints_splits_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29 item 6: the column of each round's rate was called `runs`; it holds samples/s."""
    from digenrl_cli import plan_check

    monkeypatch.setattr(plan_check, "run_plan_check", lambda *args, **kwargs: _plan_check_report())
    result = _invoke(["bench", "bubbles", "--real", "--plan-check", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "rank" in line and "placement" in line)
    cells = [cell.strip() for cell in header.strip("┃ ").split("┃")]
    assert cells == ["rank", "placement", "tag_steps", "frag_groups", "predicted samples/s", "measured samples/s",
                     "samples/s per round", "sim error"]
    second = next(line for line in result.output.splitlines() if "trainer 2xmeasured" in line)
    assert "rollout 0 / trainer 2xmeasured [lab]" in second and "302 318" in second and "310.0 *" in second
    text = " ".join(result.output.split())
    assert "note: kept the shipped placement: set [placement] rollout to change it" in text
    assert "within noise: the best split measured is rollout 0 / trainer 2xmeasured [lab]" in text
