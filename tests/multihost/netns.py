"""Two hosts on one machine: Linux network namespaces joined by a veth pair, and the processes run in them.

Each :class:`Host` is a network namespace with loopback up and one end of a veth pair addressed from
198.18.0.0/15 (RFC 2544's benchmarking range: never routed, never anyone's real network). Processes
started with :meth:`Host.start` run inside it (``ip netns exec``); the filesystem, users and host name
are the machine's, as on two hosts sharing a checkout.

Cleanup never depends on the test getting that far: :meth:`Hosts.close` kills every process whose
network namespace is one of ours (``ip netns pids``: our processes and anything they forked, and no
other process of the machine; ``ray stop`` would stop every Ray process here), then deletes the
namespaces, which deletes the veth ends inside them. It runs from the fixture's teardown (a failed
test, Ctrl-C) and ``atexit``; a run killed outright leaves namespaces named after its pid, which the
next run removes (:func:`sweep_leftovers`). Names carry the pid and a counter, so runs side by side
never meet.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

__all__ = ["Host", "Hosts", "Proc", "unavailable", "make_hosts", "sweep_leftovers"]

PREFIX = "dgmh"  # every namespace and veth this suite makes starts with it
SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "multi-host tests make network namespaces: they need root"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2's `ip` command"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Proc:
    """A process started in a host, with its combined output in ``log``."""

    popen: subprocess.Popen[bytes]
    log: Path
    argv: Sequence[str]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float) -> int:
        """Its exit code; AssertionError with its log's tail when it runs past ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.argv[0]} still running after {timeout:g} s:\n{self.tail()}") from None

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.log} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL its process group (it and the children it started)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=10)


@dataclass
class Host:
    """One network namespace: ``address`` on ``iface``, reaching its peers over the veth pair."""

    netns: str
    address: str
    iface: str
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, argv: Sequence[str], log_name: str, env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` inside this host in a session of its own, its output in ``logs/log_name``."""
        log = self.logs / log_name
        with log.open("wb") as out:
            popen = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        proc = Proc(popen, log, list(argv))
        self.procs.append(proc)
        return proc

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a short command inside this host."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True, text=True, timeout=60)

    def link(self, up: bool) -> None:
        """Take this host's veth end down or up (a cable pulled and plugged back)."""
        _ip("-n", self.netns, "link", "set", self.iface, "up" if up else "down")

    def shape(self, rate_bits_per_s: float) -> None:
        """Hold what this host sends down its veth end to ``rate_bits_per_s`` (a ``tc`` token bucket, ``tbf``).

        Egress only: a link slow both ways shapes both hosts. The bucket holds 2 ms of the rate (at least 8 KiB),
        enough for the kernel's timers to keep up at 500 Mbit/s (with 8 KiB it carried 290-350), so n bytes take
        at least ``(n - burst) / rate`` on the wire; the queue holds 400 ms of it, as a slow WAN's buffers do.
        A second call changes the rate. AssertionError with tc's message when tc cannot do it."""
        burst = max(8192, int(rate_bits_per_s * 2e-3 / 8))
        self._tc("qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", f"{int(rate_bits_per_s)}bit",
                 "burst", str(burst), "latency", "400ms")

    def unshape(self) -> None:
        """Take the token bucket off this host's veth end (nothing to do when it has none)."""
        if "tbf" in self._tc("qdisc", "show", "dev", self.iface):
            self._tc("qdisc", "del", "dev", self.iface, "root")

    def _tc(self, *args: str) -> str:
        done = self.exec("tc", *args)
        assert done.returncode == 0, f"tc {' '.join(args)} in {self.netns}: {done.stderr.strip()}"
        return done.stdout

    def pids(self) -> list[int]:
        """Every process in this namespace (ours and whatever they forked)."""
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process in this namespace until none is left (children forking meanwhile included)."""
        end = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < end:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in self.procs:  # reap our direct children
            try:
                proc.popen.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


class Hosts:
    """Hosts A and B (``hosts.a``, ``hosts.b``) joined by one veth pair; :meth:`close` removes everything."""

    def __init__(self, logs: Path, count: int = 2) -> None:
        tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.hosts: list[Host] = []
        self._made: list[str] = []  # namespaces and veths made so far, for a close after a partial setup
        self._closed = False
        atexit.register(self.close)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(count):
                self._made.append(f"{tag}{'ab'[i]}")
                _ip("netns", "add", self._made[-1])
            # The veth ends are named as their namespaces (at most 4 + 7 + 1 + 2 + 1 = 15 characters, Linux's limit).
            names = [f"{tag}{'ab'[i]}" for i in range(count)]
            _ip("link", "add", names[0], "type", "veth", "peer", "name", names[1])
            for i in range(count):
                netns = f"{tag}{'ab'[i]}"
                _ip("link", "set", names[i], "netns", netns)
                _ip("-n", netns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", names[i])
                _ip("-n", netns, "link", "set", names[i], "up")
                _ip("-n", netns, "link", "set", "lo", "up")
                self.hosts.append(Host(netns, f"{SUBNET}.{i + 1}", names[i], logs))
        except BaseException:
            self.close()
            raise

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def logs(self) -> str:
        """Every process's log tail, for a failure message."""
        return "\n".join(p.tail() for h in self.hosts for p in h.procs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            host.kill_all()
        for name in self._made:
            # A veth still in the machine's namespace (a setup that failed before moving it); deleting a
            # namespace deletes the veth end inside it.
            _ip("link", "del", name, check=False)
            _ip("netns", "del", name, check=False)
        atexit.unregister(self.close)


def make_hosts(logs: Path) -> Hosts:
    sweep_leftovers()
    return Hosts(logs)


def sweep_leftovers() -> None:
    """Remove namespaces an earlier run of this suite left behind when it was killed (its pid is gone)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        match = re.match(rf"({PREFIX}(\d+)x\d+[ab])\b", line)
        if match is None or psutil.pid_exists(int(match.group(2))):
            continue
        name = match.group(1)
        for pid in map(int, _ip("netns", "pids", name, check=False).stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
