"""`digenrl worker --join tcp://HOST:PORT`: lend this process (and host) to a running system."""

from __future__ import annotations

import logging
import os
import socket

import typer

from digenrl_cli._text import examples

_EPILOG = examples(
    "# driver host 10.0.0.1 runs ActorSystem(address=\"tcp://10.0.0.1:5555\") (port 0: a free one);",
    "# addresses are concrete interfaces, because each side replies to the address the other bound",
    "digenrl worker --join tcp://10.0.0.1:5555 --listen tcp://10.0.0.2:0",
    "",
    "# across hosts, CURVE keys are required (the same directory on every host):",
    "digenrl keys create ~/.digenrl/keys",
    "digenrl worker --join tcp://10.0.0.1:5555 --listen tcp://10.0.0.2:0 --keys ~/.digenrl/keys",
    "",
    "# same host (tests, a quick try): loopback is the default --listen",
    "digenrl worker --join tcp://127.0.0.1:5555 --name gpu0",
    "",
    "# host a class of your own besides digenrl's roles",
    "digenrl worker --join tcp://127.0.0.1:5555 --allow mypkg.actors:Greeter",
    "",
    "# a run whose config has a Python reward (reward.models.brightness.python) scores with it here",
    "digenrl worker --join tcp://127.0.0.1:5555 --allow-reward examples/rewards/brightness.py:Brightness",
) + """

Pass --join exactly as the system reports it (ActorSystem.address, logged at start):
tcp://127.0.0.1:5555 and tcp://localhost:5555 are different peers to ZeroMQ.

The worker exits with code 0 when the system shuts down, on SIGTERM/SIGINT, (code 1) when the
system stops answering heartbeats, or (code 3) when the system refuses it: a running `digenrl run`
takes late workers only as extra rollout actors, up to placement.max_rollout.

Actor classes are imported by module path, so the worker needs the same code (and PYTHONPATH) as
the driver; it hosts only digenrl's roles and the classes given with --allow (a peer naming any
other class is refused before anything is imported). Likewise it imports a Python reward file only when
--allow-reward names it: the run's config arrives in a message, and a message never makes it import a file.
"""


def register(app: typer.Typer) -> None:
    """Add the ``worker`` command to ``app``."""
    app.command(epilog=_EPILOG)(worker)


def worker(
    join: str = typer.Option(..., "--join", help="The running system's address, e.g. tcp://10.0.0.1:5555."),
    listen: str | None = typer.Option(
        None, "--listen", help="Where this worker binds (default tcp://127.0.0.1:0; use a routable host across hosts)."
    ),
    name: str | None = typer.Option(None, "--name", help="Worker name in logs and `ps` (default worker-HOST-PID)."),
    transport: str = typer.Option("zmq", "--transport", help="Transport kind; must match the system's."),
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING or ERROR."),
    keys: str | None = typer.Option(None, "--keys", help="CURVE keys directory (digenrl keys create PATH); "
                                    "required off loopback, the same as the system's transport.keys."),
    allow: list[str] | None = typer.Option(None, "--allow", help="Also host this actor class, module:Class "
                                           "(repeatable; digenrl's roles are always allowed)."),
    allow_reward: list[str] | None = typer.Option(
        None, "--allow-reward", help="Let the run's actors here import this Python reward, path/to/file.py:Class "
        "(repeatable; the run's reward.models.<name>.python, as this host sees the file)."),
    allow_algorithm: str | None = typer.Option(
        None, "--allow-algorithm", help="Let the run's actors here import this training algorithm, "
        "path/to/file.py:Class (the run's train.algorithm, as this host sees the file)."),
    event_loop: str | None = typer.Option(
        None, "--event-loop", help="uvloop or asyncio (default: uvloop when installed, as runtime.event_loop)."
    ),
    join_deadline: float = typer.Option(
        120.0, "--join-deadline", help="Seconds to keep trying a system that is not listening yet (a driver still "
        "importing) or not reachable (a link down), here and when rejoining; 0: one try."),
    rejoin: bool = typer.Option(
        True, "--rejoin/--no-rejoin", help="After losing the system's link (a network blip, a driver that died), "
        "join it again as a fresh worker, until --join-deadline (a running run takes it as a new rollout actor "
        "when placement.max_rollout allows); then exit 1. --no-rejoin: exit 1 at once."),
) -> None:
    """Join a running digenrl system and host the actors it spawns here."""
    from digenrl.actors.allowlist import AllowList
    from digenrl.actors.loop import EVENT_LOOPS, run
    from digenrl.actors.worker import run_worker
    from digenrl.errors import ConfigError, JoinRefused
    from digenrl.roles import ROLE_CLASSES
    from digenrl.transport.curve import load_keys

    if event_loop is not None and event_loop not in EVENT_LOOPS:
        typer.echo(f"digenrl worker: --event-loop {event_loop!r} is not one of {', '.join(EVENT_LOOPS)}", err=True)
        raise typer.Exit(2)

    name = name or f"worker-{socket.gethostname()}-{os.getpid()}"
    try:
        import setproctitle

        setproctitle.setproctitle(f"digenrl-{name}")
    except ImportError:
        pass
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s digenrl-{name}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        allowed = AllowList([*ROLE_CLASSES, *(allow or [])])
        if allow_reward:  # (the rewards package imports torch: only then)
            from digenrl.rewards.user import allow_user_reward

            for spec in allow_reward:
                allow_user_reward(spec)
        if allow_algorithm:
            from digenrl.algorithms.user import allow_user_algorithm

            allow_user_algorithm(allow_algorithm)
        cluster_keys = load_keys(keys) if keys else None
        if join_deadline < 0:
            raise ValueError(f"--join-deadline must be >= 0 seconds, got {join_deadline:g}")
    except (ConfigError, ValueError) as exc:
        typer.echo(f"digenrl worker: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        reason = run(run_worker(join, name=name, listen=listen, transport=transport, allow=allowed,
                                keys=cluster_keys, join_deadline=join_deadline, rejoin=rejoin), event_loop)
    except JoinRefused as exc:  # the run does not take this worker: retrying will not help (exit 3)
        typer.echo(f"digenrl worker: the system refused this worker: {exc}", err=True)
        _leave(3)
    except Exception as exc:  # a clear one-line reason (system unreachable, bad address), not a traceback
        typer.echo(f"digenrl worker: {type(exc).__name__}: {exc}", err=True)
        _leave(1)
    _leave(1 if reason == "orphaned" else 0)


def _leave(code: int) -> None:
    """Exit with ``code``, even when an actor's thread is stuck in a native call.

    A collective waiting for a peer that never comes (a trainer group that could not form) ignores
    the drain, and the interpreter would wait for that thread at exit for as long as the collective's
    timeout (minutes): once the worker has closed everything, such threads are abandoned.
    """
    import atexit
    import sys
    import threading

    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in stuck:
        thread.join(timeout=2.0 / len(stuck))
    stuck = [t.name for t in stuck if t.is_alive()]
    if not stuck:
        raise typer.Exit(code)
    logging.getLogger("digenrl.actors.worker").warning("worker exits leaving %d stuck thread(s): %s", len(stuck),
                                                       ", ".join(stuck))
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
