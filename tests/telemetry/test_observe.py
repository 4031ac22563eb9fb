"""The metrics log on resume and the live table of the disaggregated recipe."""

from __future__ import annotations

import json
from pathlib import Path

from digenrl.telemetry.live import LiveDisplay
from digenrl.telemetry.metrics import MetricsLog


def test_metrics_log_rewrites_history_on_resume_and_live_table_renders(tmp_path: Path) -> None:
    old = [{"step": 0, "reward_mean": 0.5}]
    log = MetricsLog(tmp_path, history=old)
    m = {"step": 1, "reward_mean": 0.6, "reward_std": 0.1, "samples_per_s": 20.0, "max_staleness": 1,
         "bubble_ratio": {"rollout-0": 0.1, "trainer-0": 0.2, "overall": 0.15}, "seconds": 1.6}
    log.write(m)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    live = LiveDisplay(3, "test")
    live.update(m)
    table = live._render()
    assert [c.header for c in table.columns][-4:] == ["bubble overall", "bubble rollout-0", "bubble trainer-0", "s"]
    assert table.row_count == 1
