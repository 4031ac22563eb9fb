"""`digenrl run` and `digenrl validate`: parse, load the config, call one library function."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from digenrl_cli._text import examples, print_error

from digenrl.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from digenrl.config import Config
    from digenrl.plan.memory import MemoryPlan

T = TypeVar("T")

_SET_HELP = "Override a config value, e.g. --set train.lr=1e-3 (repeatable; values are TOML literals)."


def _load(config: Path, overrides: list[str] | None) -> tuple[Config, MemoryPlan]:
    """The config and its memory plan, checked as `run` checks them before anything starts (`validate` alike)."""
    from digenrl.config import load_config
    from digenrl.plan.memory import check_memory
    from digenrl.recipes.preflight import preflight

    try:
        cfg = load_config(config, overrides or [])
        preflight(cfg)  # this host, the transport and its keys, Ray, model.init, reward.url
        return cfg, check_memory(cfg)  # every role fits its device (and the GPUs that actors share)
    except ConfigError as exc:
        typer.secho(f"config error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def run(
    config: Annotated[Path, typer.Argument(help="A TOML config, e.g. configs/tiny-qwenimage.toml.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (default runs/<timestamp>). One that "
                                             "holds an earlier run's outputs is refused, unless --resume continues "
                                             "it or --overwrite replaces it.")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue from a run directory or checkpoint.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Remove what an earlier run wrote in --out (its "
                                            "metrics, checkpoints, samples, trace, Gantt, summary, weights, "
                                            "config.json; other files stay) before starting.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    launcher: Annotated[str | None, typer.Option(
        "--launcher", help="Who starts the actor processes: local or ray (= --set cluster.launcher=...).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="The Ray cluster, HOST:PORT (default cluster.address: 'auto', this host's "
        "cluster or a new local one).")] = None,
) -> None:
    """Train with Flow-GRPO as the config says.

    The config's [schedule] name picks the single-process colocated loop (colocated) or the
    disaggregated actors (disaggregated, gap, tsp, tag, async1); --launcher ray places those
    actors' processes with a Ray placement group.

    On a terminal a live table shows each step; elsewhere (Slurm, nohup, a pipe) each step prints
    one line on stdout. Ctrl-C (SIGINT) stops at once, SIGTERM (scancel, a preemption) after the
    step under way and a checkpoint of it (log.term_grace seconds at most); both write the run's
    summary, trace and Gantt, print how to resume, and exit 130 and 143."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,  # the timestamp: as the workers' lines
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    extra = [f"cluster.launcher={launcher}"] if launcher is not None else []
    if ray_address is not None:
        extra += ["cluster.launcher=ray", f"cluster.address='{ray_address}'"] if launcher is None else \
                 [f"cluster.address='{ray_address}'"]
    with _runtime_logs(verbose):
        _run(config, [*(set_ or []), *extra], out, resume, overwrite)


@contextlib.contextmanager
def _runtime_logs(verbose: bool) -> Iterator[None]:
    """The runtime's start/shutdown chatter (here and in the actor processes, which inherit the level)
    only with -v; restored afterwards so an in-process caller keeps its own levels."""
    loggers = [logging.getLogger(name) for name in ("digenrl.actors", "digenrl.transport")]
    saved = [lg.level for lg in loggers]
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)


