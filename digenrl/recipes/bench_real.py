"""``digenrl bench bubbles --real``: the tiny model trained for real under each schedule, side by side.

:func:`run_real_bubbles` runs, one after the other on this machine and with the same config:

* ``colocated``: the single-process reference loop (:func:`digenrl.recipes.colocated.train`), one
  process using ``placement.threads`` (2) cores;
* each actor schedule (``disaggregated``, ``gap``, ``tsp``, ``tag``, ``async1``): the disaggregated
  recipe, a coordinator plus one process per actor with one torch thread each; a name with the
  suffix ``+reward`` (e.g. ``async1+reward``) adds a reward actor that decodes and scores.

Each row has the simulator's ``bubbles.json`` schema (scenario names start with ``real-``), measured
over the steady window (batch 0's optimizer step excluded), with per-actor bubble ratios and
``sim_error``: the simulator's predicted steady samples/s for the same schedule, devices and workload,
relative to the measured one (``predicted / measured - 1``). The simulator is calibrated from this
bench run itself, never from another machine's figures: with ``colocated`` in the run, from the
one-thread colocated loop's phase timings (rollout, decode + reward, train per unit) and the core
contention (``sim/contention.py``) that ``k`` independent one-thread colocated runs at once
(``real-2x1thread``, and ``real-3x1thread`` when a row runs 3 actor processes) measured in the same
round: the simulator slows every busy device by the slowdown measured for the number busy at that
moment — a prediction made before looking at any actor run. Two more errors separate the causes:
``sim_error_token_fit`` with :class:`MeasuredCost` fitting ``overhead + seconds x units`` per token
kind (units: sample-steps, samples, rows) to every token the actor runs executed (pooled over all
schedules, each token's seconds taken back to its process alone with the measured contention, which
the simulator then applies; without ``colocated`` the raw seconds, and this is ``sim_error``), and
``sim_error_self_calibrated`` fitted to that run's own tokens as measured (no contention model), so
what is left is the schedule and driver dynamics (overlap, waits, pipelining) alone.
The colocated row's simulator input is its own phase timings, so its ``sim_error`` is near zero by
construction.

With an actor schedule the report also carries the costs ``digenrl plan --costs`` reads (costs
version 3, ``recipes/measure_costs.py``): per-kind fits over every actor run's tokens, to which the
first actor schedule at finer tokens (row ``real-<schedule>-fine``) adds a second token size, the
coordinator's per-token overhead, one trainer's optimizer step, the publication and a measured
2-process all-reduce of the trainable set, and the contention per running-kind mix fitted to every
actor run (``sim/contention.py``); and ``plan_error``, the largest |error| of the simulator with those
costs over the actor rows. That error is in sample (the rows are in the fit), so each actor row also
gets ``sim_error_held_out``: the plan costs fitted to every other row's tokens, then asked for this row
(``held_out_error``, the largest). The ``-fine`` row is the calibration run and gets none: no other row
varies a token's size. The config's schedule also runs at every other split of its processes (rows
``real-<schedule>@<r>r<t>t``), and ``placement_error`` is the simulator's error with the plan costs on
the ratio of two splits: what the planner compares on this machine, so its tolerance
(``placement_error_held_out``: the same out of sample, for splits no run had).

With ``colocated`` it also runs ``real-2x1thread``: two independent single-thread colocated runs in
two processes at once, their samples/s summed. No schedule of two one-thread actor processes can
beat that on this machine (no exchange, no bubble; two busy processes share caches and memory
bandwidth, which a lone one-thread run does not show), so it is the ceiling to read the actor rows
against: how far a schedule is from it is the schedule's own loss. ``real-3x1thread`` (three such
runs; only when a row runs three actor processes) is no ceiling: it measures how three busy processes
share this machine's cores, for the contention model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from digenrl.actors.loop import run as run_loop
from digenrl.config import ACTOR_SCHEDULES, load_config
from digenrl.errors import ConfigError
from digenrl.schedule import make_schedule
from digenrl.schedule.base import Device, Role, Token, Workload
from digenrl.sim.contention import Contention, alone_seconds, fit_mix, host_cores
from digenrl.sim.engine import simulate
from digenrl.recipes.measure_costs import measure_allreduce, plan_costs
from digenrl.sim.measured import AllReduce, MeasuredCost
from digenrl.telemetry.spans import Span, Timeline, window_bubbles
from digenrl.telemetry.stats import summarize

log = logging.getLogger(__name__)

__all__ = ["MeasuredCost", "run_real_bubbles", "fine_overrides", "run_actors", "REAL_DEFAULT_SCHEDULES",
           "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
REAL_DEFAULT_SCHEDULES = ("colocated", "disaggregated", "tag", "async1", "async1+reward")


def _colocated(cfg: Any, iterations: int) -> tuple[dict[str, Any], MeasuredCost, Workload]:
    from digenrl.policy import trained_steps
    from digenrl.recipes.colocated import train

    history = train(cfg, write_files=False)
    steady = history[1:] or history
    ro = cfg.rollout
    samples = ro.prompts_per_batch * ro.group_size
    sps = samples * len(steady) / sum(m["seconds"] for m in steady)
    mean = lambda k: statistics.fmean(m[k] for m in steady)  # noqa: E731
    workload = Workload(iterations, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    # Per unit of what the simulator charges: a TRAIN token's transitions are all the batch's rows
    # (it cannot know which groups will have identical rewards), so the same rows divide here.
    cost = MeasuredCost({"rollout": (0.0, mean("t_rollout") / (samples * ro.num_steps)),
                         "reward": (0.0, (mean("t_decode") + mean("t_reward")) / samples),
                         "train": (0.0, mean("t_train") / workload.rows_per_batch), "optim": (0.0, 0.0),
                         "switch": (0.0, 0.0)})
    return {"samples_per_s": sps, "rewards": [m["reward_mean"] for m in history]}, cost, workload


def _colocated_rate(cfg: Any) -> float:
    return _colocated(cfg, cfg.train.iterations)[0]["samples_per_s"]


def _processes(cfg: Any, count: int) -> list[float]:
    """Steady samples/s of each of ``count`` single-thread colocated runs started together in as many processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    one = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, threads=1))
    with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_colocated_rate, [one] * count))


