"""A rollout actor that joins a running run (`digenrl worker --join`) gets the current weights, then work.

Real processes throughout: the run's actors, and a `digenrl worker` started when step 1 is done (an
event, never a timer). Until the newcomer is admitted, the other devices' ROLLOUT tokens are held, so
the run cannot end before it arrives however slowly the worker starts; a third worker, started at the
admission, is refused (the run is full), and the last optimizer step waits for it to exit.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from digenrl.actors import ActorSystem
from digenrl.config import load_config
from digenrl.errors import ConfigError, JoinRefused
from digenrl.recipes.disaggregated import actor_plan, arun_disaggregated
from digenrl.recipes.late_rollout import LateRollouts
from digenrl.roles.coordinator import Coordinator
from digenrl.schedule.base import Device
from tests.conftest import child_env, digenrl_command

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-qwenimage.toml"
ROWS = 8 * 8 * 1  # prompts x group x trained steps of one logical batch (as test_disaggregated)
# a short async1 run: 5 steps of 8 prompts in 4 fragment groups
SHORT = ["schedule.name=async1", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4", "schedule.train_pack=32",
         "train.iterations=5", "log.image_every=0", "log.checkpoint_every=0"]


def _worker(address: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(digenrl_command("worker", "--join", address, "--name", name, "--log-level", "WARNING"),
                            env=child_env(), stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("lane", ["zmq", pytest.param("gloo", marks=pytest.mark.slow)])  # ~25 s each
async def test_rollout_actor_joining_mid_run_gets_the_current_version_before_its_first_token(
        tmp_path: Path, lane: str) -> None:
    address = f"ipc://{tmp_path}/run.ipc"
    common = [*SHORT, "train.check_parity=true", f"transport.weights={lane}"]
    cfg = load_config(CONFIG, [*common, "placement.max_rollout=2", f"transport.address={address}"])
    events: list[tuple[str, Any]] = []  # dispatches and the admission, in the order the coordinator saw them
    admitted = asyncio.Event()
    procs: list[subprocess.Popen[bytes]] = []

    def on_step(m: dict[str, Any]) -> None:
        if m["step"] == 1:
            procs.append(_worker(address, "late"))

    def on_dispatch(device: str, token: dict[str, Any]) -> Any:
        events.append(("token", (device, token["kind"], token["batch"], token["version"])))
        if procs and token["kind"] == "rollout" and device != "rollout-1" and not admitted.is_set():
            return admitted.wait()  # hold the others' rollout work until the newcomer is in
        if token["kind"] == "optim" and token["batch"] == 4:  # the last step waits for the refused worker's exit
            return asyncio.get_running_loop().run_in_executor(None, procs[-1].wait)
        return None

    def on_admit(record: dict[str, Any]) -> None:
        events.append(("admit", record))
        admitted.set()
        procs.append(_worker(address, "one-too-many"))  # the run is full now: refused

    try:
        history = await arun_disaggregated(cfg, tmp_path / "run", on_step=on_step, on_dispatch=on_dispatch,
                                           on_admit=on_admit)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # The run finished correctly: every step, every row once, staleness bound kept, parity holds (a
    # newcomer sampling with other weights than its tokens' version would break it).
    assert [m["step"] for m in history] == [0, 1, 2, 3, 4]
    assert all(m["rows_trained"] == ROWS and m["max_staleness"] <= 1 for m in history)
    assert all(m["parity_rows"] > 0 and m["parity_logp_diff_max"] < 1e-4 for m in history)
    # Every sample is seeded by its id, whichever actor makes it: the run learns exactly as without the join.
    alone = await arun_disaggregated(load_config(CONFIG, common), write_files=False)
    keys = ("reward_mean", "reward_std", "grad_norm", "policy_loss", "approx_kl", "rows_trained")
    for a, b in zip(alone, history, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-6, abs=1e-9)

    # The admission: the newest published versions (two, for staleness 1) reached it first.
    kinds = [kind for kind, _ in events]
    [record] = [r for kind, r in events if kind == "admit"]
    assert record["device"] == "rollout-1" and set(record["published"]) <= set(record["versions"])
    published = [e[3] for kind, e in events if kind == "token" and e[1] == "publish"]
    assert record["published"][-1] >= 2 and record["published"][-1] in published
    mine = [e for kind, e in events if kind == "token" and e[0] == "rollout-1"]
    assert mine and kinds.index("admit") < events.index(("token", mine[0]))
    first_version = mine[0][3]
    assert first_version in record["versions"] or first_version > record["published"][-1]
    # Its samples: rollout tokens within the staleness bound, and scored (reward tokens) on it.
    assert all(0 <= b - v <= 1 for _, k, b, v in mine if k == "rollout")
    assert any(k == "reward" for _, k, _, _ in mine)
    # The trace shows the admission (a publish span) before its first rollout span.
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    tid = next(e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["args"]["name"] == "rollout-1")
    spans = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"])
    assert spans[0]["cat"] == "publish" and {"rollout", "reward"} <= {e["cat"] for e in spans[1:]}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [r["device"] for r in summary["admitted"]] == ["rollout-1"]
    # The late worker left with the run; the one beyond placement.max_rollout was refused, saying why.
    err = procs[1].stderr.read().decode() if procs[1].stderr else ""
    assert codes == [0, 3], err
    assert "refused this worker: this run has 2 rollout actors, its limit (placement.max_rollout = 2)" in err


async def test_a_late_rollout_actor_killed_at_its_first_token_is_dropped_and_the_run_finishes(tmp_path: Path) -> None:
    """kill -9 of the newcomer the moment it is handed its first token (gloo lane): its work is re-issued,
    the weight group re-forms without it at the next publication, every row is still trained once."""
    address = f"ipc://{tmp_path}/run.ipc"
    cfg = load_config(CONFIG, [*SHORT, "transport.weights=gloo", "placement.max_rollout=2",
                               f"transport.address={address}"])
    admitted = asyncio.Event()
    procs: list[subprocess.Popen[bytes]] = []

    def on_step(m: dict[str, Any]) -> None:
        if m["step"] == 1:
            procs.append(_worker(address, "late"))

    def on_dispatch(device: str, token: dict[str, Any]) -> Any:
        if device == "rollout-1" and procs[0].poll() is None:
            procs[0].kill()  # SIGKILL, before the token reaches it
        elif procs and token["kind"] == "rollout" and not admitted.is_set():
            return admitted.wait()
        return None

    try:
        history = await arun_disaggregated(cfg, tmp_path / "run", on_step=on_step, on_dispatch=on_dispatch,
                                           on_admit=lambda record: admitted.set())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode == -9
    assert [m["step"] for m in history] == [0, 1, 2, 3, 4]
    assert all(m["rows_trained"] == ROWS and m["max_staleness"] <= 1 for m in history)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [r["device"] for r in summary["admitted"]] == ["rollout-1"] and summary["lost_devices"] == ["rollout-1"]


async def test_a_system_refuses_a_join_its_policy_turns_away() -> None:
    """The runtime part alone: the join policy's JoinRefused reaches the worker, which exits with code 3."""
    async with ActorSystem(address="tcp://127.0.0.1:0") as system:
        asked: list[str] = []

        def policy(worker: Any) -> None:
            asked.append(worker.name)
            raise JoinRefused("no room here (placement.max_rollout = 1)")

        system.join_policy = policy
        proc = _worker(system.address, "turned-away")
        _, err = await asyncio.get_running_loop().run_in_executor(None, proc.communicate, None, 60)
        assert proc.returncode == 3 and asked == ["turned-away"] and system.workers == []
        assert err.decode().strip().endswith(
            "digenrl worker: the system refused this worker: no room here (placement.max_rollout = 1)")


