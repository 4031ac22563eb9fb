"""A reward device of its own (``placement.reward = 1``, issue 31): the reward actor scores while the rollout
actor generates. Read from the run's own ``trace.json``: every reward span is on the reward actor, and its
spans overlap the rollout actor's in time (a finished fragment is scored while the next one is generated)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.recipes.disaggregated import arun_disaggregated

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"


def _tiny_clip(tmp_path: Path) -> list[str]:
    """A tiny random CLIPModel with its processor, in the layout of openai/clip-vit-large-patch14."""
    from tests.rewards._learned_fixtures import tiny_clip_dir

    return [f"reward.models.clipscore.path='{tiny_clip_dir(tmp_path / 'clip')}'"]


# (reward, its [reward.models.<name>] overrides for a tiny local model directory made in tmp_path)
REWARDS = [
    pytest.param("shapes", lambda tmp_path: [], id="shapes"),
    pytest.param("clipscore", _tiny_clip, id="clipscore"),
]


def _spans(trace: dict) -> dict[str, list[tuple[str, float, float]]]:
    """``device -> [(kind, start s, end s)]`` of a Chrome trace written by ``write_trace``."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    out: dict[str, list[tuple[str, float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(names[(e["pid"], e["tid"])], []).append((e["cat"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    return out


@pytest.mark.parametrize(("reward", "models"), REWARDS)
def test_reward_actor_scores_while_the_rollout_actor_generates(tmp_path: Path, reward: str,
                                                              models: Callable[[Path], list[str]]) -> None:
    # async1 (the shipped schedule), 8 prompts in 4 fragments a batch, actors in this process (inproc: each
    # computes on a thread of its own), files as a run writes them.
    cfg = load_config(CONFIG, ["schedule.name=async1", "rollout.prompts_per_batch=8", "schedule.fragment_groups=2",
                               "schedule.train_pack=32", "train.iterations=2", "placement.reward=1",
                               "transport.actors=inproc", "log.image_every=0", "log.checkpoint_every=0",
                               "log.gantt=false", f"reward.weights={{{reward}=1.0}}", *models(tmp_path)])
    out = tmp_path / "run"
    history = asyncio.run(arun_disaggregated(cfg, out))
    assert [m["step"] for m in history] == [0, 1] and all(math.isfinite(m["reward_mean"]) for m in history)
    spans = _spans(json.loads((out / "trace.json").read_text()))
    scored = {device for device, ss in spans.items() for kind, _, _ in ss if kind == "reward"}
    assert scored == {"reward-0"}, "only the reward actor scores"
    rewards = [(s, e) for kind, s, e in spans["reward-0"] if kind == "reward"]
    rollouts = [(s, e) for kind, s, e in spans["rollout-0"] if kind == "rollout"]
    assert len(rewards) == 8  # 2 batches x 4 fragments, each scored once
    overlaps = [min(e1, e2) - max(s1, s2) for s1, e1 in rewards for s2, e2 in rollouts if min(e1, e2) > max(s1, s2)]
    # A fragment is scored while the rollout actor generates the next one (measured: 8 overlapping pairs, 93% of
    # the reward actor's busy time spent beside a rollout span; TAG lets the trainer generate a few as well).
    assert len(overlaps) >= 2, (rewards, rollouts)
    assert sum(overlaps) > 0.25 * sum(e - s for s, e in rewards), (rewards, rollouts)
