"""`digenrl plan` counts the learned reward models where they are held and score (issue 31): configs/flux.toml
with ``pickscore`` (CLIP-H, 986 M published parameters) on the rollout actors and TAG trainers, on a reward actor
of its own with ``placement.reward = 1``, in host memory with ``reward.device = "cpu"``."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.plan.memory import memory_plan, traces_for
from digenrl_cli.plan import format_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PUBLISHED_PARAMS = 986e6  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the architecture of PickScore_v1


@pytest.fixture(scope="module")
def traces():
    return traces_for(load_config(CONFIGS / "flux.toml"), linear=True)


def _plan(traces, *overrides: str):
    return memory_plan(load_config(CONFIGS / "flux.toml", list(overrides)), traces)  # the shipped pickscore


def test_flux_with_pickscore_holds_it_where_the_latents_are_scored(traces) -> None:
    plan = _plan(traces)  # async1, placement.reward = 0: rollout actors and (TAG) trainers score
    (model,) = plan.rewards
    assert model.dtype == "bfloat16"  # reward.dtype "": bf16 on CUDA
    assert model.weights == pytest.approx(PUBLISHED_PARAMS * 2, rel=0.002)  # 986.1 M x 2 B = 1.97 GB
    assert "published size of CLIP ViT-H/14" in model.source
    for role in ("rollout", "trainer"):
        r = plan.roles[role]
        assert r.reward_models == model.weights and r.device == "H100"
        assert any(n.startswith("reward model pickscore: CLIP ViT-H/14, 986.1 M params x 2 B") for n in r.notes)
    text = format_plan(plan)
    assert "reward models" in text and "rollout: reward model pickscore" in text
    assert plan.to_json()["roles"]["rollout"]["reward_models"] == model.weights


def test_a_reward_actor_holds_it_alone_and_host_memory_under_reward_device_cpu(traces) -> None:
    plan = _plan(traces, "placement.rollout=4", "placement.reward=1")
    reward, rollout = plan.roles["reward"], plan.roles["rollout"]
    assert reward.reward_models == pytest.approx(PUBLISHED_PARAMS * 2, rel=0.002)
    assert reward.activations >= plan.rewards[0].activations > 0
    assert any(n.startswith("reward model pickscore") for n in reward.notes)
    # The rollout actors (and TAG trainers) hold none: they build it only if every reward actor dies.
    assert rollout.reward_models == plan.roles["trainer"].reward_models == 0
    assert rollout.activations == _plan(traces).roles["rollout"].activations
    colocated = _plan(traces, "schedule.name=colocated").roles["colocated"]  # the one device samples and scores
    assert colocated.reward_models == plan.roles["reward"].reward_models
    host = _plan(traces, "reward.device=cpu")  # fp32 on the CPU, outside the GPU's budget
    assert host.roles["rollout"].reward_models == 0
    assert host.roles["rollout"].host_bytes - _plan(traces).roles["rollout"].host_bytes == pytest.approx(
        PUBLISHED_PARAMS * 4, rel=0.002)


def test_rewards_without_a_model_add_nothing(traces) -> None:
    plan = _plan(traces, "reward.weights={remote=1.0}")  # its own server
    assert not plan.rewards and all(r.reward_models == 0 for r in plan.roles.values())
    assert "rollout: reward remote: its own server, nothing on the devices" in format_plan(plan)
