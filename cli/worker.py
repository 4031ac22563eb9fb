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
) + """

Pass --join exactly as the system reports it (ActorSystem.address, logged at start):
tcp://127.0.0.1:5555 and tcp://localhost:5555 are different peers to ZeroMQ.

The worker exits with code 0 when the system shuts down, on SIGTERM/SIGINT, (code 1) when the
system stops answering heartbeats, or (code 3) when the system refuses it: a running `digenrl run`
takes late workers only as extra rollout actors, up to placement.max_rollout.

Actor classes are imported by module path, so the worker needs the same code (and PYTHONPATH) as
the driver; it hosts only digenrl's roles and the classes given with --allow (a peer naming any
other class is refused before anything is imported).
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
    event_loop: str | None = typer.Option(
        None, "--event-loop", help="uvloop or asyncio (default: uvloop when installed, as runtime.event_loop)."
    ),
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
        cluster_keys = load_keys(keys) if keys else None
    except (ConfigError, ValueError) as exc:
        typer.echo(f"digenrl worker: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        reason = run(run_worker(join, name=name, listen=listen, transport=transport, allow=allowed,
                                keys=cluster_keys), event_loop)
    except JoinRefused as exc:  # the run does not take this worker: retrying will not help (exit 3)
        typer.echo(f"digenrl worker: the system refused this worker: {exc}", err=True)
        raise typer.Exit(3) from None
    except Exception as exc:  # a clear one-line reason (system unreachable, bad address), not a traceback
        typer.echo(f"digenrl worker: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    if reason == "orphaned":
        raise typer.Exit(1)
