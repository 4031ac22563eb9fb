"""`--launcher ray` on a real local Ray (`ray.init(num_cpus=2)`, no dashboard, usage stats off): the tiny
run gives the local launcher's metrics, its processes and placement group live only as long as the run,
and a killed Ray actor is the same event as a kill -9 of an actor process."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# Ray reads this when it is imported: the private Ray of these tests (and every process it starts) uses
# 127.0.0.1, never this host's interface address (the launcher does the same for cluster.address = 'local').
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the Ray launcher's tests need the [ray] extra: pip install -e '.[ray]' "
                                        "(.ci/run installs it)")

from digenrl.config import Config, load_config  # noqa: E402
from digenrl.errors import ConfigError  # noqa: E402
from digenrl.roles.coordinator import RunStopped  # noqa: E402
from digenrl.recipes.checkpoint import find_checkpoint, load_state  # noqa: E402
from digenrl.recipes.disaggregated import arun_disaggregated  # noqa: E402
from digenrl.recipes.ray_launcher import host_actor_name  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
ROWS = 8 * 8 * 1  # prompts x group x trained steps of one logical batch
# The numbers a run computes (timings, bubbles and throughput aside).
KEYS = ("step", "version", "reward_mean", "reward_std", "reward/shapes", "adv_abs_mean", "clipfrac", "approx_kl", "kl",
        "zero_std_ratio", "grad_norm", "policy_loss", "ratio", "max_staleness", "rows_trained", "parity_ratio")
ROLES = ("digenrl-rollout-0", "digenrl-trainer-0")


@pytest.fixture(scope="module")
def local_ray():
    # A private instance of this test module (never RAY_ADDRESS's cluster); the node also advertises an
    # L40S so that a heterogeneous request can be placed on it.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             resources={"accelerator_type:L40S": 1})
    yield ray
    ray.shutdown()


def _load(*overrides: str) -> Config:
    # The shipped default (async1) with a quarter of its batch, as tests/e2e/test_disaggregated.py.
    small = ["rollout.prompts_per_batch=8", "schedule.fragment_groups=4", "schedule.train_pack=32",
             "log.image_every=0", "log.checkpoint_every=0"]
    return load_config(CONFIG, [*small, *overrides])


def _proc(title: str) -> psutil.Process | None:
    # This test's processes only: Ray's raylet is our child, its workers and theirs below it.
    for p in psutil.Process().children(recursive=True):
        try:
            if any(title in part for part in p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def _ours() -> list[dict]:
    return [pg for pg in ray.util.placement_group_table().values() if pg["name"] == host_actor_name("")]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


async def test_ray_run_gives_the_local_metrics_and_leaves_nothing_behind(tmp_path: Path, local_ray) -> None:
    await arun_disaggregated(_load("train.iterations=3"), tmp_path / "local")
    seen: dict[str, psutil.Process] = {}
    parents: dict[str, psutil.Process] = {}
    hosts: dict[str, str] = {}  # role title -> its parent's command line (the Ray actor of its bundle)
    live_groups: list[list[dict]] = []
    peers: set[str] = set()

    def on_step(m: dict) -> None:
        for title in ROLES:
            p = _proc(title)
            assert p is not None, f"{title} is not running during step {m['step']}"
            seen.setdefault(title, p)
            parents.setdefault(title, p.parent())
            hosts.setdefault(title, " ".join(parents[title].cmdline()))
        live_groups.append([pg for pg in _ours() if pg["state"] == "CREATED"])
        for p in psutil.Process().children(recursive=True):
            try:
                peers.update(c.raddr.ip.removeprefix("::ffff:") for c in p.net_connections("inet") if c.raddr)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue

    history = await arun_disaggregated(_load("train.iterations=3", "cluster.launcher=ray"), tmp_path / "ray",
                                       on_step=on_step)
    local, placed = _lines(tmp_path / "local"), _lines(tmp_path / "ray")
    assert [m["step"] for m in history] == [0, 1, 2]
    assert [{k: m[k] for k in KEYS} for m in placed] == [{k: m[k] for k in KEYS} for m in local]

    # During the run: the role processes, each the child of the Ray actor of its bundle, in one placement group.
    assert all("WorkerHost" in cmdline for cmdline in hosts.values()), hosts
    assert all(len(groups) == 1 for groups in live_groups) and len(live_groups) == 3
    assert [b for b in live_groups[0][0]["bundles"].values()] == [{"CPU": 1.0}, {"CPU": 1.0}]
    # Nothing talked to another address than loopback, Ray's own processes included.
    assert peers and peers <= {"127.0.0.1", "::1"}, peers

    # After it: no role process, no host actor, and the placement group removed.
    gone, alive = psutil.wait_procs([*seen.values(), *parents.values()], timeout=30)
    assert not alive, alive
    assert _ours() and all(pg["state"] == "REMOVED" for pg in _ours())


async def test_killed_ray_actor_of_rollout_0_is_a_lost_actor_and_every_step_completes(tmp_path: Path,
                                                                                    local_ray) -> None:
    # The rollout bundle asks for an L40S (this node advertises one): heterogeneous pools place for real.
    cfg = _load("train.iterations=4", "cluster.launcher=ray", "placement.rollout_resources={accelerator_type='L40S'}")
    killed: list[tuple[psutil.Process, int]] = []
    bundles: list[dict] = []

    def on_dispatch(device: str, token: dict) -> None:
        # Kill the Ray actor the moment its worker is handed rollout work after step 0; wait until the
        # worker is gone, so the token dies with it whatever the machine's speed.
        if not killed and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            worker = _proc("digenrl-rollout-0")
            assert worker is not None
            bundles.extend(pg["bundles"] for pg in _ours() if pg["state"] == "CREATED")
            ray.kill(ray.get_actor(host_actor_name("rollout-0")))
            worker.wait(timeout=30)
            killed.append((worker, token["batch"]))

    history = await arun_disaggregated(cfg, tmp_path, on_dispatch=on_dispatch)
    assert killed, "the rollout actor was never handed rollout work after step 0"
    assert bundles == [{0: {"CPU": 1.0}, 1: {"CPU": 1.0, "accelerator_type:L40S": 0.001}}]
    assert [m["step"] for m in history] == [0, 1, 2, 3] == [m["step"] for m in _lines(tmp_path)]
    assert all(m["rows_trained"] == ROWS and math.isfinite(m["reward_mean"]) for m in history)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lost_devices"] == ["rollout-0"]
    batch = killed[0][1]
    trace = json.loads((tmp_path / "trace.json").read_text())
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    helped = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tids["trainer-0"]
              and e["cat"] == "rollout" and e["args"]["batch"] == batch]
    assert helped, "the trainer must generate the dead actor's work (TAG)"
    assert all(pg["state"] == "REMOVED" for pg in _ours())


async def test_a_resource_the_cluster_lacks_is_named_before_anything_starts(tmp_path: Path, local_ray) -> None:
    before = len(_ours())
    cfg = _load("cluster.launcher=ray", "placement.trainer_resources={accelerator_type='H100'}")
    with pytest.raises(ConfigError, match=r"placement.trainer_resources: the bundles need accelerator_type:H100 = "
                                          r"0.001 in all, the Ray cluster has 0 \(cluster resources: .*CPU 2"):
        await arun_disaggregated(cfg, tmp_path)
    assert len(_ours()) == before and _proc("digenrl-trainer-0") is None


async def test_killed_ray_actor_of_the_trainer_stops_the_run_with_its_checkpoint(tmp_path: Path, local_ray) -> None:
    cfg = _load("train.iterations=3", "cluster.launcher=ray", "schedule.name=tag", "log.checkpoint_every=1")
    victims: list[psutil.Process] = []

    def on_dispatch(device: str, token: dict) -> None:
        # On-policy: batch 2 trains only after version 2 exists and was checkpointed.
        if not victims and device == "trainer-0" and token["kind"] == "train" and token["batch"] == 2:
            victims.extend(p for p in (_proc(t) for t in ROLES) if p is not None)
            ray.kill(ray.get_actor(host_actor_name("trainer-0")))

    with pytest.raises(RunStopped, match=r"trainer trainer-0 died.*resume with --resume"):
        await arun_disaggregated(cfg, tmp_path, on_dispatch=on_dispatch)
    ckpt = find_checkpoint(tmp_path)
    assert ckpt.name == "step-000002" and load_state(ckpt)["version"] == 2
    # The failed run tears down like a finished one: no role process, the placement group removed.
    assert len(victims) == 2
    _, alive = psutil.wait_procs(victims, timeout=30)
    assert not alive and all(pg["state"] == "REMOVED" for pg in _ours())


def _driver(out: Path, *overrides: str) -> subprocess.Popen[str]:
    """`digenrl run --launcher ray` with a Ray of its own (--ray-address local): all of Ray is below it too."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # Ctrl-C as at a terminal: SIGINT raises KeyboardInterrupt in the driver even if this test's own parent
    # started it with SIGINT ignored (a background job), which the child would otherwise inherit.
    main = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from digenrl_cli.main import app; sys.argv[0] = 'digenrl'; app()")
    args = [sys.executable, "-c", main, "run", str(CONFIG), "--launcher", "ray", "--ray-address", "local",
            "--out", str(out), "--set", "train.iterations=1000", "--set", "rollout.prompts_per_batch=8",
            "--set", "schedule.fragment_groups=4", "--set", "schedule.train_pack=32", "--set", "log.image_every=0"]
    for item in overrides:
        args += ["--set", item]
    return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _running(driver: subprocess.Popen[str], out: Path) -> list[psutil.Process]:
    """Wait for the first optimizer step (event: its metrics line), then every process below the driver."""
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
        assert driver.poll() is None, driver.stdout.read() if driver.stdout else ""
        time.sleep(0.2)
    procs = psutil.Process(driver.pid).children(recursive=True)
    titles = {" ".join(p.cmdline()) for p in procs if p.is_running()}
    assert all(any(role in t for t in titles) for role in ROLES), titles
    assert any("raylet" in t for t in titles), titles
    return procs


