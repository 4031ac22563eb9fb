"""`digenrl worker --join tcp://HOST:PORT`: lend this process (and host) to a running system."""

from __future__ import annotations

import asyncio
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
    "# same host (tests, a quick try): loopback is the default --listen",
    "digenrl worker --join tcp://127.0.0.1:5555 --name gpu0",
) + """

Pass --join exactly as the system reports it (ActorSystem.address, logged at start):
tcp://127.0.0.1:5555 and tcp://localhost:5555 are different peers to ZeroMQ.

The worker exits with code 0 when the system shuts down, on SIGTERM/SIGINT, or (code 1) when the
system stops answering heartbeats. Actor classes are imported by module path, so the worker needs
the same code (and PYTHONPATH) as the driver.
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
) -> None:
    """Join a running digenrl system and host the actors it spawns here."""
    from digenrl.actors.worker import run_worker

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
        reason = asyncio.run(run_worker(join, name=name, listen=listen, transport=transport))
    except Exception as exc:  # a clear one-line reason (system unreachable, bad address), not a traceback
        typer.echo(f"digenrl worker: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    if reason == "orphaned":
        raise typer.Exit(1)
