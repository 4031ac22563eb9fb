"""The tiny random-preset config the algorithm tests run under every schedule, and one call that runs either path."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import Config, config_from_dict
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated

SCHEDULES = ["colocated", "disaggregated", "gap", "tsp", "tag", "async1"]


def every_schedule() -> list:
    """SCHEDULES for parametrize: colocated and async1 in every run, the others with the slow tests (the suite's
    time budget; the schedules themselves are tested apart from any algorithm)."""
    return [s if s in ("colocated", "async1") else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES]


def tiny_config(algorithm: str, schedule: str, **tables: dict) -> Config:
    """Tiny Qwen-Image at 32 px, 4 steps, 2 prompts x 2, 2 iterations, inproc actors; ``tables`` update it."""
    data: dict[str, dict] = {
        "model": {"name": "qwenimage", "preset": "tiny", "resolution": [32, 32], "text_len": 32},
        "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 2},
        "train": {"algorithm": algorithm, "iterations": 2, "lr": 1e-3},
        "log": {"image_every": 0, "checkpoint_every": 0},
        "schedule": {"name": schedule},
        "transport": {"actors": "inproc"},
    }
    for name, table in tables.items():
        data[name] = {**data.get(name, {}), **table}
    return config_from_dict(data)


async def run_schedule(cfg: Config, out: Path | None = None, **kw: object) -> list[dict]:
    """The run's metrics: the colocated loop or the actor run, as ``cfg.schedule.name`` says."""
    if cfg.schedule.name == "colocated":
        return train(cfg, out_dir=out, write_files=out is not None, **kw)  # type: ignore[arg-type]
    return await arun_disaggregated(cfg, out, write_files=out is not None, **kw)  # type: ignore[arg-type]
