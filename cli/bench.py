"""`digenrl bench`: benchmarks. `bench bubbles` runs schedules side by side in the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from digenrl_cli._text import escape, examples, print_error

if TYPE_CHECKING:
    from rich.console import Console

    from digenrl.sim.measured import MeasuredCost

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: simulated schedules side by side.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain text, as the main app
)

_EPILOG = examples(
    "digenrl bench bubbles                                  # paper scenarios x all schedules",
    "digenrl bench bubbles --scenario qwen-16 --out runs/bubbles",
    "digenrl bench bubbles --scenario scale-1024 --schedule colocated --schedule async1 --batches 100",
    "digenrl bench bubbles --scenario flux-32 --schedule async1 --schedule verl-omni-async  # digenrl vs a peer",
    "digenrl bench bubbles --scenario my-cluster.toml        # your fleet and workload (see digenrl/sim/user.py)",
    "digenrl bench bubbles --scenario my-cpu.toml --costs runs/real/bubbles.json  # priced with measured costs",
    "digenrl bench bubbles --list",
    "digenrl bench bubbles --real --batches 20 --repeats 3 --out runs/real  # the tiny model, for real, here",
    "digenrl bench bubbles --real --plan-check --out runs/plan-check  # is the planner's choice the measured best?",
)


@bench_app.command("bubbles", epilog=_EPILOG)
def bubbles(
    scenario: list[str] = typer.Option(None, "--scenario", help="Scenario name or a user scenario FILE.toml "
                                       "(repeatable); default: paper + hetero."),
    schedule: list[str] = typer.Option(None, "--schedule", help="Schedule or peer name (repeatable); default: all "
                                       "of digenrl's schedules and the modelled peers."),
    batches: int = typer.Option(20, "--batches", min=2, help="Optimizer steps per simulated run."),
    out: Path = typer.Option(None, "--out", help="Write bubbles.json, trace-*.json and gantt-*.png here."),
    list_: bool = typer.Option(False, "--list", help="List scenarios and schedules, then exit."),
    real: bool = typer.Option(False, "--real", help="Run the tiny model for real here (colocated vs actors) "
                              "beside the calibrated simulator's prediction."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="--real: interleaved rounds; rows report the median run."),
    config: Path = typer.Option(None, "--config", help="--real: the run config (default configs/tiny-qwenimage.toml)."),
    set_: list[str] = typer.Option(None, "--set", help="--real: override a config value, e.g. rollout.prompts_per_batch=8."),
    decomposition: bool = typer.Option(True, "--decomposition/--no-decomposition",
                                       help="With async1 selected: where its gain over each baseline comes from."),
    plan: bool = typer.Option(False, "--plan", help="Run the planned schedule (the model's shipped config, e.g. "
                              "async1) on the split `digenrl plan --fleet` chooses per scenario (marked *)."),
    plan_check: bool = typer.Option(False, "--plan-check", help="--real: measure the plan costs, plan this machine "
                                    "with them, run the planner's top placements (and the shipped one) for real and "
                                    "say whether its first choice is the measured best (exit 1 if not)."),
    top: int = typer.Option(3, "--top", min=1, help="--plan-check: how many of the planner's placements to run."),
    costs: Path = typer.Option(None, "--costs", help="Price the simulated scenarios (and --plan) with the token "
                               "costs this `bench bubbles --real` report measured (its bubbles.json) instead of the "
                               "fitted veRL-Omni utilisations: scenarios of the device type it measured, digenrl's "
                               "schedules. --plan-check: plan with them instead of measuring them first."),
) -> None:
    """Simulate scenarios x schedules (or, with --real, measure them on this machine): samples/s, speedup,
    bubble ratios, staleness, sync share, and the cost source that priced them."""
    if plan_check:
        from digenrl_cli.plan_check import main as check

        if not real:
            typer.secho("--plan-check runs real placements: add --real", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        check(config, set_ or [], batches, repeats, top, out, costs)
        return
    if real:
        if costs is not None:
            typer.secho("--costs with --real: a real run measures its own costs; give --costs to a simulated run "
                        "(--scenario) or to --real --plan-check", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        _real(schedule or None, batches, out, repeats, config, set_ or [])
        return
    from rich.console import Console

    from digenrl.errors import ConfigError
    from digenrl.sim.bench import run_bubbles

    console = Console(width=max(Console().width, 150))
    if list_:
        _list_scenarios(console)
        return
    try:
        from digenrl.sim.measured import MeasuredCost

        measured = MeasuredCost.from_report(costs) if costs is not None else None
        planned = _planned(scenario or None, batches, console, measured) if plan else None
        report = run_bubbles(scenario or None, schedule or None, batches, out, decomposition=decomposition,
                             planned=planned, measured=measured)
    except ConfigError as exc:
        print_error(console, exc, "error")
        raise typer.Exit(2) from exc
    _print_report(console, report, batches)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _list_scenarios(console: Console) -> None:
    """``--list``: the scenarios, schedules and modelled peers."""
    from rich.table import Table

    from digenrl.schedule import SCHEDULES
    from digenrl.sim.peers import PEERS
    from digenrl.sim.profiles import profile
    from digenrl.sim.scenarios import SCENARIOS

    table = Table(title="scenarios")
    for col in ("name", "kind", "model", "testbed", "batch (prompts x G)", "steps / trained"):
        table.add_column(col)
    for s in SCENARIOS.values():
        table.add_row(escape(s.name), escape(s.kind), escape(profile(s.model).name), escape(s.testbed),
                      f"{s.prompts} x {s.group_size}", f"{s.num_steps} / {s.trained_steps}")
    console.print(table)
    console.print("schedules: " + escape(", ".join(SCHEDULES)))
    peers = "; ".join(f"{p.name} = {p.system}" for p in PEERS.values())
    console.print(f"peers (modelled baselines): {escape(peers)}")


def _print_report(console: Console, report: Any, batches: int) -> None:
    """The simulated rows as a table, then what priced them and where their files are."""
    from rich.table import Table

    table = Table(title=f"digenrl bench bubbles ({batches} batches, steady window: warm-up batch excluded)")
    # Names are never cut (rich shrinks the widest columns first at 150 columns): they and the one-word
    # "samples/s" keep their width; the two-word headers wrap instead.
    whole = {"scenario": max([len(r["scenario"]) for r in report.rows] + [8]),
             "schedule": max([len(r["schedule"]) for r in report.rows] + [8]), "samples/s": 9}
    for col in ("scenario", "split R/T", "schedule", "samples/s", "speedup", "bound", "bubble roll", "bubble train",
                "bubble all", "stale", "sync %", "switch %", "aborted %"):
        table.add_column(col, justify="right" if col not in ("scenario", "schedule") else "left",
                         no_wrap=col in whole, min_width=whole.get(col))
    for r in report.rows:
        split = r["split"]
        split_s = f"{split['hybrid']}H" if split["hybrid"] else f"{split['rollout']}/{split['trainer']}"
        split_s += "*" if r.get("planned") else ""
        b = r["bubble_ratio"]
        bound = r["speedup_bound"]
        table.add_row(escape(r["scenario"]), split_s, escape(r["schedule"]), f"{r['samples_per_s']:.3f}",
                      f"{r['speedup_vs_colocated']:.2f}x",
                      f"{bound:.2f}x" if bound else "-", f"{b['rollout']:.1%}", f"{b['trainer']:.1%}", f"{b['overall']:.1%}",
                      str(r["max_staleness"]), f"{r['weight_sync_share']:.2%}", f"{r['switch_share']:.2%}",
                      f"{r['aborted_share']:.1%}")
    console.print(table)
    for r in report.rows:
        if len(r["bubble_by_pool"]) > 1:
            pools = ", ".join(f"{t} {b:.1%}" for t, b in r["bubble_by_pool"].items())
            console.print(escape(f"{r['scenario']} {r['schedule']}: bubble per pool {pools}"))
    if report.decomposition:
        console.print(_decomposition_table(report.decomposition))
    cal = report.calibration
    for name, source in {r["scenario"]: r["cost_source"] for r in report.rows}.items():
        console.print(escape(f"costs {name}: {source}"))
    if "mfu_reward" in cal:
        console.print(f"the utilisations are fitted once to the veRL-Omni colocated run and fixed: mfu_rollout="
                      f"{cal['mfu_rollout']:.3f}, mfu_train={cal['mfu_train']:.3f}, "
                      f"mfu_reward={cal['mfu_reward']:.4f}; the colocated baseline also recomputes old log-probs "
                      f"({cal['old_logprob_passes']:g} forward/row)")
    for note in report.notes:
        console.print(escape(f"note: {note}"))
    for path in report.files[:1]:
        console.print(f"wrote {escape(path)} and {len(report.files) - 1} trace/Gantt files")


def _planned(names: list[str] | None, batches: int, console: Console, measured: MeasuredCost | None = None) -> dict:
    """Scenario -> the split `digenrl plan --fleet` chooses for it (priced as the rows are: ``measured`` costs or
    the fitted utilisations); a scenario it refuses keeps its fixed split."""
    import time

    from digenrl.errors import ConfigError
    from digenrl.plan.fleet import plan_scenario
    from digenrl.sim.bench import DEFAULT_SCENARIOS
    from digenrl.sim.scenarios import scenario as get_scenario
    from digenrl.sim.user import load_scenario

    planned = {}
    for name in names or DEFAULT_SCENARIOS:
        user = load_scenario(name) if name.endswith(".toml") else None
        sc = user.scenario if user is not None else get_scenario(name)
        pools = user.pools if user is not None else None
        start = time.perf_counter()
        try:
            split, result = plan_scenario(sc, pools, final_batches=batches, measured=measured)
        except ConfigError as exc:
            console.print(f"[yellow]plan {escape(sc.name)}: no placement fits ({escape(exc)}); its rows keep the fixed "
                          "split[/yellow]")
            continue
        planned[sc.name] = split
        console.print(escape(f"plan {sc.name}: {result.best.split}, {dict(split.options)} "
                             f"({result.simulations} simulations, {time.perf_counter() - start:.1f} s)"))
    return planned


def _decomposition_table(decomposition: dict) -> object:
    """One row per (scenario, baseline): async1's total gain and each cause's factor, in chain order."""
    from rich.table import Table

    table = Table(title="where async1's gain comes from (each factor: samples/s over the previous link's; "
                        "they multiply to the total)")
    for col in ("scenario", "baseline", "async1 / baseline", "causes, in order"):  # the causes wrap, names never
        table.add_column(col, justify="right" if col == "async1 / baseline" else "left",
                         no_wrap=col in ("scenario", "baseline"))
    for name, chains in decomposition.items():
        for baseline, chain in chains.items():
            causes = "; ".join(f"{link['cause']} {link['factor']:.2f}x" for link in chain["links"][1:])
            table.add_row(escape(name), escape(baseline), f"{chain['total']:.2f}x", escape(causes))
    return table


def _real(schedules: list[str] | None, batches: int, out: Path | None, repeats: int, config: Path | None,
          overrides: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from digenrl.errors import ConfigError
    from digenrl.recipes.bench_real import DEFAULT_CONFIG, run_real_bubbles

    console = Console(width=max(Console().width, 150))
    try:
        report = run_real_bubbles(schedules, batches, out, config=config or DEFAULT_CONFIG, overrides=overrides,
                                  repeats=repeats)
    except ConfigError as exc:
        print_error(console, exc, "error")
        raise typer.Exit(2) from exc
    table = Table(title=f"digenrl bench bubbles --real (tiny Qwen-Image on this machine, {batches} batches, "
                        f"median of {repeats}; warm-up batch excluded)")
    for col in ("scenario", "schedule", "samples/s", "speedup", "vs ceiling", "bubble per actor", "stale",
                "sim samples/s", "sim error", "plan-costs error", "held-out error"):
        table.add_column(col, justify="left" if col in ("scenario", "schedule", "bubble per actor") else "right")
    for r in report["rows"]:
        actors = " ".join(f"{k} {v:.0%}" for k, v in sorted(r["bubble_per_actor"].items()))
        speedup, sim, err = r["speedup_vs_colocated"], r["sim_samples_per_s"], r["sim_error"]
        plan_err, held = r.get("sim_error_plan_costs"), r.get("sim_error_held_out")
        table.add_row(escape(r["scenario"]), escape(r["schedule"]), f"{r['samples_per_s']:.1f}",
                      f"{speedup:.2f}x" if speedup else "-",
                      f"{r['vs_ceiling']:.2f}" if r.get("vs_ceiling") is not None else "-", escape(actors),
                      str(r["max_staleness"]),
                      f"{sim:.1f}" if sim else "-", f"{err:+.0%}" if err is not None else "-",
                      f"{plan_err:+.1%}" if plan_err is not None else "-", f"{held:+.1%}" if held is not None else "-")
    console.print(table)
    cal = report["calibration"]
    if "costs_version" in cal:
        console.print(f"plan costs (calibration.measured_costs, `plan --costs`): per-token overhead "
                      f"{cal['dispatch_s'] * 1e3:.2f} ms, optimizer step {cal['measured_costs']['optim']['overhead_s'] * 1e3:.1f} ms "
                      f"+ all-reduce {cal['allreduce']['seconds_2'] * 1e3:.2f} ms (2 trainers), publication "
                      f"{cal['measured_costs']['publish']['overhead_s'] * 1e3:.1f} ms; the simulator's error with them "
                      f"(plan_error) {_percent(cal['plan_error'])} in sample"
                      + (f", {_percent(cal['held_out_error'])} held out (each row predicted from the others' tokens)"
                         if "held_out_error" in cal else "")
                      + (f"; on the ratio of two splits (placement_error, the planner's tolerance) "
                         f"{cal['placement_error']:.1%} in sample, {cal['placement_error_held_out']:.1%} held out"
                         if cal.get("placement_error_held_out") is not None else ""))
    mix = cal.get("contention", {}).get("mix")
    if mix:
        console.print("contention per running-kind mix (fitted to the actor runs; each busy process's factor): "
                      + escape(", ".join(f"{k} {f:.2f}x" for k, f in mix.items())))
    if out is not None:
        console.print(f"wrote {escape(out / 'bubbles.json')} and per-run traces, metrics and Gantt charts under "
                      f"{escape(out)}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
    app.add_typer(bench_app, name="bench")


from digenrl_cli import bench_tokens  # noqa: E402 - `bench tokens` lives in its own module

bench_tokens.register(bench_app)
