"""Entry point of a local actor process: ``python -m digenrl.actors._child --join ADDR --name NAME``.

Launched by ``ChildProcess.launch`` (``ActorSystem.spawn(process=True)``). It names the process
``digenrl-<name>`` (so ``ps`` shows who is who), makes the kernel send it SIGTERM if the driver
dies (Linux; ``--parent-signal SIGKILL`` when its parent is a supervisor whose death means the
process is lost, as a launcher's per-bundle host), configures logging to stderr, and runs ``run_worker``.
``--defer-signals`` (the driver's own children, started through ``process._BOOT``) leaves SIGINT and
SIGTERM to the driver until it lets go of the process or dies. It imports no torch of its
own; an actor module that needs torch imports it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to us when the parent exits, even by SIGKILL (no orphaned actors)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def main(argv: list[str] | None = None) -> int:
    """Parse the launch arguments and serve until the system lets go; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m digenrl.actors._child")
    p.add_argument("--join", required=True, help="the system's address")
    p.add_argument("--name", required=True, help="actor name; the process title becomes digenrl-<name>")
    p.add_argument("--token", default=None)
    p.add_argument("--transport", default="zmq")
    p.add_argument("--listen", default=None)
    p.add_argument("--parent-timeout", type=float, default=30.0)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--parent-signal", default="SIGTERM", choices=("SIGTERM", "SIGKILL"),
                   help="what the kernel sends this process when its parent dies")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--allow", default=None, help="module:Class, the one actor class this process hosts")
    p.add_argument("--keys", default=None, help="the cluster's CURVE keys directory")
    p.add_argument("--event-loop", default=None, help="uvloop or asyncio (default: uvloop when installed)")
    p.add_argument("--defer-signals", action="store_true",
                   help="leave SIGINT and SIGTERM to the parent (the driver) while it lives (see run_worker)")
    args = p.parse_args(argv)

    try:
        import setproctitle

        setproctitle.setproctitle(f"digenrl-{args.name}")
    except ImportError:  # optional nicety; the process still works
        pass
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid, signal.Signals[args.parent_signal])
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s digenrl-{args.name}[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    driver = args.parent_pid if args.defer_signals else None
    if driver is None:  # (deferred: the launcher's bootstrap has set both until the loop runs; see process._BOOT)
        # SIGTERM before the loop installs its handler must still exit cleanly (KeyboardInterrupt-free).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from digenrl.actors.allowlist import AllowList
    from digenrl.actors.loop import run
    from digenrl.actors.worker import run_worker
    from digenrl.transport.curve import load_keys

    try:
        keys = load_keys(args.keys) if args.keys else None
        reason = run(run_worker(args.join, name=args.name, listen=args.listen, transport=args.transport,
                                token=args.token, parent_timeout=args.parent_timeout,
                                allow=AllowList([args.allow] if args.allow else []), keys=keys,
                                defer_signals_to=driver), args.event_loop)
    except Exception:
        logging.getLogger("digenrl.actors").exception("actor process %s failed", args.name)
        return 1
    return 1 if reason == "orphaned" else 0


def _exit(code: int) -> None:
    """Exit without the interpreter's module teardown, as multiprocessing's children do.

    Everything the actor owned is closed by now and ``atexit`` handlers still run; what is skipped
    is the slow garbage collection of modules (over a second with torch loaded), which would
    otherwise eat into the system's shutdown deadline.
    """
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
