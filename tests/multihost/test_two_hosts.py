"""The tiny default across two hosts (network namespaces, see netns.py), CURVE on: the same numbers as on one host,
over the zmq and gloo weight lanes, with two trainers on two hosts, and gloo finding its interface untold.

The comparisons share their runs (``placed``, made once each); the runs' start-up is the suite's time."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from digenrl.transport.curve import create_keys
from tests.conftest import child_env
from tests.multihost.netns import Hosts
from tests.multihost.runs import Placed, assert_close, computed, start_driver, start_worker, wait_for


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return create_keys(tmp_path / "keys")


def test_hosts_reach_each_other_and_leave_nothing_behind(tmp_path: Path) -> None:
    """The harness itself: two namespaces joined over 198.18.0.0/15, every process in them gone at close."""
    from tests.multihost.netns import make_hosts, _ip

    hosts = make_hosts(tmp_path / "logs")
    try:
        server = hosts.b.start(["python3", "-c", "import socket,time; s=socket.socket(); s.bind(('198.18.0.2', 7000));"
                                " s.listen(); c,_=s.accept(); c.send(b'hi'); time.sleep(600)"], "server.log")
        for _ in range(50):
            got = hosts.a.exec("python3", "-c", "import socket; print(socket.create_connection(('198.18.0.2', 7000), 2)"
                               ".recv(2).decode())")
            if got.returncode == 0:
                break
            time.sleep(0.1)
        assert got.stdout.strip() == "hi", got.stderr
        assert hosts.b.pids() == [server.pid]
        names = [h.netns for h in hosts.hosts]
    finally:
        hosts.close()
    assert server.popen.poll() is not None
    listing = _ip("netns", "list").stdout
    assert not any(name in listing for name in names)
    assert not any(name in _ip("link", "show").stdout for name in names)


def test_rollout_on_the_other_host_computes_what_one_host_does(placed: Placed) -> None:
    """Driver + trainer on A and rollout on B, then the reverse, equal the run with everything on A, bit for bit;
    the driver's log names where each worker serves from, and says when (timestamped lines)."""
    one_host = computed(placed("a:aa"))
    assert computed(placed("a:ab")) == one_host
    assert computed(placed("b:ba")) == one_host
    assert one_host[1]["grad_norm"] > 0 and [m["rows_trained"] for m in one_host] == [64, 64]
    log = next(p for p in placed.hosts.b.procs if p.log.name.endswith("-b-ba-driver.log")).log.read_text()
    assert re.search(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO .*worker 2 of 2 joined from \S+ "
                     rf"\(tcp://{re.escape(placed.hosts.a.address)}:\d+, pid \d+\)$", log, re.MULTILINE), log


def test_gloo_weights_and_two_trainers_across_hosts_without_gloo_socket_ifname(placed: Placed) -> None:
    """Trainer-0 on A, trainer-1 and the rollout actor on B, the weights over gloo: both the trainer group's
    all-reduce and the weight lane cross the hosts, neither told GLOO_SOCKET_IFNAME (gloo bound 127.0.0.1, the
    address the host name resolves to here, and hung). It learns what both trainers on A with the zmq lane do:
    which trainer trains which token depends on timing, so the summed gradients agree to rounding."""
    two = ("placement.trainer=2",)
    across = placed("a:abb", *two, "transport.weights=gloo")
    assert [m["step"] for m in across] == [0, 1] and [m["rows_trained"] for m in across] == [64, 64]
    assert across[1]["grad_norm"] > 0 and across[1]["max_staleness"] <= 1
    assert_close(computed(across), computed(placed("a:aaa", *two)), 1e-5, 1e-7)


def test_a_trainer_group_that_cannot_form_fails_fast_in_one_line(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """trainer-1 on B told to listen on loopback (GLOO_SOCKET_IFNAME=lo): one line naming the addresses, within
    seconds, and no process of the run left on either host."""
    a, b = hosts.a, hosts.b
    driver = start_driver(a, tmp_path / "run", keys, "placement.workers=3", "placement.trainer=2")
    join = f"tcp://{a.address}:5555"
    wait_for(driver, "waiting up to", 120, hosts)
    for k, (host, env) in enumerate([(a, None), (b, child_env(GLOO_SOCKET_IFNAME="lo")), (a, None)]):
        start_worker(host, join, keys, f"w{k}", env=env)
        wait_for(driver, f"worker {k + 1} of 3 joined", 120, hosts)
    t0 = time.monotonic()
    assert driver.wait(60) == 1, hosts.logs()
    failed_in = time.monotonic() - t0
    text = driver.log.read_text()
    assert "TransportBroken: trainer group rank 1 of 2 (rendezvous 198.18.0.1:" in text, hosts.logs()
    assert "lo 127.0.0.1 (GLOO_SOCKET_IFNAME)" in text and "remote traceback" not in text
    assert failed_in < 45
    for host in hosts.hosts:
        for proc in host.procs:
            proc.wait(60)
        assert host.pids() == [], f"{host.netns} still runs {host.pids()}:\n{hosts.logs()}"
