"""`digenrl`: the command-line entry point. Each subcommand lives in its own module and stays thin."""

from __future__ import annotations

import typer

from digenrl_cli import bench, doctor, keys, plan, reference, run, worker

app = typer.Typer(
    name="digenrl",
    help="Disaggregated RL (Flow-GRPO) for diffusion and flow-matching generators.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Help texts are plain text: rich markup would eat config tables such as "[schedule]".
    rich_markup_mode=None,
)


@app.callback()
def main() -> None:
    """Disaggregated RL (Flow-GRPO) for diffusion and flow-matching generators."""


@app.command()
def version() -> None:
    """Print the installed digenrl version."""
    import digenrl

    typer.echo(digenrl.__version__)


run.register(app)
bench.register(app)
plan.register(app)
worker.register(app)
keys.register(app)
doctor.register(app)
reference.register(app)

if __name__ == "__main__":
    app()
