"""`digenrl bench bubbles`: scenarios x schedules side by side in the simulator, with artefacts.

``run_bubbles`` simulates every selected (scenario, schedule) pair with the calibrated, fixed cost
model, and with ``out`` writes ``bubbles.json``, one Chrome trace per pair and one Gantt PNG per
scenario. Rows use the steady window (warm-up batch excluded); the ``full`` block has ``[0, wall]``.
A "schedule" is one of digenrl's (``SCHEDULES``) or a peer modelled in ``peers.py`` (``PEERS``); with
``async1`` selected each scenario also gets the decomposition of ``decompose.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError
from digenrl.schedule import SCHEDULES, make_schedule
from digenrl.schedule.base import Role
from digenrl.sim.calibration import calibrate
from digenrl.sim.decompose import decompose
from digenrl.sim.engine import simulate
from digenrl.sim.peers import PEERS, simulate_peer
from digenrl.sim.profiles import profile
from digenrl.sim.scenarios import DEFAULT_BATCHES, SCENARIOS, PlannedSplit, Scenario, placement, scenario
from digenrl.sim.user import load_scenario
from digenrl.telemetry.spans import Timeline, busy_seconds
from digenrl.telemetry.stats import summarize
from digenrl.telemetry.trace import write_gantt, write_trace

__all__ = ["BubbleReport", "run_bubbles", "simulate_pair", "pool_bubbles", "DEFAULT_SCENARIOS", "RUNS"]

# The default selection: the paper scenarios and the heterogeneous testbed (the scaling sweep is
# selected by name, e.g. ``--scenario scale-1024``).
DEFAULT_SCENARIOS: tuple[str, ...] = tuple(s.name for s in SCENARIOS.values() if s.kind != "scaling")
# What a row can be: digenrl's schedules, then the peers.
RUNS: tuple[str, ...] = (*SCHEDULES, *PEERS)


@dataclass(slots=True)
class BubbleReport:
    rows: list[dict[str, Any]]
    calibration: dict[str, Any]
    files: list[Path] = field(default_factory=list)
    decomposition: dict[str, Any] = field(default_factory=dict)  # scenario -> decompose() result

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "calibration": self.calibration, "decomposition": self.decomposition,
                "definitions": {
                    "window": "steady = from the end of batch 0's optimizer step to the last one (warm-up "
                              "excluded); full = [0, wall]",
                    "bubble": "1 - (ROLLOUT+REWARD+TRAIN+OPTIM time) / window, per device; per role = mean",
                    "weight_sync_share": "PUBLISH device-seconds / (devices x window)",
                    "speedup_bound": "colocated seconds per batch / (rollout + TSP-packed training device-seconds "
                                     "per batch / devices): what a bubble-free schedule could reach",
                    "colocated": "veRL-Omni's hybrid engine (the calibration run): switches and old-log-prob recompute",
                    "peers": {p.name: f"{p.system}: {p.source}" for p in PEERS.values()},
                    "decomposition": "per baseline, a chain of runs changing one cause at a time up to async1; "
                                     "factor = samples/s over the previous link's (they multiply to the total)",
                }}


def simulate_pair(sc: Scenario, schedule: str, num_batches: int, planned: PlannedSplit | None = None) -> Timeline:
    """Simulate one scenario under one schedule (or peer, ``PEERS``) with the calibrated cost model.

    ``planned``: the split and token sizes for ``planned.schedule`` (others keep the scenario's split).
    """
    if schedule in PEERS:
        return simulate_peer(sc, PEERS[schedule], num_batches)
    mine = planned if planned is not None and planned.schedule == schedule else None
    devices, cost = placement(sc, colocated=schedule == "colocated", rollout=dict(mine.rollout) if mine else None)
    workload = sc.workload(num_batches)
    options = dict(mine.options) if mine else {}
    return simulate(make_schedule(schedule, devices, workload, cost, **options), devices, workload, cost)


def _bound(sc: Scenario, colocated_sps: float) -> float | None:
    if len(sc.pools) != 1 or colocated_sps <= 0:
        return None
    devices, cost = placement(sc, colocated=True)
    spec = cost.specs[devices[0].name]
    w = sc.workload(1)
    roll, train = cost.batch_work(w.samples_per_batch, w.prompts_per_batch, w.num_steps, w.rows_per_batch, spec)
    ideal_sps = w.samples_per_batch / ((roll + train * (1 - cost.params.tsp_train_saving)) / len(devices))
    return ideal_sps / colocated_sps


def _row(sc: Scenario, res: Timeline, sim_s: float, planned: bool = False) -> dict[str, Any]:
    st = summarize(res)
    s, f = st.steady, st.full
    return {
        "scenario": sc.name, "model": profile(sc.model).name, "devices": sc.num_devices, "testbed": sc.testbed,
        "schedule": res.schedule, "system": PEERS[res.schedule].system if res.schedule in PEERS else "digenrl",
        "split": {"rollout": sum(d.role is Role.ROLLOUT for d in res.devices),
                  "trainer": sum(d.role is Role.TRAINER for d in res.devices),
                  "hybrid": sum(d.role is Role.HYBRID for d in res.devices)},
        "planned": planned,
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


def run_bubbles(scenarios: list[str] | None = None, schedules: list[str] | None = None,
                num_batches: int = DEFAULT_BATCHES, out: Path | None = None, gantt_batches: int = 4,
                decomposition: bool = True, planned: dict[str, PlannedSplit] | None = None) -> BubbleReport:
    """Simulate scenarios x schedules and (with ``out``) write bubbles.json, traces and Gantt PNGs.

    Args:
        scenarios: scenario names (default: the paper scenarios and the heterogeneous testbed).
        schedules: schedule or peer names (default: all of ``RUNS``, colocated first).
        num_batches: optimizer steps per run.
        out: directory for the artefacts; created if missing.
        gantt_batches: the Gantt shows the first this many batches of every schedule.
        decomposition: with ``async1`` selected, also run ``decompose`` per scenario.
        planned: scenario name -> the split (and token sizes) ``digenrl plan --fleet`` chose for one
            schedule; that schedule's row uses it (``planned: true``), the decomposition ends at it.

    Raises:
        ConfigError: an unknown scenario or schedule name, or ``num_batches < 2``.
    """
    names = list(scenarios or DEFAULT_SCENARIOS)
    chosen = list(schedules or RUNS)
    for s in chosen:
        if s not in RUNS:
            raise ConfigError(f"unknown schedule {s!r}; known: {', '.join(SCHEDULES)}; peers: {', '.join(PEERS)}")
    if num_batches < 2:
        raise ConfigError(f"num_batches={num_batches}: needs at least 2 (the first batch is the warm-up window)")
    cal = calibrate()
    report = BubbleReport([], {"mfu_rollout": cal.params.mfu_rollout, "mfu_train": cal.params.mfu_train,
                               "mfu_reward": cal.params.mfu_reward,
                               "old_logprob_passes": cal.params.old_logprob_passes,
                               "step_breakdown_s": {"generation": cal.generation, "reward": cal.reward,
                                                    "switches": cal.switches, "optim": cal.optim, "train": cal.train}})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name in names:
        sc = load_scenario(name).scenario if name.endswith(".toml") else scenario(name)
        results: list[Timeline] = []
        base_sps = None
        rows = []
        plan = (planned or {}).get(sc.name)
        for sched in chosen:
            start = time.perf_counter()
            res = simulate_pair(sc, sched, num_batches, plan)
            rows.append(_row(sc, res, time.perf_counter() - start, plan is not None and plan.schedule == sched))
            results.append(res)
            if out is not None:
                report.files.append(write_trace(res, out / f"trace-{sc.name}-{sched}.json"))
        base = next((r for r in rows if r["schedule"] == "colocated"), None)
        if base is None:  # speedups still need the baseline
            res = simulate_pair(sc, "colocated", num_batches)
            base = _row(sc, res, 0.0)
        base_sps = base["samples_per_s"]
        bound = _bound(sc, base_sps)
        for r in rows:
            r["speedup_vs_colocated"] = r["samples_per_s"] / base_sps if base_sps else None
            r["speedup_bound"] = bound
        report.rows.extend(rows)
        if decomposition and "async1" in chosen:
            report.decomposition[sc.name] = decompose(sc, num_batches, {r["schedule"]: r["samples_per_s"] for r in rows})
        if out is not None:
            k = min(gantt_batches, num_batches) - 1
            until = max(res.optim_end.get(k, res.wall) for res in results)
            report.files.append(write_gantt(results, out / f"gantt-{sc.name}.png",
                                            f"{sc.name}: {profile(sc.model).name} on {sc.testbed}, first {k + 1} batches",
                                            until=until))
    if out is not None:
        path = out / "bubbles.json"
        path.write_text(json.dumps(report.to_json(), indent=1))
        report.files.insert(0, path)
    return report