def _run(config: Path, set_: list[str], out: Path | None, resume: Path | None, overwrite: bool) -> None:
    from rich.console import Console

    from digenrl.recipes.colocated import summarize

    with _stopped_before_start():
        # What --resume and --out name is checked first, in a second, before the config builds anything.
        resumes = _config_errors(_resumed_directory, resume) if resume is not None else None
        if out is not None or resumes is not None:
            _config_errors(_claim, out or resumes, resumes, overwrite, False)
        cfg, plan = _load(config, set_)
        out_dir = _out_dir(cfg, out, resumes)
        _config_errors(_claim, out_dir, resumes, overwrite, True)  # --overwrite removes only a config that loaded
    # Wide enough for the per-iteration metrics even when stderr is not a terminal (logs, CI).
    console = Console(stderr=True, width=max(Console(stderr=True).width, 160))
    n = cfg.train.iterations
    console.print(f"digenrl run: {cfg.schedule.name}, {n} step{'s' if n != 1 else ''}"
                  + (f", resuming {resume}" if resume is not None else "") + f"; outputs in {out_dir}", markup=False)
    history = _run_recipe(cfg, out_dir, resume, console, _command(config, set_))
    s = summarize(history)
    for line in _memory_lines(plan, out_dir):
        console.print(line, markup=False)
    console.print(f"reward: first {s['window']} iters {s['first']:.4f} -> last {s['window']} {s['last']:.4f} "
                  f"(gain {s['gain']:+.4f}); outputs in {out_dir}", markup=False)
    experts: dict[str, int] = {}  # a mixture-of-experts model (Wan2.2 A14B): which expert the trained rows ran
    for m in history:
        for key, n in m.items():
            if key.startswith("rows_by_expert/"):
                experts[key.split("/", 1)[1]] = experts.get(key.split("/", 1)[1], 0) + int(n)
    if experts:
        console.print("trained rows by expert: " + ", ".join(f"{k} {n}" for k, n in experts.items())
                      + " (rows_by_expert/<expert> in metrics.jsonl)", markup=False)


