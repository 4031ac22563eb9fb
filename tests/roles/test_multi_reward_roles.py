"""``reward.normalize = "per_reward"`` with two rewards: the colocated loop and on-policy actors (GAP, one-sample
fragments scored apart, per-reward scores assembled by the coordinator) take the same advantages and step."""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch

from digenrl.actors import ActorSystem
from digenrl.config import config_from_dict
from digenrl.data.prompts import load_prompts
from digenrl.recipes.disaggregated import start_cluster, tiny_cpu_cost
from digenrl.roles.coordinator import Coordinator

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONF = {
    "model": {"name": "qwenimage", "preset": "tiny"},
    "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 4},
    "train": {"iterations": 1, "lr": 1e-2, "clip_range": 1e-2, "adv_std": "group"},
    "reward": {"weights": {"color": 1.0, "jpeg_compressibility": 0.5}, "normalize": "per_reward"},
    "log": {"seed": 3},
    "schedule": {"name": "gap"},
    "transport": {"actors": "inproc"},
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    cfg = config_from_dict(CONF)
    async with ActorSystem(transport="inproc") as system:
        yield cfg, await start_cluster(system, cfg)


async def test_colocated_loop_and_actors_take_the_same_per_reward_advantages(cluster) -> None:
    from digenrl.recipes.colocated import iteration, setup
    from digenrl.roles.fragments import FragmentEngine, probe_velocity

    cfg, c = cluster
    coord = Coordinator(cfg, "gap", c.devices, c.refs, load_prompts("color"),
                        options={"fragment_groups": 1, "fragment_members": 1}, cost=tiny_cpu_cost(),
                        is_dead=c.is_dead)
    actors = (await coord.run())[0]
    run = setup(cfg)
    local, _, _ = iteration(run, 0)
    assert {"reward/color", "reward/jpeg_compressibility"} <= set(actors) & set(local)
    for key in ("reward_mean", "reward_std", "adv_abs_mean", "zero_std_ratio"):
        assert local[key] == pytest.approx(actors[key], abs=1e-6), key
    # Two samples per group: standardising the weighted sum gives |A| = 1 to every sample of a varied group;
    # per reward, each sample's |A| is the weighted sum of two standardised scores (weights 1 and 0.5).
    assert local["adv_abs_mean"] != pytest.approx(1.0, abs=1e-3)
    assert local["grad_norm"] > 0
    assert local["grad_norm"] == pytest.approx(actors["grad_norm"], rel=1e-4)
    stepped = probe_velocity(FragmentEngine(cfg, run.model), 0)
    torch.testing.assert_close(await c.refs["trainer-0"].probe_velocity.call(), stepped, atol=1e-5, rtol=1e-4)
