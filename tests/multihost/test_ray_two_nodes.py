"""`digenrl run --launcher ray` over a two-node Ray cluster spanning the hosts: a head on A, a node on B.

Ray runs from the venv's `ray start --block` in each namespace (its own --temp-dir each: the hosts share one
filesystem), usage stats off; it is removed by PID with everything else of the hosts (never `ray stop`,
which would stop every Ray process of the machine). Each node advertises a resource naming its host
(`host_a`, `host_b`) so that a test can pin an actor to a host through placement.*_resources.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.transport.curve import create_keys
from tests.conftest import child_env
from tests.multihost.netns import Host, Hosts, Proc, make_hosts
from tests.multihost.runs import Placed, computed, metrics, start_driver, wait_for

pytest.importorskip("ray", reason="the Ray launcher needs the [ray] extra: pip install -e '.[ray]'")

RAY_PORT = 6379


@dataclass
class RayHosts:
    """Hosts A and B with a Ray head on A and a node on B, the run's CURVE keys and a directory for outputs."""

    hosts: Hosts
    keys: Path
    root: Path


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHosts]:
    """One two-node cluster for the module (its tests run in file order: the last kills B's raylet).

    The nodes' --temp-dir parent is short (Ray's unix sockets live under it, 108 bytes at most) and is removed
    after every process in the hosts is gone."""
    root = tmp_path_factory.mktemp("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="dgr", dir="/tmp"))
    hosts = make_hosts(root / "logs")
    try:
        start_ray(hosts, root, ray_tmp)
        yield RayHosts(hosts, create_keys(root / "keys"), root)
    finally:
        hosts.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def ray_env(tmp_path: Path) -> dict[str, str]:
    """Usage stats off, and Ray's token authentication (on by default for a cluster off loopback) with a token of
    this test's own, which every Ray process and the driver read (never the user's ~/.ray/auth_token)."""
    token = tmp_path / "ray-token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    env = child_env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    env.pop("RAY_ADDRESS", None)
    # tests/e2e/test_ray_launcher.py sets it to 0 in this process when collected (its private Ray on loopback);
    # Ray then refuses a second node ("Multi-node Ray clusters are not supported on Windows and OSX").
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


def start_ray(hosts: Hosts, tmp_path: Path, ray_tmp: Path, cpus: int = 2) -> None:
    """A Ray head on A and a node on B joined to it; returns once both are up."""
    ray = str(Path(sys.executable).parent / "ray")
    common = ["--block", f"--num-cpus={cpus}", "--num-gpus=0", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    for i, host in enumerate(hosts.hosts):
        tag = "ab"[i]
        tmp = ray_tmp / tag
        where = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 0
                 else [f"--address={hosts.a.address}:{RAY_PORT}"])
        proc = host.start([ray, "start", *where, f"--node-ip-address={host.address}", f"--temp-dir={tmp}",
                           f"--resources={json.dumps({f'host_{tag}': 4})}", *common], f"ray-{tag}.log",
                          env=ray_env(tmp_path))
        wait_for(proc, "Ray runtime started", 120, hosts)


def ray_driver(host: Host, out: Path, keys: Path, *sets: str) -> Proc:
    """`digenrl run --launcher ray` on ``host``, the head's (its workers join it over tcp, CURVE on)."""
    return start_driver(host, out, keys, "cluster.launcher=ray", f"cluster.address='{host.address}:{RAY_PORT}'",
                        "cluster.strategy=SPREAD", *sets, env=ray_env(out.parent))


def roles_on(host: Host) -> dict[str, int]:
    """The digenrl role processes (``digenrl-ROLE`` process titles) running in ``host``, by role."""
    out = {}
    for pid in host.pids():
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        for role in ("trainer-0", "rollout-0"):
            if title.startswith(f"digenrl-{role}"):
                out[role] = pid
    return out


def workers_on(host: Host) -> list[int]:
    """Host B's digenrl workers as Ray runs them: each bundle's WorkerHost actor and the worker it started."""
    found = []
    for pid in host.pids():
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "WorkerHost" in title or title.startswith("digenrl-") or "digenrl.actors._child" in title:
            found.append(pid)
    return found


def wait_roles(hosts: Hosts, driver: Proc, timeout: float = 180) -> tuple[dict[str, int], dict[str, int]]:
    """Wait until both roles run, then where: (on A, on B)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        on_a, on_b = roles_on(hosts.a), roles_on(hosts.b)
        if len(on_a) + len(on_b) == 2:
            return on_a, on_b
        assert driver.popen.poll() is None, hosts.logs()
        time.sleep(0.5)
    raise AssertionError(f"the roles did not start within {timeout:g} s:\n{hosts.logs()}")


def wait_steps(out: Path, n: int, driver: Proc, hosts: Hosts, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= n):
        assert driver.popen.poll() is None and time.monotonic() < end, hosts.logs()
        time.sleep(0.3)


def test_ray_spread_over_two_hosts_computes_what_one_host_does(ray_hosts: RayHosts, placed: Placed) -> None:
    """SPREAD puts trainer-0 and rollout-0 on different hosts, and the run equals the one-host run bit for bit."""
    hosts, out = ray_hosts.hosts, ray_hosts.root / "spread"
    driver = ray_driver(hosts.a, out, ray_hosts.keys)
    on_a, on_b = wait_roles(hosts, driver)
    assert len(on_a) == len(on_b) == 1, (on_a, on_b)  # a bundle on each host
    assert driver.wait(240) == 0, hosts.logs()
    assert computed(metrics(out)) == computed(placed("a:aa"))


def test_ray_faults_on_host_b(ray_hosts: RayHosts) -> None:
    """kill -9 of host B's workers (rollout-0 there): its work re-issued, the run completes, no step lost or
    doubled. Then host B's raylet killed under the trainer: the run stops in order, one line saying which node
    died, with an intact checkpoint of its last step."""
    hosts, keys, tmp_path = ray_hosts.hosts, ray_hosts.keys, ray_hosts.root
    a, b = hosts.a, hosts.b
    out = tmp_path / "killed"
    driver = ray_driver(a, out, keys, "train.iterations=4", "placement.trainer_resources={host_a=1}",
                        "placement.rollout_resources={host_b=1}")
    on_a, on_b = wait_roles(hosts, driver)
    assert set(on_a) == {"trainer-0"} and set(on_b) == {"rollout-0"}
    wait_steps(out, 1, driver, hosts)
    victims = workers_on(b)
    assert len(victims) >= 2, victims  # the WorkerHost actor and its worker process
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert driver.wait(240) == 0, hosts.logs()
    lines = metrics(out)
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and all(m["rows_trained"] == 64 for m in lines)
    assert json.loads((out / "summary.json").read_text())["lost_devices"] == ["rollout-0"]

    out = tmp_path / "raylet"
    driver = ray_driver(a, out, keys, "train.iterations=400", "placement.trainer_resources={host_b=1}",
                        "placement.rollout_resources={host_a=1}", "log.checkpoint_every=1")
    on_a, on_b = wait_roles(hosts, driver)
    assert set(on_b) == {"trainer-0"}
    wait_steps(out, 2, driver, hosts)
    raylets = [p for p in b.pids() if "raylet" in " ".join(psutil.Process(p).cmdline()).split(" ")[0]]
    assert len(raylets) == 1, raylets
    t0 = time.monotonic()
    os.kill(raylets[0], signal.SIGKILL)
    assert driver.wait(120) == 1, hosts.logs()
    stopped_in = time.monotonic() - t0
    text = driver.log.read_text()
    assert "RunStopped: trainer trainer-0 died" in text and "resume with --resume" in text, hosts.logs()
    steps = [m["step"] for m in metrics(out)]
    assert steps == list(range(len(steps)))
    ckpt = find_checkpoint(out)
    assert load_state(ckpt)["version"] == int(ckpt.name.removeprefix("step-")) <= len(steps)
    assert stopped_in < 60, stopped_in
    # Ray's report of the dead raylet: one line naming the file that holds its last log lines, not 20 lines here.
    assert "[state-dump]" not in text and "Future exception was never retrieved" not in text, text[-4000:]
    deaths = [line for line in text.splitlines() if "Ray: a node's raylet died unexpectedly" in line]
    assert len(deaths) == 1, text[-4000:]
    report = Path(deaths[0].rsplit("its last log lines are in ", 1)[1])
    assert report.parent == out and "Raylet is terminated" in report.read_text()
