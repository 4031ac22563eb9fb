"""Role actors on the inproc transport in one process, real tiny model, driven by the real coordinator."""

from __future__ import annotations

import tempfile

import pytest
import pytest_asyncio
import torch

from digenrl.actors import ActorSystem
from digenrl.roles.coordinator import Coordinator
from digenrl.config import config_from_dict
from digenrl.errors import RemoteError, StalenessViolation
from digenrl.recipes.disaggregated import start_cluster, tiny_cpu_cost
from digenrl.data.prompts import load_prompts

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONF = {
    "model": {"name": "qwenimage", "preset": "tiny"},
    "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 4},
    # a warm-up, so the colocated-vs-actors test also checks that the trainer ramps its rate as the loop does
    "train": {"iterations": 1, "lr": 1e-2, "lr_warmup": 3, "clip_range": 1e-2, "adv_std": "group"},
    "log": {"seed": 3},
    "schedule": {"name": "gap"},
    "transport": {"actors": "inproc"},
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    cfg = config_from_dict(CONF)
    async with ActorSystem(transport="inproc") as system:
        c = await start_cluster(system, cfg)
        with tempfile.TemporaryDirectory() as initial:  # the untrained weights, for tests that start over
            await c.refs["trainer-0"].save_state.call(initial)
            yield cfg, c, initial


async def _run(cfg, cluster, schedule: str, **options) -> list[dict]:
    coord = Coordinator(cfg, schedule, cluster.devices, cluster.refs, load_prompts("color"), options=options,
                        cost=tiny_cpu_cost(), is_dead=cluster.is_dead)
    return await coord.run()


async def test_gap_streaming_equals_the_full_batch_barrier(cluster) -> None:
    """GAP trains a batch in several tokens; the update equals the one-token (barrier) path."""
    cfg, c, _ = cluster
    trainer = c.refs["trainer-0"]
    with tempfile.TemporaryDirectory() as d:
        await trainer.save_state.call(d)
        barrier = (await _run(cfg, c, "disaggregated", fragment_groups=1))[0]
        after_barrier = (await trainer.weights_info.call())["digest"]
        await trainer.load_state.call(d, 0)
        gap = (await _run(cfg, c, "gap", fragment_groups=1))[0]
    assert barrier["reward_mean"] == gap["reward_mean"]  # the same samples, bit for bit
    assert barrier["rows_trained"] == gap["rows_trained"] == 4 * 2 * 3
    assert gap["grad_norm"] > 0
    assert gap["grad_norm"] == pytest.approx(barrier["grad_norm"], rel=1e-5)
    assert gap["policy_loss"] == pytest.approx(barrier["policy_loss"], abs=1e-7)  # on-policy: ~0 by construction
    assert (await trainer.weights_info.call())["version"] == 1
    assert after_barrier != ""


async def test_rollout_samples_with_the_published_weights(cluster) -> None:
    """After publish, the rollout actor's loaded weights and velocity equal the trainer's, not the old ones."""
    cfg, c, _ = cluster
    trainer, rollout = c.refs["trainer-0"], c.refs["rollout-0"]
    info = await trainer.weights_info.call()
    assert info["version"] == 1  # the previous test stepped once
    before = await rollout.probe_velocity.call(0)
    old = (await rollout.weights_info.call(0))["digest"]
    await trainer.publish.call(1, ["rollout-0"])
    after = await rollout.probe_velocity.call(1)
    state = await rollout.weights_info.call()
    assert state["loaded"] == 1 and state["digest"] == info["digest"] != old
    assert torch.equal(after, await trainer.probe_velocity.call())
    assert not torch.allclose(after, before), "publication changed nothing the rollout samples with"
    # A trajectory started with v0 may still continue: v0 stays available (staleness 1).
    assert torch.equal(await rollout.probe_velocity.call(0), before)


async def test_trainer_refuses_samples_older_than_the_staleness_bound(cluster) -> None:
    cfg, c, _ = cluster
    rollout, trainer = c.refs["rollout-0"], c.refs["trainer-0"]
    token = {"id": 0, "kind": "rollout", "batch": 5, "version": 1, "start": 0, "end": 4,
             "frags": [[0, 0, 1, 0, 2, 2]], "rows": [], "sources": [""], "helper": False, "packed": True}
    await rollout.rollout.call(token, ["a red square"] * 4)
    await rollout.reward.call({**token, "kind": "reward", "sources": ["rollout-0"]}, ["a red square"] * 4, "trainer-0")
    train = {**token, "kind": "train", "rows": [[0, 6]], "sources": []}
    with pytest.raises((RemoteError, StalenessViolation), match="staleness 4 > 0"):
        await trainer.train.call(train, [{"adv": [0.5, -0.5], "keep": [True, True], "store": "trainer-0"}])


async def test_colocated_loop_and_actors_train_the_same_samples(cluster) -> None:
    """Noise belongs to samples (digenrl/rl/noise.py): the single-process loop and on-policy actors cutting
    the batch into 8 one-sample fragments generate the same samples and take the same optimizer step."""
    from digenrl.roles.fragments import FragmentEngine, probe_velocity
    from digenrl.recipes.colocated import iteration, setup

    cfg, c, initial = cluster
    trainer = c.refs["trainer-0"]
    await trainer.load_state.call(initial, 0)
    actors = (await _run(cfg, c, "gap", fragment_groups=1, fragment_members=1))[0]
    run = setup(cfg)
    local, _, _ = iteration(run, 0)
    assert local["reward_mean"] == pytest.approx(actors["reward_mean"], abs=1e-6)
    assert local["reward_std"] == pytest.approx(actors["reward_std"], abs=1e-6)
    assert local["grad_norm"] > 0
    assert local["grad_norm"] == pytest.approx(actors["grad_norm"], rel=1e-4)
    stepped = probe_velocity(FragmentEngine(cfg, run.model), 0)
    torch.testing.assert_close(await trainer.probe_velocity.call(), stepped, atol=1e-5, rtol=1e-4)
