"""Launching and ending actor processes on this host.

Each actor process is a fresh interpreter running ``python -m digenrl.actors._child`` (no fork: a
forked copy of a driver that holds threads, CUDA contexts or sockets is unsafe). It names itself
``digenrl-<actor>`` with setproctitle, joins the system's registry, and hosts one actor.

``ChildProcess`` is the resource holder of one such process. Its ending follows one deadline:
``terminate`` (SIGTERM: the child drains and exits) → wait → ``kill`` (SIGKILL) → wait. A child
leaves SIGINT and SIGTERM to its driver, which stops a run in order on them, until the driver lets
go of it (closes its stdin, at the start of that ladder) or dies: a terminal's Ctrl-C and Slurm's
SIGTERM reach every process of the run. A
``weakref.finalize`` kills the process if the holder is dropped or the interpreter exits without
an explicit stop, so a crashed driver leaves no orphans behind (the child also watches the
driver's heartbeats and, on Linux, gets SIGTERM when the driver dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence

__all__ = ["ChildProcess", "describe_exit"]

log = logging.getLogger(__name__)


def describe_exit(returncode: int | None) -> str:
    """``"exited with code 1"`` / ``"was killed by SIGKILL"`` / ``"is running"``."""
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


# ``python -m digenrl.actors._child`` with its signals left to this driver from the interpreter's first line, before
# the seconds of imports that ``-m`` would begin with: SIGINT ignored (a terminal's Ctrl-C reaches the whole process
# group), SIGTERM obeyed only once the driver let go (its stdin pipe at EOF: ``ChildProcess.stop`` closes it, as does
# the driver's death) or died (Slurm signals every process of a job; the driver stops the run in order first).
_BOOT = """\
import os, runpy, select, signal, sys
parent = os.getppid()
def term(*_):
    if os.getppid() != parent or (select.select([0], [], [], 0)[0] and not os.read(0, 1)):
        sys.exit(143)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, term)
runpy.run_module("digenrl.actors._child", run_name="__main__", alter_sys=True)
"""


def _kill_if_running(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    # The child must import what the driver can (actor classes by module path), as
    # multiprocessing's spawn does by shipping sys.path.
    env = {**os.environ, **(extra or {})}
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    if extra and extra.get("PYTHONPATH"):
        paths.insert(0, extra["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class ChildProcess:
    """One local actor process (see the module docstring).

    Use ``await ChildProcess.launch(...)``; end it with ``await stop(timeout)``.
    """

    def __init__(self, title: str, proc: asyncio.subprocess.Process) -> None:
        self.title = title
        self.proc = proc
        self._finalizer = weakref.finalize(self, _kill_if_running, proc)

    @classmethod
    async def launch(cls, title: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> ChildProcess:
        """Start ``python -m digenrl.actors._child <args>`` (signals deferred to this process, see ``_BOOT``);
        stdout/stderr are inherited.

        ``env`` adds to (or overrides) the driver's environment, e.g. ``CUDA_VISIBLE_DEVICES``.

        Raises:
            OSError: the interpreter could not be started.
        """
        # Children run the runtime: they log at this driver's runtime level.
        level = logging.getLevelName(logging.getLogger("digenrl.actors").getEffectiveLevel())
        # --defer-signals (and _BOOT until it runs): SIGINT and SIGTERM are this driver's to handle.
        argv = [sys.executable, "-c", _BOOT, *args, "--parent-pid", str(os.getpid()), "--defer-signals",
                "--log-level", level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"]
        # stdin: a pipe nobody writes to; its EOF tells the child this driver let go of it (stop(), or its death).
        proc = await asyncio.create_subprocess_exec(*argv, env=_child_env(env), stdin=subprocess.PIPE)
        log.debug("launched %s pid=%d", title, proc.pid)
        return cls(title, proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the process to exit; returns its exit code (negative: killed by that signal)."""
        return await self.proc.wait()

    async def stop(self, timeout: float) -> int:
        """Make sure the process is gone: wait ``timeout`` → SIGTERM → wait → SIGKILL → wait.

        The caller has usually asked the process to exit already (agent ``shutdown``); the first
        wait gives it that chance. Runs to the end even if the caller is cancelled.

        Returns:
            The exit code.
        """
        task = asyncio.ensure_future(self._stop(timeout))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise

    def let_go(self) -> None:
        """Close the child's stdin: from now on it obeys SIGTERM (see ``_BOOT``). Idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()

    async def _stop(self, timeout: float) -> int:
        self.let_go()
        end = time.monotonic() + timeout
        if await self._wait_until(end):
            return self._done()
        log.warning("[shutdown] Process %s: step=terminate pid=%d", self.title, self.pid)
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        # SIGTERM starts a graceful drain in the child; give it part of what is left (>= 0.5 s).
        if await self._wait_until(max(time.monotonic() + 0.5, end)):
            return self._done()
        log.warning("[shutdown] Process %s: step=kill pid=%d", self.title, self.pid)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()
        return self._done()

    async def _wait_until(self, end: float) -> bool:
        try:
            await asyncio.wait_for(self.proc.wait(), max(0.0, end - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def _done(self) -> int:
        self._finalizer.detach()
        code = self.proc.returncode
        assert code is not None
        log.info("[shutdown] Process %s: step=exited pid=%d %s", self.title, self.pid, describe_exit(code))
        return code

    def __repr__(self) -> str:
        return f"ChildProcess({self.title!r}, pid={self.pid}, {describe_exit(self.returncode)})"