def _slowdown(one_sps: float, rates: list[float]) -> float | None:
    """The slowdown of ``len(rates)`` busy processes: a lone run's samples/s over the mean of them at once."""
    return one_sps / (sum(rates) / len(rates)) if rates and all(rates) else None


def _contention(one_sps: float, rates: dict[int, list[float]]) -> Contention:
    """The :func:`_slowdown` of each measured count of busy processes on this host."""
    return Contention(host_cores(), {k: f for k, r in rates.items() if (f := _slowdown(one_sps, r)) is not None})


def _median_contention(rounds: list[Contention]) -> Contention | None:
    """Per count, the median over rounds of that round's slowdown: one disturbed run of k processes (another
    job's burst) does not set the factor, as the rows take their median run; a round's ratio of its own
    runs cancels what slows the whole round alike."""
    if not rounds:
        return None
    counts = sorted({k for c in rounds for k in c.slowdown})
    return Contention(rounds[0].cores, {k: statistics.median([c.slowdown[k] for c in rounds if k in c.slowdown])
                                        for k in counts})


def _actor_processes(cfg: Any) -> int:
    """Actor processes a disaggregated run of ``cfg`` keeps (one per rollout, trainer and reward actor)."""
    p = cfg.placement
    return p.rollout + p.trainer + p.reward


def _cpu_times() -> tuple[float, float] | None:
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # total, idle + iowait


def _load(sample_s: float = 0.5) -> float:
    """Cores kept busy by other processes just before a run (this bench idles while sampling).

    Linux: busy CPU time over ``sample_s`` from ``/proc/stat``; elsewhere the 1-minute load
    average (which also counts this bench's previous run). Logs a warning above half a core:
    the figures then drift with the other work, which is why rows record it.
    """
    cores = os.cpu_count() or 1
    first = _cpu_times()
    if first is None:
        busy = os.getloadavg()[0]
    else:
        time.sleep(sample_s)
        second = _cpu_times()
        assert second is not None
        total, idle = second[0] - first[0], second[1] - first[1]
        busy = cores * (1.0 - idle / total) if total > 0 else 0.0
    if busy > 0.5:
        log.warning("%.1f of %d cores busy with other work before this run: timings are not comparable", busy, cores)
    return busy


def _row(name: str, schedule: str, result: Timeline, sim: Timeline | None, measured_sps: float,
         wall: float, devices: list[Device]) -> dict[str, Any]:
    st = summarize(result)
    s, f = st.steady, st.full
    per_actor = window_bubbles(result.spans, [d.name for d in devices], s.start, s.end)  # the row's own window
    predicted = summarize(sim).steady.samples_per_s if sim is not None else None
    return {
        "scenario": name, "model": "qwenimage-tiny", "devices": len(devices), "testbed": "measured",
        "schedule": schedule,
        "split": {"rollout": sum(d.role is Role.ROLLOUT for d in devices),
                  "trainer": sum(d.role is Role.TRAINER for d in devices),
                  "hybrid": sum(d.role is Role.HYBRID for d in devices)},
        "samples_per_s": measured_sps, "speedup_vs_colocated": None,
        "bubble_ratio": {"rollout": s.bubble_rollout, "trainer": s.bubble_trainer, "overall": s.bubble_overall},
        "bubble_per_actor": per_actor, "max_staleness": st.max_staleness,
        "weight_sync_share": s.weight_sync_share, "switch_share": s.switch_share,
        "full": {"samples_per_s": f.samples_per_s,
                 "bubble_ratio": {"rollout": f.bubble_rollout, "trainer": f.bubble_trainer, "overall": f.bubble_overall}},
        "num_batches": result.workload.num_batches, "samples_scored": st.samples_scored, "wall_s": wall,
        "tokens": result.tokens, "sim_seconds": 0.0, "speedup_bound": None,
        "sim_samples_per_s": predicted,
        "sim_error": (predicted / measured_sps - 1.0) if predicted and measured_sps else None,
    }


