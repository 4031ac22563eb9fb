"""A TAG run whose only rollout actor is lost at its batch-1 token, under ``train.adv_std = "global"``.

Real role actors on the inproc transport, driven by the real coordinator; the loss is what supervision reports
for a killed process: ``is_dead`` turns true and the token it was sent never answers (over real processes and
``kill -9``: tests/e2e/test_tag_kill.py). The trainer must generate the rest of the batch (TAG) and train every
row once; with the schedule's barrier switched off (``batch_advantages = False``, the old behaviour) the
trainer would wait forever for advantages only it could produce, and the coordinator stops the run instead,
naming what it waited for.
"""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import pytest_asyncio

from digenrl.actors import ActorSystem
from digenrl.data.prompts import load_prompts
from digenrl.recipes.disaggregated import start_cluster, tiny_cpu_cost
from digenrl.roles.coordinator import Coordinator, RunStopped
from tests.e2e._tiny import tiny_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROWS = 2 * 2 * 3  # prompts x group x trained steps (all but the last of 4) of one logical batch


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    cfg = tiny_config("flow_grpo", "tag")  # adv_std = "global": the batch's reward std
    assert cfg.train.adv_std == "global"
    async with ActorSystem(transport="inproc") as system:
        c = await start_cluster(system, cfg)
        with tempfile.TemporaryDirectory() as initial:  # the untrained weights: each test starts from them
            await c.refs["trainer-0"].save_state.call(initial)
            yield cfg, c, initial


async def _losing_rollout_0(cluster, **options) -> tuple[Coordinator, list[dict]]:
    """A coordinator of a fresh run whose rollout-0 is lost the moment it is handed a batch-1 rollout token."""
    cfg, c, initial = cluster
    await c.refs["trainer-0"].load_state.call(initial, 0)
    lost: list[dict] = []

    def on_dispatch(device: str, token: dict):
        if not lost and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            lost.append(token)
        if device == "rollout-0" and lost:
            return asyncio.get_running_loop().create_future()  # never answered: the process is gone
        return None

    coord = Coordinator(cfg, "tag", c.devices, c.refs, load_prompts("color"), options=options, cost=tiny_cpu_cost(),
                        is_dead=lambda name: name == "rollout-0" and bool(lost) or c.is_dead(name),
                        on_dispatch=on_dispatch)
    return coord, lost


async def test_a_lone_trainer_generates_and_trains_the_rest_of_the_batch(cluster) -> None:
    coord, lost = await _losing_rollout_0(cluster)
    history = await asyncio.wait_for(coord.run(), 60)
    assert lost and lost[0]["batch"] == 1
    assert [m["step"] for m in history] == [0, 1] and coord.lost_devices == ["rollout-0"]
    assert all(m["rows_trained"] == ROWS for m in history)  # every row once (the ledger refuses a second time)
    after = [t for t, _ in coord.token_log if t.batch == 1 and t.kind.value in ("rollout", "reward")]
    assert {t.device for t in after} == {"trainer-0"}  # TAG: the trainer generated and scored batch 1
    scored = sorted(f.index for t in after if t.kind.value == "reward" for f in t.fragments)
    assert scored == [0, 1, 2, 3]  # each fragment scored once, none lost


async def test_a_wait_no_live_device_can_end_stops_the_run_and_names_it(cluster) -> None:
    coord, _ = await _losing_rollout_0(cluster, batch_advantages=False)
    with pytest.raises(RunStopped, match=r"the run stalled: TRAIN token \d+ on trainer-0 waits for the advantages "
                                         r"of batch 1 samples \[\d+(, \d+)*\] \(2 of 4 samples of the batch scored\)"):
        await asyncio.wait_for(coord.run(), 60)
