"""Sequence-parallel actors (issue 40): a rollout actor and a trainer that are each a group of sp processes.

Every group runs the tiny Qwen-Image split over its members (Ulysses, digenrl.models.sequence_parallel) and
acts as one actor to the coordinator. Its metrics are those of the sp = 1 run up to fp32 rounding: the
attention's reductions run in another order across the head split (measured: rewards agree to 3e-8
relative, grad norms to 2e-5; the tolerances below leave a margin over that, far below what a lost or
doubled gradient, a stale weight or a wrong advantage changes).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from digenrl.config import Config, load_config
from digenrl.errors import ConfigError
from digenrl.recipes.disaggregated import actor_plan, sp_groups
from digenrl.recipes.preflight import validation
from digenrl.recipes.ray_launcher import plan_bundles
from digenrl.roles.sp_group import mesh_ranks
from tests.e2e._tiny import SCHEDULES, run_schedule, tiny_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
SP = {"transport": {"actors": "zmq"}, "placement": {"sp": 2}}
ROWS = 2 * 2 * 3  # prompts x group x trained steps (all but the last of 4) of one logical batch


def _config(schedule: str, sp: int, **tables: dict) -> Config:
    placement = {"sp": sp, **({"rollout": 0} if schedule == "colocated-tsp" else {}), **tables.pop("placement", {})}
    transport = {"actors": "zmq" if sp > 1 else "inproc", **tables.pop("transport", {})}
    return tiny_config("flow_grpo", schedule, placement=placement, transport=transport, **tables)


def _assert_same_run(ref: list[dict], got: list[dict]) -> None:
    """Same steps, rows and numbers as the sp = 1 run, up to fp32 rounding (module docstring)."""
    assert [m["step"] for m in got] == [m["step"] for m in ref] == [0, 1]
    for a, b in zip(ref, got, strict=True):
        assert b["rows_trained"] == a["rows_trained"] == ROWS
        assert {k: b[k] for k in ("reward_mean", "reward_std")} == pytest.approx(
            {k: a[k] for k in ("reward_mean", "reward_std")}, rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert {k: b[k] for k in ("policy_loss", "approx_kl")} == pytest.approx(
            {k: a[k] for k in ("policy_loss", "approx_kl")}, abs=1e-6)
    assert got[1]["reward_mean"] != got[0]["reward_mean"]  # the first step's weights reached the rollout group


def _member_pid(title: str) -> int | None:
    """This test's actor process titled exactly ``title`` (``digenrl-rollout-0`` is a prefix of its members')."""
    for p in psutil.Process().children(recursive=True):
        try:
            if title in p.cmdline():
                return p.pid
        except psutil.NoSuchProcess:
            continue
    return None


async def test_sp2_rollout_and_trainer_match_sp1(tmp_path: Path) -> None:
    """The one short end-to-end run: async1 (GAP, TSP, TAG, one-step stale) with both roles at sp = 2."""
    ref = await run_schedule(_config("async1", 1))
    got = await run_schedule(_config("async1", 2), tmp_path)
    _assert_same_run(ref, got)
    trace = json.loads((tmp_path / "trace.json").read_text())
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"rollout-0", "trainer-0"}  # one actor each to the coordinator
    assert set(json.loads((tmp_path / "summary.json").read_text())["peak_memory"]) == {"rollout-0", "trainer-0"}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("colocated", "async1")] + ["colocated-tsp"])
async def test_every_actor_schedule_with_sp2_matches_sp1(schedule: str) -> None:
    _assert_same_run(await run_schedule(_config(schedule, 1)), await run_schedule(_config(schedule, 2)))


@pytest.mark.slow
async def test_killed_sp_member_loses_nothing(tmp_path: Path) -> None:
    """kill -9 of the rollout group's follower while its leader holds a token: the group dies as one (its leader
    leaves), the token is re-issued (the trainer generates it, TAG), every step trains every row."""
    # The shipped tiny default, as tests/e2e/test_disaggregated.py's killed rollout actor (TAG on-policy, a quarter
    # of its batch: 2 fragments of 32 samples).
    cfg = load_config(CONFIG, ["schedule.name=tag", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4",
                               "schedule.train_pack=32", "train.iterations=3", "log.image_every=0",
                               "log.checkpoint_every=0", "placement.rollout_sp=2"])
    killed: list[tuple[int, int, int]] = []  # (follower pid, leader pid, batch)

    def on_dispatch(device: str, token: dict) -> None:
        if not killed and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            follower, leader = _member_pid("digenrl-rollout-0-sp1"), _member_pid("digenrl-rollout-0")
            assert follower is not None and leader is not None
            os.kill(follower, signal.SIGKILL)
            killed.append((follower, leader, token["batch"]))

    history = await run_schedule(cfg, tmp_path, on_dispatch=on_dispatch)
    assert killed, "the rollout group was never handed rollout work after step 0"
    _, leader, batch = killed[0]
    assert [m["step"] for m in history] == [0, 1, 2]
    assert all(m["rows_trained"] == 8 * 8 * 1 for m in history)  # prompts x group x its one trained step
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lost_devices"] == ["rollout-0"] and summary["repeats_uninterrupted"] is False
    assert not psutil.pid_exists(leader) or psutil.Process(leader).status() == psutil.STATUS_ZOMBIE
    trace = json.loads((tmp_path / "trace.json").read_text())
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    helped = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tids["trainer-0"]
              and e["cat"] == "rollout" and e["args"]["batch"] == batch]
    assert helped, "the trainer must generate the dead group's work (TAG)"


@pytest.mark.slow  # 6 + 4 actor processes: ~60 s of CPU
async def test_two_sp2_trainers_with_ddp_match_two_sp1_trainers() -> None:
    """Data parallel x SP: 2 trainers that are each an SP group of 2 (one world of 4 ranks, the DDP all-reduce
    over each SP rank's data-parallel group) train the same run as 2 trainers of sp = 1. Each SP group's
    collectives stay its own (``dp_sp_mesh``): crossed ones gave another group's numbers, or none."""
    ddp = {"placement": {"trainer": 2}, "transport": {"actors": "zmq"}}
    ref = await run_schedule(_config("disaggregated", 1, **ddp))
    got = await run_schedule(_config("disaggregated", 1, placement={"trainer": 2, "trainer_sp": 2},
                                     transport=ddp["transport"]))
    _assert_same_run(ref, got)


def test_trainer_mesh_is_data_parallel_by_sp() -> None:
    """Trainer g's members are ranks g*sp..; the data-parallel group of SP rank s holds rank s of every trainer."""
    assert mesh_ranks(6, 2) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    assert mesh_ranks(2, 2) == ([[0, 1]], [[0], [1]])
    with pytest.raises(ValueError, match="does not split"):
        mesh_ranks(5, 2)


# -- placement: how SP counts processes, and what it refuses ----------------------------------------------


def test_sp_counts_a_process_per_member_in_spawn_order() -> None:
    cfg = tiny_config("flow_grpo", "async1", placement={"rollout": 2, "rollout_sp": 3, "trainer_sp": 2, "reward": 1},
                      transport={"actors": "zmq"})
    place = cfg.placement
    assert (place.sp_of("rollout"), place.sp_of("trainer"), place.sp_of("reward")) == (3, 2, 1)
    names = [name for name, *_ in actor_plan(cfg)]
    assert names == ["trainer-0", "trainer-0-sp1", "rollout-0", "rollout-0-sp1", "rollout-0-sp2",
                     "rollout-1", "rollout-1-sp1", "rollout-1-sp2", "reward-0"]
    assert place.actors == len(names) == 9
    assert sp_groups(cfg)["rollout-1"] == ["rollout-1", "rollout-1-sp1", "rollout-1-sp2"]
    assert sum(place.roles_by_gpu(), []) == ["trainer"] * 2 + ["rollout"] * 6 + ["reward"]
    bundles = plan_bundles(cfg, [(n, role, cls) for n, role, cls, _ in actor_plan(cfg)])
    assert [b.actor for b in bundles] == names  # the Ray launcher: one bundle per process
    note = next(n for n in validation(cfg).notes if "sequence parallelism" in n)  # what `digenrl validate` says
    assert "2 rollout actor(s) of sp = 3 (6 processes)" in note and "1 trainer actor(s) of sp = 2" in note


@pytest.mark.parametrize(("tables", "names"), [
    ({"schedule": {"name": "colocated"}}, ("placement.sp = 2", "colocated")),
    ({"transport": {"actors": "inproc"}}, ("placement.sp = 2", "transport.actors")),
    ({"placement": {"sp": 1, "rollout_sp": 2, "max_rollout": 2}}, ("placement.max_rollout", "placement.rollout_sp")),
    ({"model": {"finetune": "full"}, "placement": {"sp": 2, "trainer": 2}}, ("train.shard = 'fsdp'", "trainer_sp")),
    ({"placement": {"sp": 1, "trainer_sp": 2}, "model": {"device": "cuda"}, "placement_gpu": 1},
     ("placement.trainer_sp = 2", "placement.actors_per_gpu")),
    ({"placement": {"workers": 3}, "transport": {"actors": "zmq", "address": "tcp://127.0.0.1:0"}},
     ("placement.workers = 3", "rollout x rollout_sp")),
])
def test_sp_refusals_name_the_key(tables: dict, names: tuple[str, ...]) -> None:
    schedule = tables.pop("schedule", {}).get("name", "async1")
    if tables.pop("placement_gpu", None):
        tables["placement"] = {**tables["placement"], "actors_per_gpu": 3}  # 3 processes on one GPU
    sp = {**SP["placement"], **tables.pop("placement", {})}
    with pytest.raises(ConfigError) as err:
        tiny_config("flow_grpo", schedule, **{**SP, **tables, "placement": sp})
    for name in names:
        assert name in str(err.value)


@pytest.mark.slow
async def test_sp_rollout_group_gets_its_weights_over_the_gloo_lane() -> None:
    """transport.weights = gloo reaches the leader only: it stages each version on its member (a member left on
    the initial weights would sample batch 1 with the wrong ones, and its numbers would differ)."""
    gloo = {"transport": {"weights": "gloo"}}
    ref = await run_schedule(tiny_config("flow_grpo", "disaggregated", transport={"actors": "zmq", "weights": "gloo"}))
    got = await run_schedule(_config("disaggregated", 2, placement={"trainer_sp": 1}, **gloo))
    _assert_same_run(ref, got)
