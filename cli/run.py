"""`digenrl run` and `digenrl validate`: parse, load the config, call one library function."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from digenrl.errors import ConfigError

_SET_HELP = "Override a config value, e.g. --set train.lr=1e-3 (repeatable; values are TOML literals)."


def _load(config: Path, overrides: list[str] | None):  # noqa: ANN202 (Config; imported lazily)
    from digenrl.config import load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        typer.secho(f"config error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def run(
    config: Annotated[Path, typer.Argument(help="A TOML config, e.g. configs/tiny-qwenimage.toml.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (default runs/<timestamp>).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Train with Flow-GRPO as the config says (the colocated single-process loop)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from digenrl.recipes.colocated import default_out_dir, summarize, train

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = _load(config, set_)
    out_dir = out or (Path(cfg.log.out) if cfg.log.out else default_out_dir())
    console = Console(stderr=True)
    columns = (TextColumn("[bold]iter"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=cfg.train.iterations, info="")

        def show(m: dict[str, float]) -> None:
            info = (f"reward {m['reward_mean']:.4f}±{m['reward_std']:.4f}  clipfrac {m['clipfrac']:.3f}  "
                    f"approx_kl {m['approx_kl']:.1e}  kl {m['kl']:.1e}  zero_std {m['zero_std_ratio']:.2f}  "
                    f"|g| {m['grad_norm']:.2e}  {m['seconds']:.2f}s")
            progress.update(task, advance=1, info=info)

        history = train(cfg, out_dir=out_dir, on_iteration=show)
    s = summarize(history)
    console.print(f"reward: first {s['window']} iters {s['first']:.4f} -> last {s['window']} {s['last']:.4f} "
                  f"(gain {s['gain']:+.4f}); outputs in {out_dir}")


def validate(
    config: Annotated[Path, typer.Argument(help="A TOML config.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
) -> None:
    """Check a config (keys, types, allowed values) without building anything."""
    cfg = _load(config, set_)
    typer.echo(f"{config}: ok ({cfg.model.name}/{cfg.model.preset}, reward {dict(cfg.reward.weights)}, "
               f"{cfg.train.iterations} iterations)")


def register(app: typer.Typer) -> None:
    """Add `run` and `validate` to `app`."""
    epilog = "Example: digenrl run configs/tiny-qwenimage.toml --set train.iterations=60 --out runs/color"
    app.command("run", epilog=epilog)(run)
    app.command("validate", epilog="Example: digenrl validate configs/tiny-qwenimage.toml --set train.lr=1e-3")(validate)
