"""`digenrl keys create PATH`: the CURVE keys that let a run's processes reach each other across hosts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from digenrl_cli._text import examples

keys_app = typer.Typer(help="Create the cluster's CURVE keys (authentication off loopback).", no_args_is_help=True,
                       rich_markup_mode=None)

_EPILOG = examples(
    "digenrl keys create ~/.digenrl/keys",
    "# then, in the config: [transport] keys = \"~/.digenrl/keys\"  (copy the directory to every host)",
)


@keys_app.command("create", epilog=_EPILOG)
def create(path: Annotated[Path, typer.Argument(help="A new directory for the keys (owner-only).")]) -> None:
    """Write a server and a client CURVE keypair into PATH (mode 0700, secret files 0600)."""
    from digenrl.errors import ConfigError
    from digenrl.transport.curve import create_keys

    try:
        root = create_keys(path.expanduser())
    except ConfigError as exc:
        typer.secho(f"digenrl keys: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote CURVE keys to {root}; set transport.keys = \"{root}\" (and `digenrl worker --keys {root}`), "
               "copy the directory to every host of the run and keep it private")


def register(app: typer.Typer) -> None:
    """Add the ``keys`` command group to ``app``."""
    app.add_typer(keys_app, name="keys")
