"""End to end: the disaggregated recipe over real processes and ZeroMQ, faults, and exact resume."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
from pathlib import Path

import psutil
import pytest

from digenrl.roles.coordinator import RunStopped
from digenrl.config import Config, load_config
from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.telemetry.metrics import METRIC_KEYS
from tests.conftest import child_env, digenrl_command

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
ROWS = 8 * 8 * 1  # prompts x group x trained steps (a one-step window) of one logical batch


def _load(*overrides: str) -> Config:
    # The shipped default with TAG on-policy (staleness 0), which these tests assert on, and a quarter of
    # its batch (2 fragments of 32 samples) to keep the suite fast.
    small = ["schedule.name=tag", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4", "schedule.train_pack=32"]
    return load_config(CONFIG, [*small, *overrides])


def _pid_of(title: str) -> int | None:
    # Only this test's own actor processes: other runs on the machine use the same titles.
    for p in psutil.Process().children(recursive=True):
        try:
            if any(title in part for part in p.cmdline()):
                return p.pid
        except psutil.NoSuchProcess:
            continue
    return None


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


async def test_short_run_over_processes_writes_every_artifact(tmp_path: Path) -> None:
    cfg = _load("train.iterations=3", "log.image_every=2", "log.checkpoint_every=1")
    titles: dict[str, int | None] = {}

    def on_step(m: dict) -> None:
        for role in ("digenrl-rollout-0", "digenrl-trainer-0"):
            titles[role] = titles.get(role) or _pid_of(role)

    history = await arun_disaggregated(cfg, tmp_path, on_step=on_step)
    assert all(titles.values()) and len(set(titles.values())) == 2 and os.getpid() not in titles.values()
    lines = _lines(tmp_path)
    assert [m["step"] for m in lines] == [0, 1, 2] == [m["step"] for m in history]
    for m in lines:
        assert set(METRIC_KEYS) <= set(m)
        assert set(m["bubble_ratio"]) == {"rollout-0", "trainer-0", "overall"}
        assert all(0.0 <= v <= 1.0 for v in m["bubble_ratio"].values())
        assert math.isfinite(m["reward_mean"]) and 0 <= m["reward_mean"] <= 1
        assert m["rows_trained"] == ROWS and m["max_staleness"] == 0 and m["samples_per_s"] > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"rollout-0", "trainer-0"}
    assert {"rollout", "reward", "train", "optim", "publish"} <= {e["cat"] for e in spans}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for name in ("gantt.png", "summary.json", "samples/step_00000.png", "samples/step_00002.png"):
        assert (tmp_path / name).is_file(), name
    assert find_checkpoint(tmp_path).name == "step-000003"


async def test_killed_rollout_actor_its_work_is_reissued_and_nothing_is_lost(tmp_path: Path) -> None:
    cfg = _load("train.iterations=4", "log.image_every=0", "log.checkpoint_every=0")
    killed: list[tuple[int, int]] = []  # (pid, batch of the token it was given)

    def on_dispatch(device: str, token: dict) -> None:
        # The rollout actor dies the moment it is handed rollout work after the first step: that
        # token is in flight whatever the machine's speed, so its work must be re-issued.
        if not killed and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            pid = _pid_of("digenrl-rollout-0")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append((pid, token["batch"]))

    history = await arun_disaggregated(cfg, tmp_path, on_dispatch=on_dispatch)
    assert killed, "the rollout actor was never handed rollout work after step 0"
    pid, batch = killed[0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    assert all(m["rows_trained"] == ROWS and math.isfinite(m["reward_mean"]) for m in history)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lost_devices"] == ["rollout-0"]
    assert list(summary["peak_memory"]) == ["trainer-0"]  # every live process's peak; the dead one has none
    assert summary["peak_memory"]["trainer-0"]["device"] == "cpu" and summary["peak_memory"]["trainer-0"]["rss"] > 1e8
    trace = json.loads((tmp_path / "trace.json").read_text())
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    helped = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tids["trainer-0"]
              and e["cat"] == "rollout" and e["args"]["batch"] == batch]
    assert helped, "the trainer must generate the dead actor's work (TAG)"


@pytest.mark.parametrize("schedule", ["disaggregated", "async1"])
async def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path, schedule: str) -> None:
    """async1 too: batch 2 is generated with version 1, which the checkpoint at version 2 keeps."""
    common = ("transport.actors=inproc", f"schedule.name={schedule}", "rollout.prompts_per_batch=4",
              "rollout.num_steps=4", "log.image_every=0", "log.checkpoint_every=1")
    cfg3 = _load("train.iterations=3", *common)
    cfg2 = _load("train.iterations=2", *common)
    whole = await arun_disaggregated(cfg3, tmp_path / "whole")
    await arun_disaggregated(cfg2, tmp_path / "cut")
    ckpt = find_checkpoint(tmp_path / "cut")
    assert load_state(ckpt)["version"] == 2
    assert (ckpt / "previous.safetensors").is_file() == (schedule == "async1")
    resumed = await arun_disaggregated(cfg3, tmp_path / "cut", resume=tmp_path / "cut")
    assert [m["step"] for m in resumed] == [0, 1, 2] == [m["step"] for m in _lines(tmp_path / "cut")]
    keys = ("reward_mean", "reward_std", "clipfrac", "approx_kl", "kl", "zero_std_ratio", "grad_norm", "policy_loss",
            "max_staleness")
    for a, b in zip(whole, resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert whole[2]["grad_norm"] > 0
    assert [m["max_staleness"] for m in whole] == ([0, 1, 1] if schedule == "async1" else [0, 0, 0])


async def test_resume_from_a_garbled_previous_weights_file_names_it(tmp_path: Path) -> None:
    common = ("transport.actors=inproc", "schedule.name=async1", "rollout.prompts_per_batch=4", "rollout.num_steps=4",
              "log.image_every=0", "log.checkpoint_every=1")
    await arun_disaggregated(_load("train.iterations=1", *common), tmp_path)
    previous = find_checkpoint(tmp_path) / "previous.safetensors"
    previous.write_bytes(previous.read_bytes()[:40])
    with pytest.raises(Exception, match="previous.safetensors: not a readable safetensors file"):
        await arun_disaggregated(_load("train.iterations=2", *common), tmp_path, resume=tmp_path)


@pytest.mark.slow
async def test_killed_trainer_stops_cleanly_and_the_run_resumes(tmp_path: Path) -> None:
    cfg = _load("train.iterations=3", "log.image_every=0", "log.checkpoint_every=1")

    def on_dispatch(device: str, token: dict) -> None:
        # Batch 2 trains only after version 2 exists and was checkpointed (on-policy schedule).
        if device == "trainer-0" and token["kind"] == "train" and token["batch"] == 2:
            pid = _pid_of("digenrl-trainer-0")
            if pid is not None:
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(RunStopped, match="trainer trainer-0 died.*resume with --resume"):
        await arun_disaggregated(cfg, tmp_path, on_dispatch=on_dispatch)
    ckpt = find_checkpoint(tmp_path)
    assert ckpt.name == "step-000002" and load_state(ckpt)["version"] == 2
    history = await arun_disaggregated(cfg, tmp_path, resume=tmp_path)
    assert [m["step"] for m in history] == [0, 1, 2]


async def test_weights_over_the_gloo_communicator_learn_like_zmq(tmp_path: Path) -> None:
    """Same seed and schedule, weights over the gloo communicator instead of zmq messages: every step matches.

    A lane that delivered nothing (or the wrong version) would show: batch k would be generated with
    stale weights, so its rewards and its first PPO ratio (approx_kl, ~0 on policy) would differ."""
    common = ("train.iterations=3", "schedule.name=disaggregated", "log.image_every=0", "log.checkpoint_every=0")
    zmq = await arun_disaggregated(_load(*common), tmp_path / "zmq")
    gloo = await arun_disaggregated(_load(*common, "transport.weights=gloo"), tmp_path / "gloo")
    keys = ("reward_mean", "reward_std", "grad_norm", "policy_loss", "approx_kl", "rows_trained")
    for a, b in zip(zmq, gloo, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-6, abs=1e-9)
    assert all(m["approx_kl"] < 1e-10 for m in gloo)  # each batch sampled with the version it trains from
    assert zmq[2]["reward_mean"] != zmq[0]["reward_mean"]


@pytest.mark.slow
async def test_actors_placed_on_joined_workers(tmp_path: Path) -> None:
    """`digenrl worker --join` processes (one per GPU on a cluster) host the actors, one each, authenticated
    with the run's CURVE keys as across hosts."""
    import socket
    import subprocess

    from digenrl.transport.curve import create_keys

    keys = create_keys(tmp_path / "keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    cfg = _load("train.iterations=2", "log.image_every=0", "placement.workers=2",
                          f"transport.address={address}", f"transport.keys='{keys}'")
    procs = [subprocess.Popen(digenrl_command("worker", "--join", address, "--name", f"gpu{i}", "--log-level", "WARNING",
                                              "--keys", str(keys)), env=child_env())
             for i in range(2)]
    try:
        history = await arun_disaggregated(cfg, tmp_path / "run")
        assert [m["rows_trained"] for m in history] == [ROWS, ROWS]
        assert [p.wait(timeout=30) for p in procs] == [0, 0]  # the workers leave when the system shuts down
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
