"""``digenrl bench bubbles --real --plan-check``: does the planner's choice for this machine win for real?

1. **Calibrate**: ``run_real_bubbles`` with the config's own schedule (and its fine-token run) measures
   the costs ``plan --costs`` reads (``recipes/measure_costs.py``) and the simulator's error with them.
2. **Plan**: ``plan_fleet`` for this machine (``Nxmeasured``, N = the config's rollout + trainer actors)
   with those costs and that error as the tolerance, exactly as ``digenrl plan CONFIG --fleet
   Nxmeasured --costs bubbles.json`` would.
3. **Run**: the planner's best ``top`` placements (and the shipped one, always) for real, each as
   ``digenrl plan --write`` would configure it, in ``repeats`` interleaved rounds (odd rounds in reverse
   order: a position in the round must not decide the verdict); the median run counts.
4. **Verdict**: ``agrees`` when the planner's first choice is of the split (rollout / trainer devices)
   whose best placement measured the highest median samples/s; ``agrees_exactly`` when the first choice
   itself did (token sizes included: placements of one split often differ by less than the noise).
   Otherwise ``separated`` says whether the measured best beat the first choice in more of the paired
   rounds than chance explains (one-sided sign test, p < 0.05): 3 rounds never can (3 of 3 is p =
   0.125), so a difference of a percent between two splits stays "within noise" until enough rounds
   separate them; the command exits 1 only on a separated disagreement.

Nothing here is tuned to one config: it plans and runs whatever the config (and ``--set``) says, so it
can be rerun after the config's train settings change. It lives with the command because it needs both
the planner (``digenrl.plan``) and real runs (``digenrl.recipes``), sibling layers.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from digenrl_cli._text import escape, print_error

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.recipes.bench_real import DEFAULT_CONFIG, _load, run_actors, run_real_bubbles
from digenrl.sim.measured import MeasuredCost
from digenrl.telemetry.stats import summarize

__all__ = ["run_plan_check", "candidate_overrides"]


def candidate_overrides(cand: Any) -> list[str]:
    """The ``--set`` overrides that run a plan candidate (what ``plan --write`` changes, less the GPU type)."""
    return [f"placement.rollout={sum(cand.rollout.values())}", f"placement.trainer={sum(cand.trainer.values())}",
            f"schedule.tag_steps={cand.tag_steps}", f"schedule.fragment_groups={cand.fragment_groups}",
            f"train.rows_per_pass={cand.rows_per_pass}"]


def sign_test_p(wins: int, rounds: int) -> float:
    """One-sided sign test: P(at least ``wins`` of ``rounds`` fair coin flips come up heads)."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2 ** rounds