def run_actors(cfg: Any, where: Path) -> tuple[Timeline, list[tuple[Token, float]], list[tuple[Token, float]]]:
    """One real disaggregated run of ``cfg`` (files under ``where``): its timeline, tokens and per-token overheads."""
    from digenrl.recipes.disaggregated import arun_disaggregated

    got: list[Any] = []
    run_loop(arun_disaggregated(cfg, where, on_result=lambda r, log, over: got.append((r, log, over))),
             cfg.runtime.event_loop)
    return got[0]


def _simulated(schedule: str, devices: list[Device], workload: Workload, cost: MeasuredCost,
               options: dict[str, Any] | None = None) -> Timeline:
    """The simulator's run of ``schedule`` with the token sizes the real run had (``options``: the config's)."""
    sched = make_schedule(schedule, devices, workload, cost, **(options or {}))
    return simulate(sched, devices, workload, cost, contention=cost.contention)  # type: ignore[arg-type]


def sim_options(cfg: Any) -> dict[str, Any]:
    """The schedule options a real run of ``cfg`` uses (its token sizes and staleness), for the simulator."""
    return {**cfg.schedule_options, **({"staleness": cfg.schedule.staleness} if cfg.schedule.staleness else {})}


def _median(runs: list[Any], key: Any) -> Any:
    """The run with the median ``key`` (the lower one of an even count): robust to one disturbed run."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


Run = tuple[list[tuple[Token, float]], list[Span]]  # one real run's measured tokens and its spans


def _fit_contention(runs: list[Run], counted: Contention | None, rounds: int = 3
                    ) -> tuple[Contention | None, list[tuple[Token, float]]]:
    """The contention ``counted`` (per number of busy processes) with a factor per running-kind mix
    fitted to ``runs``, and their tokens' seconds alone on the host under it.

    Alternates (``rounds`` times, from the count-based factors): take every token back to its process
    alone, fit the token costs to that, fit the mixes' factors to each token's measured over fitted
    seconds (:func:`~digenrl.sim.contention.fit_mix`). Without ``counted`` (no colocated rows measured
    how processes share the host) the tokens keep their measured seconds.
    """
    if counted is None:
        return None, [t for tokens, _ in runs for t in tokens]
    host = Device("host", Role.HYBRID)
    contention = counted
    for _ in range(rounds):
        cost = MeasuredCost.fit([t for tokens, spans in runs for t in alone_seconds(tokens, spans, contention)])
        contention = fit_mix(runs, lambda token: cost.seconds(token, host), counted)
    return contention, [t for tokens, spans in runs for t in alone_seconds(tokens, spans, contention)]


def _held_out_costs(runs: dict[str, list[Run]], overheads: dict[str, list[float]], allreduce: AllReduce,
                    counted: Contention | None) -> dict[str, MeasuredCost]:
    """Per actor row, the plan costs (and the contention's mix factors) fitted to every other row's runs
    and overheads: the error they give on that row is out of sample. The ``-fine`` row gets none: it is
    the calibration run, the only one whose tokens vary in size, so without it nothing separates a
    token's fixed cost from its work."""
    out = {}
    for row in runs:
        if row.endswith("-fine") or len(runs) < 3:
            continue
        contention, tokens = _fit_contention([r for other, rs in runs.items() if other != row for r in rs], counted)
        try:
            cost = plan_costs(tokens, [o for other, os in overheads.items() if other != row for o in os], allreduce)
        except ValueError:  # the other rows lack a token kind (e.g. no optimizer step): no held-out fit
            continue
        out[row] = dataclasses.replace(cost, contention=contention)
    return out


def other_splits(config: Path, overrides: list[str]) -> list[tuple[int, int]]:
    """(rollout, trainer) actor counts of every other split of the config's rollout + trainer processes
    that it allows (e.g. 0 rollout / 2 trainers when the trainers generate with TAG): the placements the
    planner chooses among on a machine with that many processes."""
    cfg = load_config(config, overrides)
    n, out = cfg.placement.rollout + cfg.placement.trainer, []
    for r in range(n):
        if r != cfg.placement.rollout:
            try:
                load_config(config, [*overrides, f"placement.rollout={r}", f"placement.trainer={n - r}"])
            except ConfigError:  # e.g. no rollout device while the trainers cannot generate
                continue
            out.append((r, n - r))
    return out


def largest_error(rows: list[dict[str, Any]], key: str) -> float | None:
    """The largest ``|error|`` of the rows' ``key`` (``None`` where none has one: a row that completed no
    steady sample has no relative error)."""
    errors = [abs(e) for r in rows if (e := r.get(key)) is not None]
    return max(errors) if errors else None


def placement_error(rows: list[dict[str, Any]], key: str = "sim_error_plan_costs") -> float | None:
    """How far off the simulator is on the *ratio* of two placements of the config's schedule (what the
    planner compares): the largest ``|(1 + e_a) / (1 + e_b) - 1|`` over pairs of its rows at different
    splits (``placement_row``), ``e`` each row's error ``key``. ``None`` with fewer than two splits."""
    errors = [e for r in rows if r.get("placement_row") and (e := r.get(key)) is not None]
    if len(errors) < 2:
        return None
    return max(abs((1 + a) / (1 + b) - 1) for a in errors for b in errors)


def fine_overrides(cfg: Any) -> list[str]:
    """The fine-token calibration run's overrides: a quarter of the fragment size, rollout tokens of
    ``num_steps - 1`` steps (then the rest) and TAG helpers of one.

    With the config's whole-trajectory tokens they vary a rollout token's steps apart from its samples,
    which the per-step term of the plan costs needs (``MeasuredCost.fit``). The rollout device's own
    tokens must do it: TAG helpers of one step ran 3 times in a 20-batch run (3 steps, 2 processes), too
    few to tell a per-step cost from a per-token one; at 3 steps ``step_chunk = 2`` makes every fragment
    one 2-step and one 1-step token.
    """
    groups = max(1, (cfg.schedule.fragment_groups or cfg.rollout.prompts_per_batch) // 4)
    chunk = max(1, cfg.rollout.num_steps - 1)
    return ["schedule.tag_steps=1", f"schedule.fragment_groups={groups}", f"schedule.step_chunk={chunk}"]


_Spec = tuple[str, str, list[str]]  # one row's (row key, schedule, extra overrides)


class _ActorRun(NamedTuple):
    """One round's real run of an actor row."""

    result: Timeline
    tokens: list[tuple[Token, float]]
    wall: float
    devices: list[Device]
    load: float  # busy cores before it
    samples_per_s: float  # steady


def _run_root(out: Path | None, tmp: tempfile.TemporaryDirectory[str] | None) -> Path:
    """Where the runs write their files: ``out`` (created), else the temp dir ``tmp``."""
    root = Path(tmp.name) if tmp is not None else out
    assert root is not None
    root.mkdir(parents=True, exist_ok=True)
    return root


def _checked_schedules(schedules: list[str] | None, num_batches: int, repeats: int) -> list[str]:
    """The schedules to run (default ``REAL_DEFAULT_SCHEDULES``); a bad argument raises ``ConfigError`` naming it."""
    chosen = list(schedules or REAL_DEFAULT_SCHEDULES)
    for s in chosen:
        if s != "colocated" and s.removesuffix("+reward") not in ACTOR_SCHEDULES:
            raise ConfigError(f"unknown schedule {s!r}; known: colocated, {', '.join(ACTOR_SCHEDULES)}")
    if num_batches < 2:
        raise ConfigError(f"num_batches={num_batches}: needs at least 2 (the first batch is the warm-up window)")
    if repeats < 1:
        raise ConfigError(f"repeats={repeats}: needs at least 1")
    return chosen


def _row_specs(chosen: list[str], config: Path, base: list[str], splits: bool, fine_tokens: bool
               ) -> tuple[list[_Spec], str | None]:
    """Every row to run, and the actor schedule that also runs at the other splits and at finer tokens."""
    # (row key, schedule, extra overrides): each chosen schedule, then the fine-token calibration run
    specs = [(s, s, ["placement.reward=1"] if s.endswith("+reward") else []) for s in chosen]
    probe = load_config(config, base)
    actors = [s.removesuffix("+reward") for s in chosen if s != "colocated"]
    # the config's own schedule when it runs here (its TAG helper tokens are what `plan` sizes), else the first
    actor = probe.schedule.name if probe.schedule.name in actors else next(iter(actors), None)
    if splits and actor is not None:
        specs += [(f"{actor}@{r}r{t}t", actor, [f"placement.rollout={r}", f"placement.trainer={t}"])
                  for r, t in other_splits(config, [*base, f"schedule.name={actor}"])]
    if fine_tokens and actor is not None:
        specs.append((f"{actor}-fine", actor, fine_overrides(probe)))
    return specs, actor


def _busy_counts(config: Path, base: list[str], specs: list[_Spec]) -> range:
    """The busy-process counts to measure: 2 (the ceiling) up to the most actor processes a row runs."""
    return range(2, max([2, *(_actor_processes(load_config(config, [*base, *extra])) for s, _, extra in specs
                              if s != "colocated")]) + 1)


def _colocated_rows(cfg: Any, sched: str, num_batches: int) -> tuple[list[dict[str, Any]], MeasuredCost]:
    """A row per thread count of the colocated loop (the config's, then one), and the last run's costs."""
    rows = []
    # Both cores in one process (the baseline), and one core: on a loaded machine a
    # 2-thread OpenMP process can stall at its barriers, so both figures are reported.
    for threads in dict.fromkeys((cfg.placement.threads, 1)):
        start, load = time.perf_counter(), _load()
        threaded = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, threads=threads))
        measured, cost, workload = _colocated(threaded, num_batches)
        devices = [Device("hybrid-0", Role.HYBRID)]
        sim = _simulated("colocated", devices, workload, cost)
        suffix = "" if threads == cfg.placement.threads else f"-{threads}thread"
        row = _row(f"real-colocated{suffix}", sched, sim, sim, measured["samples_per_s"],
                   time.perf_counter() - start, devices)
        row["bubble_per_actor"] = {f"colocated (1 process, {threads} threads)": 0.0}
        row["threads"] = threads
        row["busy_cores_before"] = load
        rows.append(row)
    return rows, cost


