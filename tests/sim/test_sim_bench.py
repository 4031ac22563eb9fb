"""`digenrl bench bubbles` writes bubbles.json, Chrome traces and Gantt PNGs with the documented schema."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from digenrl_cli.main import app


def test_bench_bubbles_writes_the_three_artefacts(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "bubbles", "--scenario", "qwen-16", "--schedule", "colocated",
                                      "--schedule", "async1", "--batches", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "async1" in result.output

    data = json.loads((out / "bubbles.json").read_text())
    assert [r["schedule"] for r in data["rows"]] == ["colocated", "async1"]
    for row in data["rows"]:
        for key in ("scenario", "model", "devices", "schedule", "samples_per_s", "speedup_vs_colocated",
                    "bubble_ratio", "max_staleness", "weight_sync_share"):
            assert key in row, key
        assert set(row["bubble_ratio"]) == {"rollout", "trainer", "overall"}
        assert all(0.0 <= v <= 1.0 for v in row["bubble_ratio"].values())
        assert row["scenario"] == "qwen-16" and row["devices"] == 16 and row["samples_per_s"] > 0
    assert data["rows"][0]["speedup_vs_colocated"] == 1.0
    assert data["rows"][1]["max_staleness"] == 1

    png = (out / "gantt-qwen-16.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    for sched in ("colocated", "async1"):
        trace = json.loads((out / f"trace-qwen-16-{sched}.json").read_text())
        events = trace["traceEvents"]
        complete = [e for e in events if e["ph"] == "X"]
        assert complete, "no complete events"
        for e in complete:
            assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {e["tid"] for e in complete} <= named
        assert len(named) == 16


def test_bench_lists_and_rejects_unknown_names() -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["bench", "bubbles", "--list"])
    assert listed.exit_code == 0 and "hetero-flux" in listed.output and "scale-1024" in listed.output
    bad = runner.invoke(app, ["bench", "bubbles", "--scenario", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
