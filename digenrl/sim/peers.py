"""Today's peers as baselines: each one a schedule, a placement and the cost terms it pays.

A peer is described by its published behaviour (SYSTEMS.md §4, §8), run by the same simulator and
the same calibrated cost model as digenrl's schedules, so a ratio between a peer and ``async1``
comes only from what the peer does differently:

- ``colocated`` (a digenrl schedule, kept under its name) *is* veRL-Omni's colocated hybrid engine,
  the run the cost model is calibrated on: every GPU samples, switches, recomputes the old
  log-probs (about 20 % of a step, ``docs/algo/rollout_correction.md``) and trains.
- ``colocated-flowgrpo``: Flow-GRPO's own loop. Sampling and training share one diffusers pipeline
  and its weights (no engine switch) and the loss uses the log-probs stored at sampling (no
  recompute). Same devices, same hybrid schedule. On a forward-process scenario it is the
  DiffusionNFT reference's and Flow-Factory's colocated loop (every GPU samples its share with the old
  policy, then trains), and ``colocated`` veRL-Omni's DiffusionNFT on its hybrid engine: their rows
  carry no log-probs, so neither recomputes any (``profiles.RowCost.logprob_rows``); both pay the
  old-policy and reference forwards every trainer pays.
- ``verl-omni-async``: veRL-Omni v0.3 fully async (Oct 2026, the v1 trainer): rollout and trainer
  GPUs apart, samples stream to the trainer, one-step staleness; the trainer recomputes old
  log-probs (bypass mode is opt-in); every weight sync aborts the requests in flight and regenerates
  them (open bugs #586/#610: 2029 aborted requests in one run). Rollout requests are whole
  trajectories (no step-range tokens, no packed training).
- ``verl-omni-async-lend``: the same with PR #575's lending of idle trainer GPUs to rollout (off by
  default upstream) at its measured engine switch costs, 9.1 s to lend and 3.3 s back. Which
  fragments to lend for is decided by digenrl's TAG rule, which is generous to the peer (upstream
  uses an adaptive threshold).
- ``unirl``: UniRL v0.2 (2026-10): disaggregated async with batched timestep replay (the TSP
  packing that cut its train phase 15-17 %), weight sync without aborts, stored log-probs, no
  lending. In this model it is digenrl's ``async1`` without TAG.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from digenrl.errors import ConfigError
from digenrl.schedule import build_schedule
from digenrl.schedule.options import PRESETS, ScheduleOptions
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.engine import simulate
from digenrl.sim.scenarios import Scenario, placement
from digenrl.telemetry.spans import Timeline

__all__ = ["Peer", "PEERS", "peer", "simulate_peer"]


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer system as the simulator models it.

    Attributes:
        name: row name in ``digenrl bench bubbles``.
        system: who runs this way today, and the version.
        options: the schedule that describes its pipeline (``colocated`` = hybrid engine).
        cost: ``CostParams`` fields that differ from the calibrated ones.
        sync_aborts: a weight sync restarts the rollouts in flight (``engine.simulate``).
        source: where the behaviour is documented.
    """

    name: str
    system: str
    options: ScheduleOptions
    cost: dict[str, object]
    sync_aborts: bool
    source: str


_VERL_ASYNC = ScheduleOptions(gap=True, staleness=1)

PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("colocated-flowgrpo", "Flow-GRPO / DiffusionNFT / Flow-Factory (one diffusers loop)",
             PRESETS["colocated"], {"old_logprob_passes": 0.0, "phase_switches": False}, False,
             "flow_grpo, NVlabs/DiffusionNFT: one pipeline samples and trains; log-probs stored at sampling"),
        Peer("verl-omni-async", "veRL-Omni v0.3 fully async", _VERL_ASYNC,
             {"trainer_old_logprob_passes": 1.0}, True,
             "verl-omni v0.3.0; issues #586/#610 (aborts on sync); rollout_correction.md (recompute ~20%)"),
        Peer("verl-omni-async-lend", "veRL-Omni v0.3 fully async + trainer lending",
             dataclasses.replace(_VERL_ASYNC, tag=True),
             {"trainer_old_logprob_passes": 1.0, "lend_switch_seconds": (9.1, 3.3)}, True,
             "as verl-omni-async, plus PR #575 (lend idle trainers, switches 9.1 s / 3.3 s)"),
        Peer("unirl", "UniRL v0.2", dataclasses.replace(PRESETS["async1"], tag=False), {}, False,
             "UniRL v0.2.0: disaggregated async, batched timestep replay (PR #394: train phase -15-17%)"),
    )
}


def peer(name: str) -> Peer:
    """Peer by name.

    Raises:
        ConfigError: unknown name; lists the known ones.
    """
    if name not in PEERS:
        raise ConfigError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return PEERS[name]


def simulate_peer(sc: Scenario, p: Peer, num_batches: int) -> Timeline:
    """Simulate scenario ``sc`` as peer ``p`` runs it (its own placement rule: hybrid or split)."""
    params = dataclasses.replace(calibrated_params(), **p.cost)  # type: ignore[arg-type]
    devices, cost = placement(sc, colocated=p.options.colocated, params=params,
                              sp=sc.sequence.of(p.name) if sc.sequence else (1, 1))  # its own SP
    workload = sc.workload(num_batches)
    schedule = build_schedule(devices, workload, p.options, cost, p.name)
    return simulate(schedule, devices, workload, cost, sync_aborts=p.sync_aborts)