def _busy_process_rows(cfg: Any, one: dict[str, Any], counts: range
                       ) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """Per ``k`` in ``counts``, ``k`` one-thread colocated runs at once: their row (the one-thread row ``one``
    with their figures) and each run's samples/s."""
    one_sps, rates, groups = one["samples_per_s"], {}, []
    for k in counts:
        start, load = time.perf_counter(), _load()
        rates[k] = _processes(cfg, k)
        groups.append({**one, "scenario": f"real-{k}x1thread", "devices": k, "samples_per_s": sum(rates[k]),
                       "samples_per_s_processes": rates[k], "wall_s": time.perf_counter() - start,
                       "bubble_per_actor": {f"{k} independent processes, 1 thread each": 0.0},
                       "sim_samples_per_s": None, "sim_error": None, "busy_cores_before": load,
                       "threads": 1, "full": None, "tokens": None,
                       "slowdown": _slowdown(one_sps, rates[k])})
    return groups, rates


@dataclasses.dataclass
class _Measurements:
    """Every round's runs, by row: what the rows and the calibration are made of."""

    runs: dict[str, list[_ActorRun]] = dataclasses.field(default_factory=dict)  # row key -> one per round
    # row key -> every compute token's per-token overhead, all its runs
    overheads: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # row key -> the schedule options its runs used
    options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # colocated scenario -> one row per round
    coloc: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # per round: (1-thread samples/s, its costs + contention)
    predictors: list[tuple[float, MeasuredCost]] = dataclasses.field(default_factory=list)

    def add_colocated(self, cfg: Any, sched: str, num_batches: int, counts: range) -> None:
        """One round of the colocated loop, and of ``k`` one-thread colocated runs at once per ``k`` in ``counts``."""
        rows, cost = _colocated_rows(cfg, sched, num_batches)
        for row in rows:
            self.coloc.setdefault(row["scenario"], []).append(row)
        # One actor process = one thread, slowed as much as k busy processes slow each other.
        one_sps = rows[-1]["samples_per_s"]
        groups, rates = _busy_process_rows(cfg, rows[-1], counts)
        for group in groups:
            self.coloc.setdefault(group["scenario"], []).append(group)
        self.predictors.append((one_sps, dataclasses.replace(cost, contention=_contention(one_sps, rates))))

    def add_actors(self, cfg: Any, sched: str, where: Path) -> None:
        """One round's real disaggregated run of the actor row ``sched`` (files under ``where``)."""
        self.options[sched] = sim_options(cfg)
        start, load = time.perf_counter(), _load()
        result, tokens, over = run_actors(cfg, where)
        self.overheads.setdefault(sched, []).extend(o for _, o in over)
        self.runs.setdefault(sched, []).append(_ActorRun(result, tokens, time.perf_counter() - start,
                                                         list(result.devices), load,
                                                         summarize(result).steady.samples_per_s))


