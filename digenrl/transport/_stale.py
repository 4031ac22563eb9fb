"""Housekeeping: files that digenrl processes killed with SIGKILL could not remove.

ZeroMQ ``ipc://`` endpoints leave socket files named ``digenrl-<pid>-<n>.sock`` in the temp dir,
and the shared-memory lane leaves segments ``digenrl-<pid>-<hex>`` in ``/dev/shm`` when a sender
dies before its receiver mapped them. The first ``ZmqTransport`` of a process sweeps both.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time

from digenrl.transport._shm import SHM_DIR

__all__ = ["sweep_stale_once"]

_STALE_SOCK = re.compile(r"^digenrl-(\d+)-\d+\.sock$")
_STALE_SHM = re.compile(r"^digenrl-(\d+)-[0-9a-f]{32}$")

_swept = False


def sweep_stale_once() -> None:
    """Remove ipc socket files and shm segments left by digenrl processes that were killed.

    A SIGKILLed process cannot clean up; its files carry its pid. A socket file is removed only
    if nothing accepts on it (exact, even across pid namespaces); a segment only if its pid is gone
    and it is over a minute old (a live sender's segment loses its name within one message).
    """
    global _swept
    if _swept:
        return
    _swept = True
    for folder, pattern in ((tempfile.gettempdir(), _STALE_SOCK), (SHM_DIR, _STALE_SHM)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            path = os.path.join(folder, name)
            try:
                if m is None or _pid_alive(int(m.group(1))):
                    continue
                if pattern is _STALE_SOCK and _accepting(path):
                    continue
                if pattern is _STALE_SHM and time.time() - os.stat(path).st_mtime < 60:
                    continue
                os.unlink(path)
            except OSError:
                pass  # someone else's, or already gone


def _accepting(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
