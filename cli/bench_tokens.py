"""`digenrl bench tokens`: each token's cost on the config's device beside the simulator's (recipes/bench_tokens.py)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from digenrl_cli._text import escape, examples, print_error

_EPILOG = examples(
    "digenrl bench tokens configs/tiny-qwenimage.toml --json runs/tokens.json",
    "digenrl plan configs/tiny-qwenimage.toml --fleet 2xmeasured --costs runs/tokens.json",
    "digenrl bench tokens configs/tiny-qwenimage.toml --max-batch 8 --max-rows 8 --repeats 3 --no-allreduce",
    "digenrl bench tokens configs/qwenimage.toml --set model.device=cuda --json runs/tokens-h100.json  # a GPU",
)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _flops(f: float | None) -> str:
    if not f:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if f >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f}"


def _table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    model, peak = report["model"], report["peak"]
    title = (f"digenrl bench tokens: {model['name']} {model['preset']} ({model['dtype']}) on {model['device']}"
             + (f", {model['threads']} thread(s)" if model["threads"] else "")
             + f"; predicted: the simulator on catalog {report['prediction']['catalog_device'] or '-'}")
    table = Table(title=escape(title))
    for col in ("token", "size", "seconds", "per unit", "FLOPs", "FLOPs run", "MFU", "predicted",
                "measured / predicted", "note"):
        table.add_column(col, justify="left" if col in ("token", "note") else "right")
    explained: set[str] = set()  # a kind's note once, on its first row
    for m in report["rows"]:
        note = "" if m["kind"] in explained else m["note"]
        explained.add(m["kind"])
        table.add_row(escape(m["kind"]), f"{m['size']} {escape(m['unit'])}", _seconds(m["seconds"]),
                      _seconds(m["per_unit_s"]) if m["size"] > 1 else "", _flops(m["flops"]),
                      _flops(m["flops_counted"]),
                      f"{m['mfu']:.2%}" if m["mfu"] is not None else "-", _seconds(m["predicted_s"]),
                      f"{m['ratio']:.3g}" if m["ratio"] is not None else "-", escape(note))
    peak_s = f"{peak['flops_per_s'] / 1e9:.1f} GFLOP/s" if peak["flops_per_s"] else "none"
    table.caption = escape(f"FLOPs: the simulator's count (a train row: {report['train_passes']:g} passes, as it "
                           f"charges); FLOPs run: FlopCounterMode on the call. MFU against {peak_s} ({peak['source']})")
    return table


def _per_sample(p: dict[str, Any]) -> str:
    """One sample's cost on each side and the trainer:rollout ratio (the report's ``per_sample``)."""
    ratio = f"{p['train_to_rollout']:.2f}" if p["train_to_rollout"] is not None else "-"
    return (f"per sample ({p['algorithm']}): rollout {_seconds(p['rollout_s'])} ({p['num_steps']} steps) + decode and "
            f"score {_seconds(p['reward_s'])}; training {_seconds(p['train_s'])} ({p['rows']} rows, each fwd + bwd + "
            f"{p['nograd_forwards_per_row']:g} no-grad forward(s)): trainer:rollout {ratio} measured, "
            f"{p['passes']['train_to_rollout']:.2f} in the simulator's transformer passes")


def tokens(
    config: Annotated[Path, typer.Argument(help="A TOML config, e.g. configs/tiny-qwenimage.toml.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a config value, e.g. "
                                                   "model.device=cuda (repeatable).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the measurements and the costs "
                                                  "`digenrl plan --fleet --costs` reads here.")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=0, help="Largest rollout step batch (decode and "
                                           "reward: at most a fragment); 0: the config's rollout token.")] = 0,
    max_rows: Annotated[int, typer.Option("--max-rows", min=0, help="Largest train pass in rows; 0: the config's "
                                          "train token.")] = 0,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed runs per measurement (median; after "
                                         "one warm-up run).")] = 5,
    allreduce: Annotated[bool, typer.Option("--allreduce/--no-allreduce", help="On a CPU: measure the trainer "
                                            "group's all-reduce between two gloo processes (a few seconds).")] = True,
) -> None:
    """Measure each token of CONFIG on its model.device at its configured size (rollout step over a batch
    sweep, rollout start, train pass over rows, VAE decode, reward, optimizer step, weight publication, the
    all-reduce) with FLOPs, MFU and the simulator's prediction beside each; --json writes them with the
    costs `digenrl plan CONFIG --fleet Nx<device> --costs OUT` plans with."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from digenrl.config import load_config
    from digenrl.errors import ConfigError
    from digenrl.recipes.bench_tokens import run_token_bench

    console = Console(width=max(Console().width, 150))
    try:
        cfg = load_config(config, set_ or [])
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("building the model", total=None)
            report = run_token_bench(cfg, max_batch=max_batch, max_rows=max_rows, repeats=repeats,
                                     allreduce=allreduce,
                                     progress=lambda label, done, total: bar.update(
                                         task, description=escape(label), completed=done, total=total))
    except ConfigError as exc:
        print_error(console, exc, "config error")
        raise typer.Exit(2) from exc
    console.print(_table(report))
    console.print(escape(_per_sample(report["per_sample"])))
    cal = report["calibration"]
    for note in cal["fit_notes"]:
        console.print(escape(f"- {note}"))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({**report, "config": str(config), "overrides": set_ or []}, indent=1))
        fleet = f"2x{cal['device']}" if cal["device"] else "2x<catalog device>"
        sets = "".join(f" --set {shlex.quote(item)}" for item in set_ or [])
        console.print(escape(f"wrote {json_out}: digenrl plan {config}{sets} --fleet {fleet} --costs {json_out}"))


def register(app: typer.Typer) -> None:
    """Add `tokens` to the `bench` app."""
    app.command("tokens", epilog=_EPILOG)(tokens)