class _Signalled(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = signum


@contextlib.contextmanager
def _stopped_before_start() -> Iterator[None]:
    """SIGINT or SIGTERM while the config is checked: one line and 130 / 143 (the run brings its own handlers,
    digenrl.roles.stop). A SIGINT ignored when we started (a script's background job) stays ignored."""
    import signal
    import threading

    def stop(signum: int, frame: object) -> None:
        raise _Signalled(signum)

    sigs = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()]
    previous = {s: signal.signal(s, stop) for s in sigs}
    try:
        yield
    except _Signalled as exc:
        typer.echo("interrupted before the run started; nothing was written", err=True)
        raise typer.Exit(128 + exc.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _config_errors(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; a ConfigError becomes its one red line and exit code 2."""
    try:
        return fn(*args)
    except ConfigError as exc:
        typer.secho(f"config error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _resumed_directory(resume: Path) -> Path:
    from digenrl.recipes.checkpoint import find_checkpoint, run_directory

    return run_directory(find_checkpoint(resume))


def _claim(out_dir: Path, resumes: Path | None, overwrite: bool, remove: bool) -> None:
    from digenrl.recipes.outputs import check_out_dir, claim_out_dir

    (claim_out_dir if remove else check_out_dir)(out_dir, resumes=resumes, overwrite=overwrite)


def _command(config: Path, set_: list[str]) -> list[str]:
    """The command line that repeats this run (its config and --set values; --resume and --out added by the caller)."""
    return ["digenrl", "run", str(config), *(a for item in set_ for a in ("--set", item))]


def _memory_lines(plan: MemoryPlan, out_dir: Path) -> list[str]:
    """Each GPU process's measured peak beside the memory plan (from the run's summary.json)."""
    import json

    from digenrl.plan.memory import planned_vs_measured

    summary = out_dir / "summary.json"
    peaks = json.loads(summary.read_text()).get("peak_memory", {}) if summary.is_file() else {}
    return [f"memory {m['actor']} on {m['device']}: peak {m['allocated'] / 1e9:.2f} GB allocated "
            f"({m['reserved'] / 1e9:.2f} GB reserved), planned {m['planned'] / 1e9:.2f} GB for the {m['role']} role"
            + (f" ({m['ratio']:.2f}x)" if m["ratio"] else "") for m in planned_vs_measured(plan, peaks)]


def _out_dir(cfg: Config, out: Path | None, resumes: Path | None) -> Path:
    """``--out``, else the resumed run's own directory (it continues there), else ``log.out`` or a new one."""
    from digenrl.recipes.colocated import default_out_dir

    if out is not None:
        return out
    if resumes is not None:
        return resumes
    return Path(cfg.log.out) if cfg.log.out else default_out_dir()


def _run_recipe(cfg: Config, out_dir: Path, resume: Path | None, console: Console,
                command: list[str]) -> list[dict[str, Any]]:
    """The colocated loop or the actors, with the live table; a run that stops says why in one line."""
    import shlex
    from dataclasses import replace

    from digenrl.errors import RemoteError
    from digenrl.recipes.disaggregated import run_disaggregated
    from digenrl.rewards import RewardError
    from digenrl.roles.coordinator import RunStopped
    from digenrl.roles.stop import RunInterrupted

    try:
        return run_disaggregated(replace(cfg, log=replace(cfg.log, live=True)), out_dir, resume)
    except RunInterrupted as exc:  # SIGINT / SIGTERM: in order, with what it takes to continue
        if exc.checkpoint is not None:
            again = f"resume with: {shlex.join([*command, '--resume', str(out_dir)])}"
        else:
            again = f"start again with: {shlex.join([*command, '--out', str(out_dir), '--overwrite'])}"
        console.print(f"{exc}; {again}", markup=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except (RunStopped, ConfigError, RewardError) as exc:  # RewardError: a failing reward, or a spent budget
        print_error(console, exc)
        raise typer.Exit(1) from exc
    except RemoteError as exc:  # a reward that failed inside an actor (reward.on_error = "raise"), or a group
        # across hosts that did not form (TransportBroken names the addresses): its line
        if exc.exc_type.rsplit(".", 1)[-1] not in (*_REWARD_ERRORS, "TransportBroken"):
            raise
        print_error(console, exc.message, exc.exc_type.rsplit(".", 1)[-1])
        raise typer.Exit(1) from exc


_REWARD_ERRORS = ("RewardError", "RewardFailing")


def validate(
    config: Annotated[Path, typer.Argument(help="A TOML config.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
) -> None:
    """Check a config as `digenrl run` does before it starts anything: keys, types and allowed values,
    then what run would refuse (digenrl.recipes.preflight): this host's device and weights, the bind
    address, CURVE keys, Ray, model.init, reward.url, and the memory plan. Every problem is listed; on a
    host that cannot run the config (a login node without its GPUs) the checks only the host that runs it
    can make are listed as left for that host (exit 0 when nothing else is wrong)."""
    from digenrl.config import load_config
    from digenrl.plan.memory import memory_plan, memory_problems
    from digenrl.recipes.preflight import validation

    try:
        cfg = load_config(config, set_ or [])
        found = validation(cfg)
        found.problems += memory_problems(cfg, memory_plan(cfg))
    except ConfigError as exc:  # the config itself: its keys, types and values
        problems, found = getattr(exc, "problems", [str(exc)]), None
    else:
        problems = found.problems
    for problem in problems:
        typer.secho(f"config error: {problem}", fg=typer.colors.RED, err=True)
    if problems:
        raise typer.Exit(2)
    assert found is not None
    left = f"; left for the host that runs it: {len(found.left)} check(s)" if found.left else ""
    typer.echo(f"{config}: ok ({cfg.model.name}/{cfg.model.preset}, reward {dict(cfg.reward.weights)}, "
               f"{cfg.train.iterations} iterations, schedule {cfg.schedule.name}, train.algorithm "
               f"{cfg.train.algorithm}){left}")
    for item in found.left:
        typer.echo(f"  left: {item}")
    for note in found.notes:
        typer.echo(f"  {note}")
    for warning in found.warnings:
        typer.secho(f"  warning: {warning}", fg=typer.colors.YELLOW)


def register(app: typer.Typer) -> None:
    """Add `run` and `validate` to `app`."""
    epilog = examples("digenrl run configs/tiny-qwenimage.toml --out runs/color",
                      "digenrl run configs/tiny-qwenimage.toml --launcher ray   # a Ray placement group",
                      "digenrl run configs/qwenimage.toml --launcher ray --ray-address 10.0.0.1:6379",
                      "digenrl run configs/tiny-qwenimage.toml --set schedule.name=colocated --out runs/colocated",
                      "digenrl run configs/tiny-qwenimage.toml --resume runs/color",
                      "digenrl run configs/tiny-qwenimage.toml --out runs/color --overwrite   # replace that run")
    app.command("run", epilog=epilog)(run)
    app.command("validate", epilog=examples("digenrl validate configs/tiny-qwenimage.toml --set train.lr=1e-3"))(validate)
