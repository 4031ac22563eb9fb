"""The colocated loop as a full run: an actor run's outputs, its checkpoints, exact resume, its live table."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.recipes.colocated import train

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
SMALL = ["schedule.name=colocated", "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.num_steps=3",
         "placement.threads=1"]
TIMING = {"time", "seconds", "samples_per_s", "bubble_ratio", "t_rollout", "t_decode", "t_reward", "t_train"}


def _numbers(history: list[dict]) -> list[dict]:
    """A run's metrics without the clock's."""
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


def test_colocated_run_writes_an_actor_runs_outputs_and_live_table(tmp_path: Path) -> None:
    from digenrl_cli.main import app

    out = tmp_path / "run"
    args = ["run", str(TINY), "--out", str(out), *(a for kv in SMALL for a in ("--set", kv)),
            "--set", "train.iterations=2", "--set", "log.image_every=1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert {p.name for p in out.iterdir()} >= {"config.json", "metrics.jsonl", "samples", "checkpoints", "trace.json",
                                               "gantt.png", "summary.json", "trainable.safetensors"}
    assert load_state(find_checkpoint(out))["version"] == 2
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["name"].split()[0] for e in spans} == {"rollout", "reward", "train", "optim"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_scored"] == 2 * 4 and summary["max_staleness"] == 0
    assert summary["peak_memory"]["colocated"]["device"] == "cpu" and summary["peak_memory"]["colocated"]["rss"] > 1e8
    # Not a terminal: a plain line per step, as the actor runs print (their live table on a terminal)
    for line in ("step 1/2 reward ", "step 2/2 reward "):
        assert line in res.output, res.output
    for column in ("samples/s", "staleness", "parity 1.000000", "max |dlogp|", "bubbles overall"):
        assert column in res.output, column


def test_colocated_resume_logs_the_metrics_of_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = train(load_config(TINY, [*SMALL, "train.iterations=3"]), out_dir=tmp_path / "whole")
    train(load_config(TINY, [*SMALL, "train.iterations=2"]), out_dir=tmp_path / "cut")
    resumed = train(load_config(TINY, [*SMALL, "train.iterations=3"]), out_dir=tmp_path / "cut",
                    resume=tmp_path / "cut")
    assert [m["step"] for m in resumed] == [0, 1, 2]
    assert _numbers(resumed) == _numbers(whole)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(lines) == _numbers(whole)  # every step once, in order
    a, b = load_file(str(tmp_path / "whole" / "trainable.safetensors")), load_file(str(tmp_path / "cut" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_shows_every_step_in_its_table(tmp_path: Path) -> None:
    """The live table of a resumed run lists the steps done before it (and a finished run's, its steps); outside a
    terminal (here) its lines start where it does, and a finished run prints its steps' lines."""
    from digenrl_cli.main import app
    from digenrl.telemetry.live import LiveDisplay

    base = ["run", str(TINY), *(a for kv in SMALL for a in ("--set", kv)), "--set", "log.image_every=0"]
    assert CliRunner().invoke(app, [*base, "--out", str(tmp_path), "--set", "train.iterations=1"]).exit_code == 0
    res = CliRunner().invoke(app, [*base, "--resume", str(tmp_path), "--set", "train.iterations=2"])
    assert res.exit_code == 0, res.output
    assert f"resuming {tmp_path}; outputs in {tmp_path}" in res.output.replace("\n", "")
    assert [line.split()[1] for line in res.output.splitlines() if line.startswith("step ")] == ["2/2"]
    again = CliRunner().invoke(app, [*base, "--resume", str(tmp_path), "--set", "train.iterations=2"])
    assert [line.split()[1] for line in again.output.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    table = LiveDisplay(3, "resumed", history[:1], interactive=True)
    table.update(history[1])
    assert [str(c) for c in table._render().columns[0].cells] == ["0", "1"]
