"""New model families trained end to end: tiny presets, every schedule, inproc actors (2 iterations each)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from digenrl.config import Config, config_from_dict
from digenrl.data.images import source_pixels
from digenrl.data.prompts import load_prompts, split_prompt
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.rewards.edit import EditConsistencyReward

SCHEDULES = ["colocated", "disaggregated", "gap", "tsp", "tag", "async1"]


async def _run(cfg: Config) -> list[dict]:
    if cfg.schedule.name == "colocated":
        return train(cfg, write_files=False)
    return await arun_disaggregated(cfg, write_files=False)


# -- wan22: Wan2.2 A14B's two experts under every schedule -------------------------------------------------

def _wan22_cfg(schedule: str) -> Config:
    # 4 steps (sigmas 1, .90, .75, .50 with flow_shift 3): steps 0-1 are the high-noise expert's (>= 0.875),
    # steps 2-3 the low-noise expert's; all_but_last trains 0..2, so every sample trains rows of both.
    return config_from_dict({
        "model": {"name": "wan22", "preset": "tiny", "resolution": [32, 32], "text_len": 8},
        "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 1},
        "train": {"iterations": 2},
        "log": {"image_every": 0, "checkpoint_every": 0},
        "schedule": {"name": schedule},
        "transport": {"actors": "inproc"},
    })


@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_wan22_trains_both_experts_under_every_schedule(schedule: str) -> None:
    cfg = _wan22_cfg(schedule)
    history = await _run(cfg)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert math.isfinite(m["policy_loss"]) and math.isfinite(m["grad_norm"])
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
    high = sum(m.get("rows_by_expert/high", 0) for m in history)
    low = sum(m.get("rows_by_expert/low", 0) for m in history)
    assert high > 0 and low > 0  # the trained rows came from both experts
    assert high + low == sum(m["rows_kept"] for m in history)  # every trained row ran exactly one expert


# -- sd3: Stable Diffusion 3.5 (tiny MMDiT-X, three text encoders, true CFG) under every schedule -------------

def _sd3_cfg(schedule: str) -> Config:
    return config_from_dict({
        "model": {"name": "sd3", "preset": "tiny", "resolution": [32, 32], "text_len": 8, "guidance_scale": 4.5},
        "rollout": {"num_steps": 2, "window": 1, "group_size": 2, "prompts_per_batch": 1},
        "train": {"iterations": 2},
        "log": {"image_every": 0, "checkpoint_every": 0},
        "schedule": {"name": schedule},
        "transport": {"actors": "inproc"},
    })


@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_sd3_trains_under_every_schedule(schedule: str) -> None:
    cfg = _sd3_cfg(schedule)
    history = await _run(cfg)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["rows_trained"] == 2  # 1 prompt x 2 samples x 1 trained step (all_but_last of 2)
        assert math.isfinite(m["reward_mean"]) and math.isfinite(m["policy_loss"]) and math.isfinite(m["grad_norm"])
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
    # the rollout actors and the trainers built the same tiny weights: their log-probs agree before the update
    if history[0].get("parity_rows"):
        assert history[0]["parity_logp_diff_max"] < 1e-3


# -- qwenimage_edit: Qwen-Image-Edit (prompt + input image) under every schedule, scored against the input -------

def _edit_cfg(schedule: str, reward_actors: int = 0) -> Config:
    prompts = Path(__file__).resolve().parents[2] / "examples" / "edit" / "prompts.jsonl"
    return config_from_dict({
        "model": {"name": "qwenimage_edit", "preset": "tiny", "resolution": [32, 32]},
        "rollout": {"num_steps": 2, "window": 1, "group_size": 2, "prompts_per_batch": 1},
        "train": {"iterations": 2},
        "reward": {"weights": {"edit_consistency": 1.0}},
        "data": {"prompt_file": str(prompts)},
        "log": {"image_every": 0, "checkpoint_every": 0},
        "schedule": {"name": schedule},
        "placement": {"reward": reward_actors},
        "transport": {"actors": "inproc"},
    })


@pytest.mark.parametrize("schedule", [*SCHEDULES, "async1+reward"])
async def test_qwenimage_edit_trains_with_an_edit_reward_under_every_schedule(schedule: str, monkeypatch) -> None:
    """The reward sees each sample's instruction text (never the prompt record) and its input image at the output's
    size; inproc actors score in this process, so the calls are recorded here. ``async1+reward``: a RewardActor
    scores instead of the rollout actors."""
    calls: list[tuple[list[str], torch.Tensor]] = []
    score = EditConsistencyReward.score

    def recording(self, images, prompts, sources=None):  # type: ignore[no-untyped-def]
        calls.append((list(prompts), sources))
        return score(self, images, prompts, sources=sources)

    monkeypatch.setattr(EditConsistencyReward, "score", recording)
    schedule, _, actor = schedule.partition("+")
    cfg = _edit_cfg(schedule, reward_actors=1 if actor else 0)
    history = await _run(cfg)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["rows_trained"] == 2  # 1 prompt x 2 samples x 1 trained step
        assert math.isfinite(m["reward_mean"]) and math.isfinite(m["policy_loss"]) and math.isfinite(m["grad_norm"])
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["reward_failures"] == 0
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
    assert calls and sum(len(p) for p, _ in calls) == 4  # 2 iterations x 2 samples
    records = {split_prompt(p)[0]: p for p in load_prompts(prompt_file=cfg.data.prompt_file)}
    for prompts, sources in calls:
        assert all(p in records for p in prompts)  # the instruction, not the JSON record
        want = source_pixels([records[p] for p in prompts], 32, 32)
        assert sources is not None and torch.equal(sources, want)  # [n, 1, 3, 32, 32]: each sample's own input image
    if history[0].get("parity_rows"):
        assert history[0]["parity_logp_diff_max"] < 1e-3