async def test_a_run_without_max_rollout_refuses_a_late_worker_and_says_how_to_allow_it() -> None:
    cfg = load_config(CONFIG, ["schedule.name=async1"])
    devices = [Device(name, role) for name, role, _, _ in actor_plan(cfg)]
    async with ActorSystem(address="tcp://127.0.0.1:0") as system:
        coordinator = Coordinator(cfg, "async1", devices, {}, ["a prompt"])
        late = LateRollouts(cfg, system, coordinator)
        late.install()
        proc = _worker(system.address, "uninvited")
        _, err = await asyncio.get_running_loop().run_in_executor(None, proc.communicate, None, 60)
        await late.aclose()
    assert proc.returncode == 3 and system.workers == []
    assert ("refused this worker: this run takes no workers once it runs (placement.max_rollout = 0); start it with "
            "placement.max_rollout > placement.rollout = 1 to let rollout actors join it") in err.decode()


@pytest.mark.parametrize(("overrides", "message"), [
    (["placement.rollout=2", "placement.max_rollout=1"], "placement.max_rollout: must be 0 (no late joins) or >= "
                                                          "placement.rollout = 2, got 1"),
    (["placement.max_rollout=2", "transport.actors=inproc"], "placement.max_rollout = 2: rollout actors join a running "
                                                              "run as worker processes"),
    (["placement.max_rollout=2", "schedule.name=colocated"], "needs an actor schedule (not colocated)"),
])
def test_max_rollout_is_validated(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(CONFIG, overrides)