def _measure_rounds(specs: list[_Spec], config: Path, base: list[str], root: Path, num_batches: int,
                    repeats: int, counts: range) -> _Measurements:
    """Every row's runs, interleaved: round 1 runs every row, then round 2..."""
    measured = _Measurements()
    for rnd in range(repeats):
        for sched, name, extra in specs:
            # "<schedule>+reward": the same schedule with a reward actor of its own (decode + score).
            cfg = load_config(config, [*base, f"schedule.name={name.removesuffix('+reward')}", *extra])
            if sched == "colocated":
                measured.add_colocated(cfg, sched, num_batches, counts)
            else:
                measured.add_actors(cfg, sched, root / (f"real-{sched}" + (f"-r{rnd}" if rnd else "")))
    return measured


def _colocated_medians(coloc: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each colocated scenario's median round, listing every round's samples/s."""
    rows = []
    for cand in coloc.values():
        row = _median(cand, lambda r: r["samples_per_s"])
        row["samples_per_s_runs"] = [r["samples_per_s"] for r in cand]
        rows.append(row)
    return rows


@dataclasses.dataclass(frozen=True)
class _Costs:
    """The costs the simulator predicts the actor rows with, one per error a row reports."""

    predictor: MeasuredCost  # sim_error: the colocated phases with the counted contention, else ``pooled``
    mixed: Contention | None  # the counted contention with a factor per running-kind mix
    pooled: MeasuredCost  # sim_error_token_fit: every actor run's tokens
    planned: MeasuredCost | None  # sim_error_plan_costs: what ``plan --costs`` reads
    held_out: dict[str, MeasuredCost]  # sim_error_held_out: per actor row, fitted without it


def _counted_predictor(predictors: list[tuple[float, MeasuredCost]]
                       ) -> tuple[MeasuredCost | None, Contention | None]:
    """The median round's one-thread colocated costs with the counted contention (per count of busy
    processes, the median round's), and that contention."""
    predictor = _median(predictors, lambda p: p[0])[1] if predictors else None
    contention = _median_contention([c.contention for _, c in predictors if c.contention])
    # the colocated prediction: counted contention only, made before looking at any actor run
    predictor = dataclasses.replace(predictor, contention=contention) if predictor else None
    return predictor, contention


def _fit_costs(measured: _Measurements, config: Path, base: list[str], actor: str | None) -> _Costs:
    """Every set of costs the rows are predicted with, from this bench's own runs."""
    predictor, contention = _counted_predictor(measured.predictors)
    # the actor runs add a factor per running-kind mix; every token's seconds alone on the host under
    # it (the simulator applies the contention of each moment again)
    actor_runs = {sched: [(run.tokens, run.result.spans) for run in rs] for sched, rs in measured.runs.items()}
    mixed, every_token = _fit_contention([r for rs in actor_runs.values() for r in rs], contention)
    pooled = dataclasses.replace(MeasuredCost.fit(every_token), contention=mixed)
    predictor = predictor or pooled
    planned, held_out = None, {}
    if measured.runs:
        first = load_config(config, [*base, f"schedule.name={actor}"])
        allreduce = measure_allreduce(first)
        planned = dataclasses.replace(plan_costs(every_token, [o for os in measured.overheads.values() for o in os],
                                                 allreduce), contention=mixed)
        held_out = _held_out_costs(actor_runs, measured.overheads, allreduce, contention)
    return _Costs(predictor, mixed, pooled, planned, held_out)


def _actor_row(sched: str, name: str, rs: list[_ActorRun], options: dict[str, Any], actor: str | None,
               costs: _Costs) -> tuple[dict[str, Any], Timeline]:
    """The row of ``sched``'s median run (schedule ``name``) with the simulator's error under each of ``costs``,
    and that run's timeline."""
    result, tokens, wall, devices, load, sps = _median(rs, lambda r: r.samples_per_s)
    row = _row(f"real-{sched}", sched.removesuffix("-fine").split("@")[0], result,
               _simulated(name, devices, result.workload, costs.predictor, options), sps, wall, devices)
    row["placement_row"] = sched == actor or sched.startswith(f"{actor}@")  # the config's schedule, a split
    errors = [("sim_error_token_fit", costs.pooled), ("sim_error_self_calibrated", MeasuredCost.fit(tokens))]
    if costs.planned:
        errors.append(("sim_error_plan_costs", costs.planned))
    if sched in costs.held_out:
        errors.append(("sim_error_held_out", costs.held_out[sched]))
    for key, cost in errors:
        own_sps = summarize(_simulated(name, devices, result.workload, cost, options)).steady.samples_per_s
        row[key] = own_sps / row["samples_per_s"] - 1.0 if row["samples_per_s"] else None
    row["busy_cores_before"] = load
    row["samples_per_s_runs"] = [r.samples_per_s for r in rs]
    return row, result


def _actor_rows(measured: _Measurements, specs: list[_Spec], actor: str | None, costs: _Costs
                ) -> tuple[list[dict[str, Any]], list[Timeline]]:
    """A row per actor row key, of its median run, and those runs' timelines (for the Gantt chart)."""
    rows, results = [], []
    for sched, rs in measured.runs.items():
        name = next(n for k, n, _ in specs if k == sched).removesuffix("+reward")
        row, result = _actor_row(sched, name, rs, measured.options[sched], actor, costs)
        rows.append(row)
        results.append(result)
    return rows, results


def _add_speedups(rows: list[dict[str, Any]], baseline: dict[str, Any] | None,
                  coloc: dict[str, list[dict[str, Any]]]) -> None:
    """Each row's samples/s over the colocated ``baseline``'s, the one-thread run's and, round by round,
    the two-process ceiling's."""
    base_sps = baseline["samples_per_s"] if baseline else None
    one = next((r["samples_per_s"] for r in rows if r["scenario"].endswith("-1thread")), None)
    ceiling = [r["samples_per_s"] for r in coloc.get("real-2x1thread", [])]  # one per round, in order
    for r in rows:
        r["speedup_vs_colocated"] = r["samples_per_s"] / base_sps if base_sps else None
        r["speedup_vs_colocated_1thread"] = r["samples_per_s"] / one if one else None
        if ceiling and len(ceiling) == len(r.get("samples_per_s_runs") or []):  # a row of every round
            r["vs_ceiling_rounds"] = [a / c for a, c in zip(r["samples_per_s_runs"], ceiling)]
            r["vs_ceiling"] = statistics.median(r["vs_ceiling_rounds"])


def _calibration(rows: list[dict[str, Any]], costs: _Costs, colocated: bool) -> dict[str, Any]:
    """The report's ``calibration``: the simulator's costs and where they came from (``colocated``: the
    one-thread colocated rounds) and, with actor rows, the plan costs and their errors."""
    source = ("this run's 1-thread colocated phases (median round) with the contention its <k>x1thread "
              "rows measured (per k, the median over rounds of the same-round slowdown)" if colocated
              else "pooled real tokens of this run's actor schedules")
    calibration: dict[str, Any] = {"colocated_costs": costs.predictor.to_dict(), "source": source,
                                   "token_fit": costs.pooled.to_dict()}
    if costs.mixed is not None:
        calibration["contention"] = costs.mixed.to_dict()
    if costs.planned is not None:
        calibration.update(costs.planned.to_calibration())
        calibration["plan_error"] = largest_error(rows, "sim_error_plan_costs")
        if costs.held_out:
            calibration["held_out_error"] = largest_error(rows, "sim_error_held_out")
        if (between := placement_error(rows)) is not None:
            calibration["placement_error"] = between
            calibration["placement_error_held_out"] = placement_error(rows, "sim_error_held_out")
        calibration["plan_costs_source"] = (
            "token fit over every actor run of this bench (fine-token run included) + the median per-token "
            "overhead + one trainer's median optimizer step + the median publication + a measured 2-process "
            "all-reduce of the trainable set (recipes/measure_costs.py)")
    return calibration


def _definitions() -> dict[str, str]:
    """The report's ``definitions``: what each row and calibration figure means."""
    return {
        "window": "steady = from the end of batch 0's optimizer step to the last one",
        "bubble": "1 - compute span time / window, per actor (bubble_per_actor); per role = mean",
        "sim_error": "simulator steady samples/s (same schedule, devices, workload; costs from "
                     "calibration.source) / measured - 1",
        "sim_error_token_fit": "the same with costs fitted to the measured tokens of all actor runs",
        "sim_error_plan_costs": "the same with the costs `plan --costs` reads (calibration."
                                "measured_costs, dispatch_s, allreduce); calibration.plan_error is "
                                "the largest |error| over the actor rows (in-sample: these runs "
                                "are in the fit)",
        "sim_error_held_out": "the same with plan costs fitted without this row's runs (every "
                              "other actor row's tokens and overheads): out of sample; not for "
                              "the -fine row, the only one whose token sizes vary; "
                              "calibration.held_out_error is the largest |error|",
        "real-<schedule>@<r>r<t>t": "the config's schedule at another split of its rollout + "
                                    "trainer processes (r rollout, t trainer actors): the "
                                    "placements the planner chooses among on this machine",
        "placement_error": "calibration.placement_error: the largest |(1 + e_a) / (1 + e_b) - 1| "
                           "over the config's schedule at its splits (e: sim_error_plan_costs), "
                           "the error on the ratio of two placements of the costs the planner "
                           "prices them with: its tolerance on this machine, whose splits all ran; "
                           "placement_error_held_out: the same with each row's held-out error "
                           "(how well a split never run is predicted, e.g. on a larger fleet)",
        "contention.mix": "per running-kind mix (e.g. rollout+train), each busy process's run "
                          "time factor, fitted to the actor runs' tokens (sim/contention.py "
                          "fit_mix); other mixes take the factor of their count times "
                          "contention.mix_scale (the fitted mixes' mean ratio to their counts')",
        "real-<schedule>-fine": "the schedule at finer tokens (a quarter of the fragment size, "
                                "rollout tokens of num_steps - 1 steps then the rest, TAG helpers of "
                                "1): the calibration run that separates fixed, per-step and "
                                "per-sample-step costs",
        "sim_error_self_calibrated": "the same with costs fitted to this run's tokens only",
        "colocated": "the single-process loop with placement.threads torch threads",
        "real-2x1thread": "two independent 1-thread colocated runs at once, samples/s summed: the "
                          "ceiling of any schedule of two 1-thread processes on this machine",
        "real-<k>x1thread": "k independent 1-thread colocated runs at once (k up to the most actor "
                            "processes a row runs); slowdown = the 1-thread run's samples/s / the "
                            "mean of the k: calibration.contention, what the simulator slows each "
                            "of k busy devices by (sim/contention.py)",
        "samples_per_s_runs": "every round's samples/s (repeats); the row is the median run",
        "vs_ceiling": "the median over rounds of the row's samples/s over the same round's "
                      "real-2x1thread (vs_ceiling_rounds): a round that ran the whole machine "
                      "slower slows both alike, which the ratio of the two rows' medians does not "
                      "cancel",
        "busy_cores_before": "cores busy with other processes just before the run (/proc/stat "
                             "over 0.5 s): rows measured at different loads are not comparable"}


def _write_files(out: Path | None, report: dict[str, Any], results: list[Timeline]) -> None:
    """``bubbles.json`` and the Gantt chart of the actor rows' median runs under ``out`` (``None``: nothing)."""
    from digenrl.telemetry.trace import write_gantt

    if out is not None:
        (out / "bubbles.json").write_text(json.dumps(report, indent=1))
        if results:
            write_gantt(results, out / "gantt-real.png", "real runs, tiny Qwen-Image on this machine")


def run_real_bubbles(schedules: list[str] | None = None, num_batches: int = 8, out: Path | None = None,
                     config: Path = DEFAULT_CONFIG, overrides: list[str] | None = None,
                     repeats: int = 1, fine_tokens: bool = True, splits: bool = True) -> dict[str, Any]:
    """Train the tiny model for real under each schedule and compare with the calibrated simulator.

    Args:
        schedules: ``colocated`` and/or actor schedule names (default ``REAL_DEFAULT_SCHEDULES``).
        num_batches: optimizer steps per run (the first is the warm-up window).
        out: where to write ``bubbles.json``, per-run directories ``real-<schedule>/`` (metrics,
            trace, Gantt; ``-r<k>`` for later rounds) and ``gantt-real.png``; ``None`` writes only what
            the runs need in a temp dir.
        config: the run config (default ``configs/tiny-qwenimage.toml``).
        overrides: extra ``--set`` style overrides.
        repeats: rounds over all schedules, interleaved (round 1 runs every schedule, then round 2...),
            so a burst of other load on a shared machine hits one run of each, not one schedule's
            every run. Each row reports its median run and lists every run's samples/s.
        fine_tokens: with an actor schedule, also run the config's own (if chosen; else the first) at finer
            tokens (``fine_overrides``: a quarter of the fragment size, shorter step ranges) in every
            round: row ``real-<schedule>-fine``. Its smaller tokens are what lets the plan costs
            separate a token's fixed cost, its per-step cost and its per-sample-step cost.
        splits: with an actor schedule, also run that schedule at every other split of the config's
            rollout + trainer processes (:func:`other_splits`) in every round: rows
            ``real-<schedule>@<r>r<t>t``. They are the placements the planner chooses among on this
            machine, so ``placement_error`` (how far off the simulator is on their ratio, the planner's
            tolerance) is measured, and their tokens run in mixes (train beside train) the config's own
            split never has.

    Returns:
        The ``bubbles.json`` content: ``rows``, ``calibration`` and ``definitions``. With an actor
        schedule, ``calibration`` holds the costs ``plan --costs`` reads (``costs_version`` 3:
        ``measured_costs`` per kind with ``optim`` and ``publish``, the rollout's with ``per_step_s``;
        ``dispatch_s``, ``allreduce``, ``fit_notes``; see
        ``recipes/measure_costs.py``) and ``plan_error``, the largest |error| of the simulator with
        those costs over the actor rows (each row's ``sim_error_plan_costs``).

    Raises:
        ConfigError: an unknown schedule, ``num_batches < 2`` or ``repeats < 1``.
    """
    chosen = _checked_schedules(schedules, num_batches, repeats)
    base = [*(overrides or []), f"train.iterations={num_batches}", "log.image_every=0", "log.checkpoint_every=0"]
    tmp = tempfile.TemporaryDirectory() if out is None else None
    root = _run_root(out, tmp)
    specs, actor = _row_specs(chosen, config, base, splits, fine_tokens)
    counts = _busy_counts(config, base, specs)
    try:
        measured = _measure_rounds(specs, config, base, root, num_batches, repeats, counts)
        colocated = _colocated_medians(measured.coloc)
        costs = _fit_costs(measured, config, base, actor)
        actor_rows, results = _actor_rows(measured, specs, actor, costs)
        rows = [*colocated, *actor_rows]
        _add_speedups(rows, next(iter(colocated), None), measured.coloc)
        report = {"rows": rows, "calibration": _calibration(rows, costs, bool(measured.predictors)),
                  "definitions": _definitions()}
        _write_files(out, report, results)
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()
