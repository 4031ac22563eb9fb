"""Disaggregated settings (errors name the key), the metrics log on resume, and the live table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.errors import ConfigError
from digenrl.recipes.disagg_config import DisaggSettings, load_disagg_config, split_disagg
from digenrl.recipes.observe import LiveDisplay, MetricsLog

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-disagg.toml"


def test_settings_are_split_from_the_base_config() -> None:
    cfg, s = load_disagg_config(CONFIG, ["schedule.name=async1", "schedule.step_chunk=2", "placement.rollout=2"])
    assert (s.schedule, s.rollout, s.trainer, s.actors) == ("async1", 2, 1, "zmq")
    # The override replaces the config's step_chunk; the config's other token sizes stay.
    assert s.options == {"fragment_groups": 4, "step_chunk": 2, "train_pack": 80, "tag_steps": 3}
    assert cfg.rollout.group_size == 4 and s.disaggregated
    assert not load_disagg_config(CONFIG, ["schedule.name=colocated"])[1].disaggregated


@pytest.mark.parametrize(("override", "message"), [
    ("schedule.name=ring", "schedule.name: 'ring' is not allowed"),
    ("schedule.step_chunk=0", "schedule.step_chunk: must be a positive integer"),
    ("placement.trainer=0", "placement.trainer: must be an integer >= 1"),
    ("transport.weights=rdma", "transport.weights: 'rdma' is not allowed"),
    ("placement.rollout=true", "rollout: must be of type int"),
    ("train.lr=-1", "train.lr"),
    ("placement.workers=1", "placement.workers = 1: one actor per joined worker needs at least 2"),
    ("placement.workers=2", "needs transport.actors = 'zmq' and transport.address = 'tcp://"),
])
def test_bad_values_name_their_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_disagg_config(CONFIG, [override])


def test_rollout_free_placement_needs_tag() -> None:
    with pytest.raises(ConfigError, match="placement.rollout = 0 needs a schedule with TAG"):
        split_disagg({"schedule": {"name": "gap"}, "placement": {"rollout": 0}})
    assert DisaggSettings(schedule="tag", rollout=0).rollout == 0


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
