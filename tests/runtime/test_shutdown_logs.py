"""An orderly shutdown reads as one (issue 29 item 6c): at the default log level nothing calls a peer broken
or dead, in the system or in `digenrl worker --join` processes; a link that really breaks under a pending
call is still reported."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess

import pytest

from _actors import Counter, Lingers
from digenrl.actors import ActorSystem
from digenrl.errors import RemoteError
from test_worker_and_example import _env
from tests.conftest import digenrl_command

pytestmark = pytest.mark.timeout(120)


async def _worker(join: str, name: str) -> asyncio.subprocess.Process:
    # The worker's default log level (INFO), as a user starts it.
    return await asyncio.create_subprocess_exec(
        *digenrl_command("worker", "--join", join, "--name", name, "--allow", "_actors:Counter",
                         "--allow", "_actors:Lingers"), env=_env(), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _ends(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def _alarming(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "is broken" in line or "is dead" in line or " WARNING " in line or " ERROR " in line]


async def test_an_orderly_shutdown_logs_no_broken_or_dead_peer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="digenrl")
    async with ActorSystem(address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=10.0) as system:
        procs = [await _worker(system.address, name) for name in ("w1", "w2")]
        try:
            workers = {w.name: w for w in await system.wait_for_workers(2, timeout=90)}
            # a's cleanup lingers 1 s, so w2 has exited while w1 still serves: w1 sees its link to w2 close.
            a = await system.spawn(Lingers, 1.0, name="a", on=workers["w1"])
            b = await system.spawn(Counter, 100, name="b", on=workers["w2"])
            assert await a.call_peer.call(b, 5) == 105  # a link from w1 to w2, and one back for the reply
        except BaseException:
            for p in procs:
                p.kill()
            raise
    for code, err in [await _ends(p) for p in procs]:
        assert code == 0, err
        assert not _alarming(err), err
    system_lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [m for m in system_lines if "is broken" in m or "is dead" in m], system_lines


async def test_a_link_that_breaks_under_a_pending_call_is_still_reported() -> None:
    async with ActorSystem(address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=10.0) as system:
        procs = [await _worker(system.address, name) for name in ("w1", "w2")]
        try:
            workers = {w.name: w for w in await system.wait_for_workers(2, timeout=90)}
            a = await system.spawn(Lingers, 0.0, name="a", on=workers["w1"])
            b = await system.spawn(Lingers, 0.0, name="b", on=workers["w2"])
            pending = asyncio.ensure_future(a.ask_to_doze.call(b, 60))
            while not await b.is_dozing.call():  # a's call has reached b: w1 waits on w2
                await asyncio.sleep(0.02)
            procs[1].send_signal(signal.SIGKILL)  # w2 dies: not an orderly exit
            with pytest.raises(RemoteError, match="ActorDied"):
                await asyncio.wait_for(pending, 30)
        except BaseException:
            for p in procs:
                p.kill()
            raise
    code, err = await _ends(procs[0])
    assert code == 0, err
    assert any(" WARNING " in line and "is dead" in line and "failed 1 pending call(s) b.doze" in line
               for line in err.splitlines()), err
    await _ends(procs[1])
