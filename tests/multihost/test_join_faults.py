"""Workers across hosts that start before the driver, and a rollout worker cut off by a link blip that comes back."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.transport.curve import create_keys
from tests.multihost.netns import Hosts
from tests.multihost.runs import PORT, metrics, start_driver, start_worker, wait_for


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return create_keys(tmp_path / "keys")


def test_workers_started_before_the_driver_wait_for_it(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """Both workers first (a launcher starting everything at once), the driver only once both found nothing
    there: they keep trying (--join-deadline, 120 s by default) and the run completes."""
    a, b = hosts.a, hosts.b
    join = f"tcp://{a.address}:{PORT}"
    workers = [start_worker(a, join, keys, "early-a"), start_worker(b, join, keys, "early-b")]
    for worker in workers:  # each has tried and found nothing there (a fixed sleep raced their start-up)
        wait_for(worker, "is not reachable yet", 120, hosts)
    driver = start_driver(a, tmp_path / "run", keys, "placement.workers=2")
    assert driver.wait(240) == 0, hosts.logs()
    assert [w.wait(30) for w in workers] == [0, 0], hosts.logs()
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1]


def test_a_rollout_worker_cut_off_by_a_link_blip_rejoins(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """B's link down until its worker gives the system up, then up: the worker joins again as rollout-1, the run
    (the trainer generating meanwhile) loses no step and says it is no longer an uninterrupted run's; SIGTERM then
    stops it after a step with its checkpoint."""
    a, b = hosts.a, hosts.b
    out = tmp_path / "run"
    driver = start_driver(a, out, keys, "placement.workers=2", "placement.max_rollout=2", "train.iterations=400",
                          "log.checkpoint_every=1")
    join = f"tcp://{a.address}:{PORT}"
    wait_for(driver, "waiting up to", 120, hosts)
    start_worker(a, join, keys, "trainer-host")
    wait_for(driver, "worker 1 of 2 joined", 120, hosts)
    rollout = start_worker(b, join, keys, "rollout-host")  # rejoins by default
    wait_for(driver, "step 2/400", 120, hosts)
    b.link(up=False)
    wait_for(rollout, "step=orphaned", 90, hosts)
    b.link(up=True)
    wait_for(driver, "joins the run as rollout-1", 120, hosts)
    wait_for(driver, "replaces lost rollout-0", 120, hosts)
    seen = len(metrics(out))
    deadline = time.monotonic() + 120
    while len(metrics(out)) < seen + 2 and time.monotonic() < deadline:  # rollout-1 at work
        time.sleep(0.5)
    driver.popen.send_signal(signal.SIGTERM)
    assert driver.wait(90) == 143, hosts.logs()
    steps = [m["step"] for m in metrics(out)]
    assert steps == list(range(len(steps))) and len(steps) >= seen + 2  # nothing lost or doubled
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_devices"] == ["rollout-0"] and [r["device"] for r in summary["admitted"]] == ["rollout-1"]
    assert summary["repeats_uninterrupted"] is False
    assert "this run is not the one an uninterrupted run gives" in driver.log.read_text()
    ckpt = find_checkpoint(out)
    assert load_state(ckpt)["version"] == len(steps), hosts.logs()  # intact, and of the last step
    assert rollout.wait(60) == 0, hosts.logs()  # the rejoined worker left when the run let go of it
    assert "joining it again as a fresh worker" in rollout.log.read_text()
