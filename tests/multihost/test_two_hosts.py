"""The tiny default across two hosts (network namespaces, see netns.py), CURVE on: the same numbers as on one host,
over the zmq and gloo weight lanes, with two trainers on two hosts, and gloo finding its interface untold."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from digenrl.transport.curve import create_keys
from tests.conftest import child_env
from tests.multihost.netns import Hosts
from tests.multihost.runs import assert_close, computed, run_placed, start_driver, start_worker, wait_for


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


def test_a_short_run_across_two_hosts_with_gloo_weights(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """CI's one two-host run: driver + trainer on A, rollout on B, CURVE on, the weights over gloo without
    GLOO_SOCKET_IFNAME (its interface found from the route to the trainer): both steps train, every process exits 0."""
    a, b = hosts.a, hosts.b
    lines = run_placed(hosts, a, [a, b], tmp_path / "run", keys, "transport.weights=gloo")
    assert [m["step"] for m in lines] == [0, 1] and [m["rows_trained"] for m in lines] == [64, 64]
    assert lines[1]["grad_norm"] > 0 and lines[1]["max_staleness"] <= 1
    # The driver's log names where each worker serves from, and says when (timestamped lines).
    log = hosts.a.procs[0].log.read_text()
    assert re.search(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO .*worker 2 of 2 joined from \S+ "
                     rf"\(tcp://{re.escape(b.address)}:\d+, pid \d+\)$", log, re.MULTILINE), log


@pytest.mark.slow
def test_rollout_on_the_other_host_computes_what_one_host_does(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """Driver + trainer on A and rollout on B, then the reverse, equal the run with everything on A, bit for bit."""
    a, b = hosts.a, hosts.b
    one_host = computed(run_placed(hosts, a, [a, a], tmp_path / "one", keys))
    assert computed(run_placed(hosts, a, [a, b], tmp_path / "ab", keys)) == one_host
    assert computed(run_placed(hosts, b, [b, a], tmp_path / "ba", keys)) == one_host
    assert one_host[1]["grad_norm"] > 0 and [m["rows_trained"] for m in one_host] == [64, 64]


@pytest.mark.slow
def test_gloo_weights_across_hosts_without_gloo_socket_ifname(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """transport.weights = gloo with the rollout actor on B learns what the zmq lane does (it hung before: gloo
    bound 127.0.0.1, the address the host name resolves to here)."""
    a, b = hosts.a, hosts.b
    zmq = computed(run_placed(hosts, a, [a, b], tmp_path / "zmq", keys))
    gloo = computed(run_placed(hosts, a, [a, b], tmp_path / "gloo", keys, "transport.weights=gloo"))
    assert_close(gloo, zmq, 1e-6, 1e-9)


@pytest.mark.slow
def test_two_trainers_on_two_hosts_equal_two_on_one(hosts: Hosts, keys: Path, tmp_path: Path) -> None:
    """DDP across hosts (the trainer group's gloo all-reduce, no GLOO_SOCKET_IFNAME) against both trainers on A.

    Which trainer trains which token depends on timing, so the summed gradients agree to rounding."""
    a, b = hosts.a, hosts.b
    sets = ("placement.trainer=2",)
    one = computed(run_placed(hosts, a, [a, a, a], tmp_path / "one", keys, *sets))
    two = computed(run_placed(hosts, a, [a, b, a], tmp_path / "two", keys, *sets))
    assert_close(two, one, 1e-5, 1e-7)


@pytest.mark.slow
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
