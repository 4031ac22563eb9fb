"""`digenrl bench bubbles`: scenarios x schedules side by side in the simulator, with artefacts.

``run_bubbles`` simulates every selected (scenario, schedule) pair with the calibrated, fixed cost
model, and with ``out`` writes ``bubbles.json``, one Chrome trace per pair and one Gantt PNG per
scenario. Rows use the steady window (warm-up batch excluded); the ``full`` block has ``[0, wall]``.
A "schedule" is one of digenrl's (``SCHEDULES``) or a peer modelled in ``peers.py`` (``PEERS``); with
``async1`` selected each scenario also gets the decomposition of ``decompose.py``.

Costs: the fitted veRL-Omni utilisations on each scenario's profile (its model at its size), or, with
``measured`` (``--costs``), the token costs a ``bench bubbles --real`` report measured, for scenarios whose
pools are all of the device type it measured. Peers and the decomposition are changes to the fitted cost
model (recompute, switches, lending) that measured costs cannot express, so they run only without it.
Every row, and the report, names its cost source (``cost_source``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError
from digenrl.schedule import PRESETS, SCHEDULES, make_schedule
from digenrl.schedule.base import Role
from digenrl.sim.calibration import calibrate, cost_source, fitted_source, schedule_params
from digenrl.sim.cross_site import far_site_verdict, home_only, scenario_traffic
from digenrl.sim.decompose import decompose
from digenrl.sim.engine import simulate
from digenrl.sim.measured import MeasuredCost
from digenrl.sim.peers import PEERS, simulate_peer
from digenrl.sim.scenarios import (DEFAULT_BATCHES, SCENARIOS, PlannedSplit, Scenario, measured_placement, placement,
                                   scenario)
from digenrl.sim.user import load_scenario
from digenrl.telemetry.spans import Timeline, busy_seconds
from digenrl.telemetry.stats import summarize
from digenrl.telemetry.trace import write_gantt, write_trace

__all__ = ["BubbleReport", "run_bubbles", "simulate_pair", "pool_bubbles", "DEFAULT_SCENARIOS", "RUNS"]

# The default selection: the paper scenarios and the heterogeneous testbed (the scaling sweep is
# selected by name, e.g. ``--scenario scale-1024``; so are the cross-site ones, ``--scenario xs-qwen-lora-1g``).
DEFAULT_SCENARIOS: tuple[str, ...] = tuple(s.name for s in SCENARIOS.values() if s.kind not in ("scaling", "cross-site", "long-video"))
# What a row can be: digenrl's schedules, then the peers.
RUNS: tuple[str, ...] = (*SCHEDULES, *PEERS)


@dataclass(slots=True)
class BubbleReport:
    rows: list[dict[str, Any]]
    calibration: dict[str, Any]
    files: list[Path] = field(default_factory=list)
    decomposition: dict[str, Any] = field(default_factory=dict)  # scenario -> decompose() result
    notes: list[str] = field(default_factory=list)

    @property
    def cost_source(self) -> str:
        """``fitted veRL-Omni utilisations (...)`` or ``measured: FILE (...)``; each row adds its profile."""
        return str(self.calibration["cost_source"])

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "cost_source": self.cost_source, "calibration": self.calibration,
                "decomposition": self.decomposition, "notes": self.notes,
                "definitions": {
                    "cost_source": "what priced the tokens: the fitted veRL-Omni utilisations on the row's model "
                                   "profile (its FLOPs), or measured: the `bench bubbles --real` report given "
                                   "with --costs",
                    "window": "steady = from the end of batch 0's optimizer step to the last one (warm-up "
                              "excluded); full = [0, wall]",
                    "bubble": "1 - (ROLLOUT+REWARD+TRAIN+OPTIM time) / window, per device; per role = mean",
                    "weight_sync_share": "PUBLISH device-seconds / (devices x window)",
                    "bytes_per_sample": "what one sample moves from the rollout to the trainer: its trained rows' "
                                        "latents and scalars, or its clean latent, and its conditioning "
                                        "(profiles.RowCost)",
                    "speedup_bound": "colocated seconds per batch / (rollout + TSP-packed training device-seconds "
                                     "per batch / devices): what a bubble-free schedule could reach",
                    "colocated": "veRL-Omni's hybrid engine (the calibration run): switches and old-log-prob recompute",
                    "colocated-tsp": "digenrl's colocated loop on actors: the same hybrid schedule, TSP-packed "
                                     "training, no engine switch, stored log-probs (Flow-GRPO's loop + TSP)",
                    "peers": {p.name: f"{p.system}: {p.source}" for p in PEERS.values()},
                    "decomposition": "per baseline, a chain of runs changing one cause at a time up to async1; "
                                     "factor = samples/s over the previous link's (they multiply to the total)",
                }}


def simulate_pair(sc: Scenario, schedule: str, num_batches: int, planned: PlannedSplit | None = None,
                  measured: MeasuredCost | None = None) -> Timeline:
    """Simulate one scenario under one schedule (or peer, ``PEERS``) with the calibrated cost model, or
    with ``measured`` costs (digenrl's schedules only).

    ``planned``: the split and token sizes for ``planned.schedule`` (others keep the scenario's split).

    Raises:
        ConfigError: a peer with measured costs, or measured costs of another device type.
    """
    if schedule in PEERS:
        if measured is not None:
            raise ConfigError(f"{schedule}: a peer is modelled as changes to the fitted cost model (its recompute, "
                              "switches, lending); measured costs (--costs) price digenrl's schedules only")
        return simulate_peer(sc, PEERS[schedule], num_batches)
    mine = planned if planned is not None and planned.schedule == schedule else None
    if PRESETS[schedule].colocated and sc.links:  # colocated on the training cluster alone (cross_site.py)
        sc = home_only(sc)
    colocated, split = PRESETS[schedule].colocated, dict(mine.rollout) if mine else None
    devices, cost = (measured_placement(sc, colocated, measured, split) if measured is not None
                     else placement(sc, colocated, schedule_params(schedule), rollout=split,
                                    sp=sc.sequence.of(schedule) if sc.sequence else (1, 1)))
    workload = sc.workload(num_batches)
    options = dict(mine.options) if mine else {}
    # measured on one host: its processes share its cores as the bench measured (None: each owns its compute)
    return simulate(make_schedule(schedule, devices, workload, cost, **options), devices, workload, cost,
                    contention=measured.contention if measured is not None else None,
                    links=scenario_traffic(sc, devices, cost.params.grad_bytes if measured is None else 2.0))


def _bound(sc: Scenario, colocated_sps: float, measured: MeasuredCost | None = None) -> float | None:
    if len(sc.pools) != 1 or colocated_sps <= 0 or measured is not None:
        return None
    devices, cost = placement(sc, colocated=True)
    spec = cost.specs[devices[0].name]
    w = sc.workload(1)
    roll, train = cost.batch_work(w.samples_per_batch, w.prompts_per_batch, w.num_steps, w.rows_per_batch, spec)
    ideal_sps = w.samples_per_batch / ((roll + train * (1 - cost.params.tsp_train_saving)) / len(devices))
    return ideal_sps / colocated_sps


def _row(sc: Scenario, res: Timeline, sim_s: float, planned: bool = False, source: str = "") -> dict[str, Any]:
    st = summarize(res)
    s, f = st.steady, st.full
    return {
        "scenario": sc.name, "model": sc.profile.name, "variant": sc.profile.size, "cost_source": source,
        "devices": sc.num_devices, "testbed": sc.testbed, "kind": sc.kind,
        "bytes_per_sample": sc.profile.boundary_bytes(sc.trained_steps),
        "schedule": res.schedule, "system": PEERS[res.schedule].system if res.schedule in PEERS else "digenrl",
        "split": {"rollout": sum(d.role is Role.ROLLOUT for d in res.devices),
                  "trainer": sum(d.role is Role.TRAINER for d in res.devices),
                  "hybrid": sum(d.role is Role.HYBRID for d in res.devices)},
        "planned": planned,
        "sequence_parallel": list(sc.sequence.of(res.schedule)) if sc.sequence else [1, 1],  # rollout, trainer SP
        "samples_per_s": s.samples_per_s, "speedup_vs_colocated": None,
        "bubble_ratio": {"rollout": s.bubble_rollout, "trainer": s.bubble_trainer, "overall": s.bubble_overall},
        "bubble_by_pool": pool_bubbles(res, [t for t, _ in sc.pools], s.start, s.end),
        "max_staleness": st.max_staleness,
        "weight_sync_share": s.weight_sync_share, "switch_share": s.switch_share,
        "aborted_share": _aborted_share(res, s.start, s.end),
        "full": {"samples_per_s": f.samples_per_s,
                 "bubble_ratio": {"rollout": f.bubble_rollout, "trainer": f.bubble_trainer, "overall": f.bubble_overall}},
        "num_batches": res.workload.num_batches, "samples_scored": st.samples_scored, "wall_s": res.wall,
        "tokens": res.tokens, "sim_seconds": sim_s,
    }


def pool_bubbles(res: Timeline, pools: list[str], start: float, end: float) -> dict[str, float]:
    """Mean bubble of each pool (device type; devices are named ``<type>-<i>``) in the window, whatever
    roles its devices hold."""
    length = max(end - start, 1e-12)
    types = {t.lower(): t for t in pools}
    spans: dict[str, list[Any]] = {}
    for span in res.spans:
        spans.setdefault(span.device, []).append(span)
    by_pool: dict[str, list[float]] = {}
    for d in res.devices:
        own = spans.get(d.name, [])
        by_pool.setdefault(types[d.name.rsplit("-", 1)[0]], []).append(1.0 - busy_seconds(own, start, end) / length)
    return {t: sum(v) / len(v) for t, v in by_pool.items()}


def _aborted_share(res: Timeline, start: float, end: float) -> float:
    """Device-seconds of rollouts thrown away on weight syncs, over devices x the window."""
    length = (end - start) * len(res.devices)
    wasted = busy_seconds(res.spans, start, end, frozenset({"abort"}))
    return wasted / length if length > 0 else 0.0


def _calibration(measured: MeasuredCost | None) -> dict[str, Any]:
    """The report's ``calibration``: the fitted parameters and the step they reproduce, or the measured costs."""
    if measured is not None:
        return {"cost_source": measured.describe(), "measured_costs": measured.to_calibration(),
                "device": measured.device, "source": measured.source}
    cal = calibrate()
    return {"cost_source": fitted_source(cal.params), "mfu_rollout": cal.params.mfu_rollout,
            "mfu_train": cal.params.mfu_train, "mfu_reward": cal.params.mfu_reward,
            "old_logprob_passes": cal.params.old_logprob_passes,
            "step_breakdown_s": {"generation": cal.generation, "reward": cal.reward, "switches": cal.switches,
                                 "optim": cal.optim, "train": cal.train}}


def _chosen(scenarios: list[str] | None, schedules: list[str] | None, num_batches: int,
            measured: MeasuredCost | None) -> tuple[list[str], list[str]]:
    """The scenario and schedule names to run, checked (see :func:`run_bubbles`)."""
    if measured is not None and not scenarios:
        raise ConfigError(f"--costs: {measured.describe()} prices the device type it was measured on; name the "
                          "scenarios to simulate with it (--scenario FILE.toml with pools of that type)")
    chosen = list(schedules or (SCHEDULES if measured is not None else RUNS))
    for s in chosen:
        if s not in RUNS:
            raise ConfigError(f"unknown schedule {s!r}; known: {', '.join(SCHEDULES)}; peers: {', '.join(PEERS)}")
    peers = [s for s in chosen if s in PEERS]
    if measured is not None and peers:
        raise ConfigError(f"--costs with {', '.join(peers)}: a peer is modelled as changes to the fitted cost model "
                          "(its recompute, switches, lending); measured costs price digenrl's schedules only")
    if num_batches < 2:
        raise ConfigError(f"num_batches={num_batches}: needs at least 2 (the first batch is the warm-up window)")
    return list(scenarios or DEFAULT_SCENARIOS), chosen


def run_bubbles(scenarios: list[str] | None = None, schedules: list[str] | None = None,
                num_batches: int = DEFAULT_BATCHES, out: Path | None = None, gantt_batches: int = 4,
                decomposition: bool = True, planned: dict[str, PlannedSplit] | None = None,
                measured: MeasuredCost | None = None) -> BubbleReport:
    """Simulate scenarios x schedules and (with ``out``) write bubbles.json, traces and Gantt PNGs.

    Args:
        scenarios: scenario names (default: the paper scenarios and the heterogeneous testbed).
        schedules: schedule or peer names (default: all of ``RUNS``, colocated first; with ``measured``
            digenrl's schedules).
        num_batches: optimizer steps per run.
        out: directory for the artefacts; created if missing.
        gantt_batches: the Gantt shows the first this many batches of every schedule.
        decomposition: with ``async1`` selected, also run ``decompose`` per scenario (not with ``measured``).
        planned: scenario name -> the split (and token sizes) ``digenrl plan --fleet`` chose for one
            schedule; that schedule's row uses it (``planned: true``), the decomposition ends at it.
        measured: price every token with these measured costs instead of the fitted utilisations.

    Raises:
        ConfigError: an unknown scenario or schedule name, ``num_batches < 2``; with ``measured``: no
            scenario named, a peer, or a scenario with a device type the costs were not measured on.
    """
    names, chosen = _chosen(scenarios, schedules, num_batches, measured)
    report = BubbleReport([], _calibration(measured))
    if measured is not None and decomposition and "async1" in chosen:
        report.notes.append("no decomposition: its links are changes to the fitted cost model (recompute, switches, "
                            "aborts) that measured costs cannot express")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name in names:
        sc = load_scenario(name).scenario if name.endswith(".toml") else scenario(name)
        source = cost_source(sc.profile, measured)
        if sc.sequence is not None:
            report.notes.append(f"{sc.name}: sequence parallelism per run: {sc.sequence.describe()}")
        results: list[Timeline] = []
        base_sps = None
        rows = []
        plan = (planned or {}).get(sc.name)
        for sched in chosen:
            start = time.perf_counter()
            res = simulate_pair(sc, sched, num_batches, plan, measured)
            rows.append(_row(sc, res, time.perf_counter() - start, plan is not None and plan.schedule == sched,
                             source))
            results.append(res)
            if out is not None:
                report.files.append(write_trace(res, out / f"trace-{sc.name}-{sched}.json"))
        base = next((r for r in rows if r["schedule"] == "colocated"), None)
        if base is None:  # speedups still need the baseline
            res = simulate_pair(sc, "colocated", num_batches, measured=measured)
            base = _row(sc, res, 0.0)
        base_sps = base["samples_per_s"]
        bound = _bound(sc, base_sps, measured)
        for r in rows:
            r["speedup_vs_colocated"] = r["samples_per_s"] / base_sps if base_sps else None
            r["speedup_bound"] = bound
        report.rows.extend(rows)
        if sc.links:  # far sites: each row against the training cluster alone
            report.notes.append(far_site_verdict(sc, rows, num_batches))
        if decomposition and "async1" in chosen and measured is None and not sc.links:
            report.decomposition[sc.name] = decompose(sc, num_batches, {r["schedule"]: r["samples_per_s"] for r in rows})
        if out is not None:
            k = min(gantt_batches, num_batches) - 1
            until = max(res.optim_end.get(k, res.wall) for res in results)
            report.files.append(write_gantt(results, out / f"gantt-{sc.name}.png",
                                            f"{sc.name}: {sc.profile.name} on {sc.testbed}, first {k + 1} batches",
                                            until=until))
    if out is not None:
        path = out / "bubbles.json"
        path.write_text(json.dumps(report.to_json(), indent=1))
        report.files.insert(0, path)
    return report
