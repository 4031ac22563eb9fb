"""Actors in their own processes: real interpreters, real ZeroMQ, real signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import psutil
import pytest

from _actors import BadSetup, Counter, Cruncher
from digenrl.actors import ActorRef, ActorSystem
from digenrl.errors import ActorDied, RemoteError


async def test_process_actors_serve_and_shut_down_cleanly(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="digenrl")
    marker = tmp_path / "cleanup.txt"
    async with ActorSystem(heartbeat_interval=0.2, heartbeat_timeout=1.5, shutdown_timeout=3.0) as system:
        c, w = await asyncio.gather(
            system.spawn(Counter, name="counter", process=True, env={"CUDA_VISIBLE_DEVICES": "3"}),
            system.spawn(Cruncher, str(marker), name="cruncher", process=True),
        )
        assert await c.getenv.call("CUDA_VISIBLE_DEVICES") == "3"  # per-process device pinning
        pids = [await c.pid.call(), *(x.pid for x in system._workers.values() if x.name == "cruncher")]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        titles = {" ".join(psutil.Process(p).cmdline()).split()[0] for p in pids}
        assert titles == {"digenrl-counter", "digenrl-cruncher"}  # what `ps` shows

        # FIFO across the process boundary, and errors with their traceback.
        assert await asyncio.gather(*(c.add.call(k) for k in range(1, 51))) == [k * (k + 1) // 2 for k in range(1, 51)]
        with pytest.raises(RemoteError) as info:
            await c.fail.call("over the wire")
        assert info.value.where == "counter.fail" and "_helper_that_raises" in info.value.remote_traceback
        with pytest.raises(RemoteError, match="no endpoint 'nope'"):
            await ActorRef.from_dict(c.ref.to_dict(), node=system.node).call("nope")  # untyped: checked remotely

        # Long compute (longer than the heartbeat timeout) while control calls are served.
        crunch = w.crunch.call(5)
        busy = w.busy.call(2.5)
        assert await w.poke.call() == 1
        assert await crunch == 10
        for _ in range(5):
            assert await w.is_started.call()  # answered while `busy` holds the compute thread
            await asyncio.sleep(0.3)
        assert (await busy).startswith("digenrl-cruncher")
        assert await c.add.call(0) == 1275  # nobody was declared dead meanwhile
        assert len(system._workers) == 2
        # Shut down while a compute call holds the cruncher far past the deadline: the drain times
        # out, the call is aborted, cleanup still runs, and the process exits although its compute
        # thread cannot be interrupted.
        stuck = w.busy.call(120)
        queued = c.sleep.call(0.2)  # finishes within the deadline: drained, not aborted
    assert await queued == "slept"
    with pytest.raises((RemoteError, ActorDied)):
        await stuck
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert marker.read_text() == "cleanup exc=None"
    shutdown = [r.getMessage() for r in caplog.records if "[shutdown]" in r.getMessage()]
    for name in ("counter", "cruncher"):
        assert any(f"Process digenrl-{name}: step=exited" in m and "code 0" in m for m in shutdown), shutdown
    assert shutdown[-1] == "[shutdown] ActorSystem system: step=closed"


async def test_setup_failure_in_a_process_reaches_the_spawner() -> None:
    async with ActorSystem() as system:
        with pytest.raises(RemoteError) as info:
            await system.spawn(BadSetup, name="bad", process=True)
        err = info.value
        assert err.where == "bad.setup()" and err.exc_type == "FileNotFoundError"
        assert "weights.safetensors not found" in err.message
        assert "_load_weights_that_are_missing" in err.remote_traceback
        assert not system._workers  # its process was stopped (the fixture checks it is gone)


async def test_killed_or_hung_process_raises_actor_died(caplog) -> None:
    caplog.set_level(logging.INFO, logger="digenrl")
    # Heartbeats cannot be what notices the kill: their timeout (60 s) is far beyond the wait below.
    async with ActorSystem(heartbeat_interval=0.2, heartbeat_timeout=60.0, shutdown_timeout=3.0) as system:
        a, b = await asyncio.gather(
            system.spawn(Counter, name="victim", process=True),
            system.spawn(Counter, name="bystander", process=True),
        )
        a_pid, b_pid = await a.pid.call(), await b.pid.call()
        pending = a.sleep.call(60)
        relayed = b.call_peer.call(a, 1)  # b -> a, queued behind the sleep
        await asyncio.sleep(0.2)

        os.kill(a_pid, signal.SIGKILL)
        with pytest.raises(ActorDied) as info:
            await asyncio.wait_for(pending, 10)  # the process sentinel or the link, not heartbeats
        # Whichever sees it first: the process sentinel or the transport's disconnect event.
        assert info.value.actor == "victim"
        assert "SIGKILL" in info.value.reason or "disconnected" in info.value.reason
        with pytest.raises(ActorDied):  # later calls fail at once
            await a.add.call(1)
        # The other process's call to the dead actor fails too (dead notice / transport).
        with pytest.raises(RemoteError) as relay:
            await asyncio.wait_for(relayed, 10)
        assert relay.value.exc_type == "digenrl.errors.ActorDied" and "victim" in relay.value.message
        assert await b.add.call(2) == 2  # and the bystander is fine

        # A process that hangs (stopped, not dead) is found by heartbeats, then killed.
        system.heartbeat_timeout = 2.0
        os.kill(b_pid, signal.SIGSTOP)
        with pytest.raises(ActorDied) as info:
            await asyncio.wait_for(b.sleep.call(60), 15)
        assert info.value.actor == "bystander"
        assert "no heartbeat" in info.value.reason or "transport broken" in info.value.reason
    assert not psutil.pid_exists(b_pid) or psutil.Process(b_pid).status() == psutil.STATUS_ZOMBIE
    # A stopped process ignores SIGTERM: the ladder went on to SIGKILL.
    steps = [r.getMessage() for r in caplog.records if "Process digenrl-bystander" in r.getMessage()]
    assert [m.split()[3] for m in steps] == ["step=terminate", "step=kill", "step=exited"], steps
    assert "was killed by SIGKILL" in steps[-1]