@pytest.mark.slow  # ~19 s; the Ray run and a lost actor stay in every run
def test_ctrl_c_of_the_driver_removes_every_process_of_the_run(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "log.checkpoint_every=0")
    try:
        procs = _running(driver, tmp_path)
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=120)
        assert driver.returncode != 0 and len(_lines(tmp_path)) < 1000  # interrupted, not finished
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        assert "removed placement group" in output, output[-2000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _ray_stop(procs: list[psutil.Process], grace: float = 1.0) -> None:
    """What `ray stop --grace-period 3` does to these processes of one Ray (never run it here: it stops every Ray on
    the machine): the raylet, then the others (workers, agents), then the GCS; each group SIGTERM, then SIGKILL
    after its share of the grace period. The digenrl workers are not Ray's: they end with their Ray actors."""
    def name(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            return ""

    raylet = [p for p in procs if "raylet/raylet" in name(p)]
    gcs = [p for p in procs if "gcs_server" in name(p)]
    for group in (raylet, [p for p in procs if p not in raylet and p not in gcs], gcs):
        for p in group:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        for p in psutil.wait_procs(group, timeout=grace)[1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.mark.slow  # ~17 s
def test_ray_stop_mid_run_stops_it_with_a_resume_hint_and_leaves_no_process(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "log.checkpoint_every=1")
    try:
        procs = _running(driver, tmp_path)
        while not (tmp_path / "checkpoints" / "latest").is_file():  # event: a checkpoint to resume from
            assert driver.poll() is None
            time.sleep(0.2)
        _ray_stop([p for p in procs if not any(role in " ".join(p.cmdline()) for role in ROLES)])
        output, _ = driver.communicate(timeout=120)
        assert driver.returncode == 1, output[-3000:]
        assert "RunStopped: trainer trainer-0 died" in output and "resume with --resume" in output, output[-3000:]
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        assert find_checkpoint(tmp_path).name.startswith("step-")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
