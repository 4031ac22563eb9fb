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
    # Parity columns: the mean ratio and max |dlog-prob| before the update, '-' when no row was measured.
    cells = {c.header: list(c.cells) for c in table.columns}
    assert cells["parity ratio"] == ["-"] and cells["max |Δlogp|"] == ["-"]
    live.update({**m, "step": 2, "parity_rows": 16, "parity_ratio": 1.0, "parity_ratio_dev_max": 1.2e-7,
                 "parity_logp_diff_max": 1.2e-7})
    cells = {c.header: list(c.cells) for c in live._render().columns}
    assert cells["parity ratio"][-1] == "1.000000" and cells["max |Δlogp|"][-1] == "1.2e-07"


def test_tensorboard_is_installed_and_gets_every_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 3, "reward_mean": 0.25, "bubble_ratio": {"overall": 0.5}, "schedule": "async1"})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["reward_mean"] == [(3, 0.25)]
    assert scalars["bubble_ratio/overall"] == [(3, 0.5)] and "schedule" not in scalars


def test_a_missing_tensorboard_is_a_warning_naming_the_key(tmp_path: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an environment without it sees
    with caplog.at_level(logging.WARNING, logger="digenrl.telemetry.metrics"):
        log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 0, "reward_mean": 0.0})
    log.close()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "log.tensorboard" in warned[0].getMessage()
    assert "pip install tensorboard" in warned[0].getMessage() and not (tmp_path / "tb").exists()
