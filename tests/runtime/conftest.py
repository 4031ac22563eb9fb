"""Runtime test fixtures: every test must leave no child processes, fds, tasks or threads behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import psutil
import pytest


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _digenrl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("digenrl-") and t.is_alive()]


@pytest.fixture(autouse=True)
async def no_leaks():
    """Assert that a test closed every process, socket/fd, asyncio task and worker thread it made."""
    fds = _fds()
    tasks = asyncio.all_tasks()
    # Children alive before the test are not its leaks (e.g. multiprocessing's resource tracker, which an
    # earlier test's spawn pool starts and which lives as long as this process).
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    me = asyncio.current_task()
    deadline = time.monotonic() + 5.0
    while True:  # threads of abandoned compute calls and pipes of reaped children go away shortly
        await asyncio.sleep(0.05)
        children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
        stray = [t for t in asyncio.all_tasks() - tasks if t is not me and not t.done()]
        leaked = sorted(_fds() - fds)
        threads = _digenrl_threads()
        if not (children or stray or leaked or threads) or time.monotonic() > deadline:
            break
    assert not children, f"leaked processes: {[(p.pid, p.name()) for p in children]}"
    assert not stray, f"leaked asyncio tasks: {[t.get_name() for t in stray]}"
    links = {fd: _readlink(fd) for fd in leaked}
    assert not leaked, f"leaked file descriptors: {links}"
    assert not threads, f"leaked threads: {threads}"


def _readlink(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