def run_plan_check(config: Path = DEFAULT_CONFIG, overrides: list[str] | None = None, num_batches: int = 8,
                   repeats: int = 3, top: int = 3, out: Path | None = None, costs: Path | None = None
                   ) -> dict[str, Any]:
    """Calibrate, plan and run the planner's candidates for real (see the module docstring).

    ``costs``: plan with this ``bench bubbles --real`` report's costs (its ``bubbles.json``) instead of
    measuring them first (step 1), e.g. a report of the same config just measured.

    Returns:
        ``calibration`` (the costs planned with), ``plan`` (the planner's output), ``candidates`` (each
        with its planner rank, predicted and measured samples/s and every run), ``agrees``,
        ``first_choice`` and ``measured_best`` (indices into ``candidates``) and ``first_vs_best``
        (the first choice's measured samples/s over the best's).

    Raises:
        ConfigError: a bad config, a colocated schedule (nothing to place), or ``top < 1``.
    """
    import tempfile

    from digenrl.plan.fleet import plan_fleet
    from digenrl.sim.user import fleet_pools

    if top < 1:
        raise ConfigError(f"top={top}: needs at least 1")
    overrides = list(overrides or [])
    base = [*overrides, f"train.iterations={num_batches}", "log.image_every=0", "log.checkpoint_every=0"]
    cfg = load_config(config, base)
    if not cfg.disaggregated:
        raise ConfigError(f"schedule.name = {cfg.schedule.name!r}: the plan check places actors; use an actor schedule")
    tmp = tempfile.TemporaryDirectory() if out is None else None
    root = Path(tmp.name) if tmp is not None else out
    assert root is not None
    root.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        if costs is None:
            bench = run_real_bubbles([cfg.schedule.name], num_batches, root / "calibration", config=config,
                                     overrides=overrides, repeats=repeats)
            cal = bench["calibration"]
        else:
            cal = MeasuredCost.read_calibration(costs)
        measured = MeasuredCost.from_calibration(cal, f"{costs}: calibration" if costs else "calibration")
        tolerance = float(cal.get("placement_error", cal.get("plan_error")) or 0.0)
        fleet = f"{cfg.placement.rollout + cfg.placement.trainer}xmeasured"
        plan = plan_fleet(load_config(config, overrides), fleet_pools(fleet), top=top, measured=measured,
                          tolerance=tolerance, per_split=True)
        # the top placements, the shipped one, and the best of every other split (so every split is tried)
        chosen = list(plan.candidates)
        chosen += [c for c in plan.split_best if all(c.ident != k.ident for k in chosen)]
        runs: list[list[float]] = [[] for _ in chosen]
        loads: list[list[float]] = [[] for _ in chosen]
        for rnd in range(repeats):
            # counterbalanced: odd rounds run the placements in reverse, so none always runs first (in two
            # sessions of 7 rounds in fixed order, the placement run second won 12 of the 14 rounds)
            order = list(enumerate(chosen))
            for i, cand in order[::-1] if rnd % 2 else order:
                run_cfg = load_config(config, [*base, *candidate_overrides(cand)])
                loads[i].append(_load())
                result, _, _ = run_actors(run_cfg, root / f"candidate-{i}" / f"r{rnd}")
                runs[i].append(summarize(result).steady.samples_per_s)
        rows: list[dict[str, Any]] = []
        for i, (cand, sps) in enumerate(zip(chosen, runs, strict=True)):
            median = statistics.median(sps)
            rows.append({"planner_rank": i + 1, "split": cand.split, "shipped": cand.shipped,
                         "tag_steps": cand.tag_steps, "fragment_groups": cand.fragment_groups,
                         "rows_per_pass": cand.rows_per_pass, "overrides": candidate_overrides(cand),
                         "predicted_samples_per_s": cand.samples_per_s, "measured_samples_per_s": median,
                         "samples_per_s_runs": sps, "sim_error": cand.samples_per_s / median - 1.0 if median else None,
                         "busy_cores_before": loads[i]})
        best = max(range(len(rows)), key=lambda i: rows[i]["measured_samples_per_s"])
        wins = sum(b > f for f, b in zip(runs[0], runs[best], strict=True))  # rounds interleave: compare pairwise
        report = {"costs": str(costs) if costs else "measured by this check (calibration/bubbles.json)",
                  "agrees": rows[best]["split"] == rows[0]["split"], "agrees_exactly": best == 0,
                  "measured_best_split": rows[best]["split"], "config": str(config), "overrides": overrides,
                  "fleet": fleet, "num_batches": num_batches, "repeats": repeats, "calibration": cal,
                  "tolerance": tolerance, "plan": plan.to_json(), "candidates": rows, "first_choice": 0,
                  "measured_best": best,
                  "first_vs_best": rows[0]["measured_samples_per_s"] / rows[best]["measured_samples_per_s"],
                  "best_wins_rounds": wins, "sign_test_p": sign_test_p(wins, repeats),
                  "separated": best != 0 and sign_test_p(wins, repeats) < 0.05,
                  "wall_s": time.perf_counter() - start,
                  "definitions": {
                      "agrees": "the planner's first choice is of the split whose best placement measured the highest "
                                "median steady samples/s among those run (the planner's top placements, the shipped "
                                "one and the best placement of every other split)",
                      "agrees_exactly": "the first choice itself measured the highest median samples/s",
                      "best_wins_rounds": "rounds (each runs every placement once, interleaved) in which the measured "
                                          "best ran faster than the first choice",
                      "sign_test_p": "one-sided sign test: the chance of best_wins_rounds or more of `repeats` "
                                     "rounds if the two placements were equally fast",
                      "separated": "the measured best beat the first choice in more rounds than chance explains "
                                   "(sign_test_p < 0.05); otherwise their order is within the round-to-round noise",
                      "sim_error": "predicted (planner, measured costs) / measured median - 1",
                      "tolerance": "the simulator's error with these costs on the ratio of the splits the bench ran "
                                   "(calibration.placement_error; plan_error in reports before it): the shipped "
                                   "placement stays first unless another is predicted faster by more"}}
        if out is not None:
            (out / "plan-check.json").write_text(json.dumps(report, indent=1))
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(config: Path | None, overrides: list[str], num_batches: int, repeats: int, top: int,
         out: Path | None, costs: Path | None = None) -> None:
    """The command: run the check, print the table and the verdict; exit 1 when the planner disagrees."""
    import typer
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    try:
        report = run_plan_check(config or DEFAULT_CONFIG, overrides, num_batches, repeats, top, out, costs)
    except ConfigError as exc:
        print_error(console, exc, "error")
        raise typer.Exit(2) from exc
    table = Table(title=escape(f"digenrl bench bubbles --real --plan-check ({report['fleet']}, {num_batches} batches, "
                               f"median of {repeats}; tolerance {report['tolerance']:.1%} = the simulator's measured "
                               "error)"))
    for col in ("rank", "placement", "tag_steps", "frag_groups", "predicted samples/s", "measured samples/s",
                "samples/s per round", "sim error"):
        table.add_column(col, justify="left" if col == "placement" else "right")
    for i, r in enumerate(report["candidates"]):
        mark = " *" if i == report["measured_best"] else ""
        split = escape(r["split"] + (" (shipped)" if r["shipped"] else ""))
        table.add_row(str(r["planner_rank"]), split, str(r["tag_steps"]),
                      str(r["fragment_groups"]), f"{r['predicted_samples_per_s']:.1f}",
                      f"{r['measured_samples_per_s']:.1f}{mark}", " ".join(f"{v:.0f}" for v in r["samples_per_s_runs"]),
                      f"{r['sim_error']:+.1%}" if r["sim_error"] is not None else "-")
    console.print(table)
    for note in report["plan"]["notes"]:
        console.print(f"note: {escape(note)}")
    best = report["candidates"][report["measured_best"]]
    first = report["candidates"][0]
    ratio = escape(f"the first choice measured {report['first_vs_best']:.3f}x the best placement ({best['split']}, "
                   f"tag_steps {best['tag_steps']}, fragment_groups {best['fragment_groups']})")
    first_split, best_split = escape(first["split"]), escape(best["split"])
    if report["agrees_exactly"]:
        console.print(f"[green]agrees[/green]: the planner's first choice ({first_split}, tag_steps "
                      f"{first['tag_steps']}) is the measured best")
    elif report["agrees"]:
        console.print(f"[green]agrees[/green] on the split ({first_split}): {ratio}")
    elif not report["separated"]:
        console.print(f"[yellow]within noise[/yellow]: the best split measured is {best_split}, but it beat the "
                      f"first choice in {report['best_wins_rounds']} of {repeats} rounds (sign test p = "
                      f"{report['sign_test_p']:.2f}, not < 0.05); {ratio}")
    else:
        console.print(f"[red]disagrees[/red]: the best split measured is {best_split}, faster in "
                      f"{report['best_wins_rounds']} of {repeats} rounds (sign test p = {report['sign_test_p']:.3f}); {ratio}")
    if out is not None:
        console.print(f"wrote {escape(out / 'plan-check.json')}")
    if not report["agrees"] and report["separated"]:
        raise typer.Exit(1)
