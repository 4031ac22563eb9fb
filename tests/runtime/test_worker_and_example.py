"""`digenrl worker --join` as a real subprocess over tcp, and the embedding example end to end."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from _actors import BadSetup, Counter
from digenrl.actors import ActorSystem
from digenrl.errors import ConfigError, RemoteError
from tests.conftest import child_env, digenrl_command

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return child_env(Path(__file__).parent)  # _actors, like the driver


async def test_worker_joins_over_tcp_and_hosts_actors() -> None:
    async with ActorSystem(address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=10.0) as system:
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", system.address)
        proc = await asyncio.create_subprocess_exec(
            *digenrl_command("worker", "--join", system.address, "--name", "w1", "--allow", "_actors:Counter",
                             "--allow", "_actors:BadSetup"), env=_env(),
            stdin=subprocess.DEVNULL)
        try:
            [worker] = await system.wait_for_workers(1, timeout=90)
            assert worker.name == "w1" and worker.pid == proc.pid
            assert worker.address.startswith("tcp://127.0.0.1:")
            assert psutil.Process(proc.pid).cmdline()[0] == "digenrl-w1"

            a = await system.spawn(Counter, name="a", on=worker)
            b = await system.spawn(Counter, 100, name="b", on=worker)
            assert await a.pid.call() == await b.pid.call() == proc.pid
            assert await a.call_peer.call(b, 5) == 105  # actor-to-actor inside the worker
            with pytest.raises(RemoteError) as info:
                await system.spawn(BadSetup, name="bad", on=worker)
            assert info.value.where == "bad.setup()" and "_load_weights_that_are_missing" in info.value.remote_traceback
            await system.stop(b)
            with pytest.raises(RemoteError, match="no actor named 'b'"):
                await b.add.call(1)
            assert await a.add.call(1) == 1
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
    # The worker lets go when the system shuts down, and exits cleanly.
    assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_wildcard_system_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="wildcard"):
        async with ActorSystem(address="tcp://0.0.0.0:0"):
            pass


def test_hello_actor_example_runs_across_two_processes() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "hello_actor.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    m = re.fullmatch(r"hello world #1 from pid (\d+) \(driver pid (\d+)\)", first)
    assert m and m[1] != m[2], out.stdout  # the greeting came from another process
    assert second == f"hello again #2 from pid {m[1]}"  # the same actor kept its state
    assert not psutil.pid_exists(int(m[1]))


async def test_worker_exits_when_the_system_dies() -> None:
    async with ActorSystem(address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=3.0,
                           shutdown_timeout=2.0) as system:
        proc = await asyncio.create_subprocess_exec(
            *digenrl_command("worker", "--join", system.address, "--name", "orphan", "--allow", "_actors:Counter",
                             "--join-deadline", "5"),
            env=_env(),
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            [worker] = await system.wait_for_workers(1, timeout=90)
            a = await system.spawn(Counter, name="a", on=worker)
            assert await a.add.call(1) == 1
            assert system.node is not None
            await system.node.transport.aclose()  # the driver "crashes": its endpoint vanishes unannounced
            code = await asyncio.wait_for(proc.wait(), 30)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        finally:
            stderr = (await proc.stderr.read()).decode() if proc.stderr else ""
    assert code == 1, stderr  # orphaned, not a clean shutdown
    assert "step=orphaned" in stderr and "[shutdown] Actor a: step=closed" in stderr
    # It tried to rejoin (the default: the link might come back), and gave up at its deadline.
    assert "joining it again as a fresh worker" in stderr and "did not take this worker within 5 s" in stderr
