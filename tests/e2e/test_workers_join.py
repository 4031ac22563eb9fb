"""Waiting for `digenrl worker --join` processes: progress per join, and a deadline that says what to do."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
from pathlib import Path

import pytest

from digenrl.actors import ActorSystem, Worker
from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.recipes.disaggregated import start_cluster
from tests.conftest import child_env, digenrl_command

ROOT = Path(__file__).resolve().parents[2]


async def test_joins_are_reported_and_missing_workers_fail_after_join_timeout(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(ROOT / "configs" / "tiny-qwenimage.toml",
                      ["schedule.name=async1", "placement.workers=2", "placement.join_timeout=0.5",
                       "transport.address=tcp://127.0.0.1:0"])
    async with ActorSystem(address=cfg.transport.address, heartbeat_interval=0.2, heartbeat_timeout=10.0) as system:
        proc = await asyncio.create_subprocess_exec(
            *digenrl_command("worker", "--join", system.address, "--name", "w1"), env=child_env(),
            stdin=subprocess.DEVNULL)
        try:
            # However long the process takes to start, its join is reported as it happens.
            seen: list[tuple[Worker, int]] = []
            [worker] = await system.wait_for_workers(1, timeout=90, on_join=lambda w, k: seen.append((w, k)))
            assert seen == [(worker, 1)] and worker.pid == proc.pid and worker.host == socket.gethostname()

            # The recipe needs two; the one that joined is reported at once, the second never comes.
            with caplog.at_level(logging.INFO, logger="digenrl.recipes"), pytest.raises(ConfigError) as info:
                await start_cluster(system, cfg)
        finally:
            if proc.returncode is None and system.node is None:
                proc.kill()
    assert await asyncio.wait_for(proc.wait(), 30) == 0  # the worker let go when the system closed
    # Host and address: a host name alone does not say which interface the worker serves on.
    assert f"worker 1 of 2 joined from {socket.gethostname()} ({worker.address}, pid {proc.pid})" in caplog.messages
    assert worker.address.startswith("tcp://127.0.0.1:")
    assert str(info.value) == (
        f"1 of 2 workers joined within 0.5 s (hosts: {socket.gethostname()} x1); start the missing ones with "
        f"`digenrl worker --join {system.address}` on each host, or lower placement.workers / raise "
        "placement.join_timeout")
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", system.address)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_join_timeout_is_validated(value: str) -> None:
    with pytest.raises(ConfigError, match=r"placement.join_timeout: must be > 0 seconds"):
        load_config(ROOT / "configs" / "tiny-qwenimage.toml", [f"placement.join_timeout={value}"])
