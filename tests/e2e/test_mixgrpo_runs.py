"""MixGRPO end to end: every schedule, the on-policy actors equal the colocated loop, resume, the config's refusals.

The tiny Qwen-Image (random preset) with inproc actors, 4 steps, a 1-step window moving every optimizer step (starts
0, 1, 0, ...) and Flash's tail after it; every sample trains its window's one transition.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from digenrl.config import Config, load_config
from digenrl.errors import ConfigError
from tests.e2e._tiny import every_schedule, run_schedule as _run, tiny_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"


def _cfg(schedule: str, flash: bool = True, **tables: dict) -> Config:
    train = {"check_parity": True, **tables.pop("train", {})}
    return tiny_config("mixgrpo", schedule, train=train, mixgrpo={"window": 1, "shift_every": 1, "flash": flash},
                       **tables)


@pytest.mark.parametrize("schedule", every_schedule())
async def test_every_schedule_trains_the_window_of_every_sample(schedule: str) -> None:
    history = await _run(_cfg(schedule))
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["rows_trained"] == 2 * 2  # prompts x group x one window step
        assert math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
        assert m["parity_rows"] > 0 and m["parity_logp_diff_max"] < 1e-4  # the rows the sampling version drew
    # after each step: the window the next version samples with, and its Flash forwards (1 + 1, then 2 + 1 of 4)
    assert [(m["algorithm/window_start"], m["algorithm/rollout_forwards"]) for m in history] == [(1, 3), (0, 2)]


@pytest.mark.parametrize("flash", [pytest.param(False, marks=pytest.mark.slow), True], ids=["mixgrpo", "flash"])
async def test_an_on_policy_actor_run_trains_what_the_colocated_loop_trains(flash: bool) -> None:
    """The window moves every step: an actor that planned it from anything but the sampling version would train
    other transitions than the colocated loop."""
    tables = {"rollout": {"prompts_per_batch": 4}, "train": {"iterations": 3}}
    colocated = await _run(_cfg("colocated", flash, **tables))
    actors = await _run(_cfg("disaggregated", flash, **tables))
    keys = ("reward_mean", "reward_std", "policy_loss", "grad_norm", "adv_abs_mean")
    for a, b in zip(colocated, actors, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4, abs=1e-7)
    assert colocated[2]["reward_mean"] != colocated[0]["reward_mean"]


@pytest.mark.parametrize("schedule", ["colocated", pytest.param("async1", marks=pytest.mark.slow)])
async def test_resume_continues_the_window_where_it_was(tmp_path: Path, schedule: str) -> None:
    """The checkpoint's version decides the resumed run's windows: it equals an uninterrupted run."""
    ckpt = {"log": {"image_every": 0, "checkpoint_every": 1, "live": False}}
    whole = await _run(_cfg(schedule, train={"iterations": 3}, **ckpt), tmp_path / "whole")
    await _run(_cfg(schedule, train={"iterations": 2}, **ckpt), tmp_path / "cut")
    resumed = await _run(_cfg(schedule, train={"iterations": 3}, **ckpt), tmp_path / "cut", resume=tmp_path / "cut")
    keys = ("reward_mean", "policy_loss", "grad_norm", "algorithm/window_start", "max_staleness")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in whole]


def test_keys_that_mean_nothing_to_mixgrpo_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^rollout.window: means nothing to train.algorithm = 'mixgrpo'.*\[mixgrpo\]"):
        load_config(CONFIG, ["train.algorithm=mixgrpo", "rollout.window=2"])
    with pytest.raises(ConfigError, match=r"^rollout.solver: means nothing to train.algorithm = 'mixgrpo'"):
        load_config(CONFIG, ["train.algorithm=mixgrpo", 'rollout.solver="euler"'])
    with pytest.raises(ConfigError, match=r"^\[mixgrpo\]: means nothing to train.algorithm = 'flow_grpo'"):
        load_config(CONFIG, ["mixgrpo.window=2"])
    with pytest.raises(ConfigError, match=r"mixgrpo.window.*<= rollout.num_steps - 2 = 1"):
        load_config(CONFIG, ["train.algorithm=mixgrpo", "mixgrpo.window=2"])  # the tiny default's 3 steps
    with pytest.raises(ConfigError, match=r"mixgrpo.flash_ratio"):
        load_config(CONFIG, ["train.algorithm=mixgrpo", "mixgrpo.flash_ratio=0"])
    cfg = load_config(CONFIG, ["train.algorithm=mixgrpo"])  # the shipped Flow-GRPO window keys are ignored
    assert cfg.mixgrpo.sliding(cfg.rollout.num_steps).start(100) == 0  # 3 steps, W 1: one position
    shipped = load_config(CONFIG.parent / "flux_mixgrpo.toml")
    assert (shipped.train.algorithm, shipped.rollout.num_steps, shipped.mixgrpo.window,
            shipped.mixgrpo.shift_every) == ("mixgrpo", 25, 4, 25)
