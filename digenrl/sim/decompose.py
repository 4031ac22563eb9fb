"""Where async1's gain over a baseline comes from: a chain of runs that removes one cause at a time.

Each chain starts at a baseline, changes one thing per link (a cost the baseline pays, or a
technique it lacks) and ends at ``async1``; a link's factor is its samples/s over the previous
link's, so the factors multiply to the whole ratio. The order is fixed (costs removed first,
techniques added after), and a factor below 1 is reported as it is: on a homogeneous fleet,
splitting rollout from training may cost more than it gains against a lean colocated loop.

Chains:

- from ``colocated`` (veRL-Omni's hybrid engine): old-log-prob recompute removed; engine switches
  removed (= ``colocated-flowgrpo``); timestep packing (= ``colocated-tsp``, digenrl's colocated loop);
  rollout/trainer split with pipelining (reward and generation overlap training, staleness 1, TAG), i.e.
  ``async1``;
- from ``colocated-flowgrpo``: the last two links;
- from ``verl-omni-async``: aborts on weight sync removed; recompute removed; step-range tokens and
  packed training (= ``unirl``); trainer-assisted generation (= ``async1``);
- from ``unirl``: the last link.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from digenrl.schedule.options import PRESETS
from digenrl.sim.calibration import OWN_COSTS
from digenrl.sim.peers import PEERS, Peer, simulate_peer
from digenrl.sim.scenarios import Scenario
from digenrl.telemetry.stats import summarize

__all__ = ["Link", "CHAINS", "decompose"]


@dataclass(frozen=True, slots=True)
class Link:
    """One run of a chain: the cause it removes or adds, and the run itself (as a ``Peer``)."""

    cause: str
    run: Peer


def _variant(base: Peer, name: str, options: Any = None, cost: dict[str, object] | None = None,
             sync_aborts: bool | None = None) -> Peer:
    return dataclasses.replace(base, name=name, options=options or base.options,
                               cost=base.cost if cost is None else cost,
                               sync_aborts=base.sync_aborts if sync_aborts is None else sync_aborts)


_VERL_COLOCATED = Peer("colocated", "veRL-Omni colocated (hybrid engine)", PRESETS["colocated"], {}, False,
                       "verl-omni docs/algo/performance.md (the calibration run)")
_FLOWGRPO = PEERS["colocated-flowgrpo"]
# Flow-GRPO's loop with TSP-packed training is digenrl's own colocated-tsp schedule (its bench row is reused)
_FLOWGRPO_TSP = Peer("colocated-tsp", "digenrl colocated-tsp", PRESETS["colocated-tsp"], OWN_COSTS["colocated-tsp"],
                     False, "this project")
_ASYNC1 = Peer("async1", "digenrl", PRESETS["async1"], {}, False, "this project")
_VERL_ASYNC = PEERS["verl-omni-async"]
_NO_ABORTS = _variant(_VERL_ASYNC, "verl-omni-async, no aborts", sync_aborts=False)
_NO_RECOMPUTE = _variant(_NO_ABORTS, "verl-omni-async, no aborts, no recompute", cost={})

_TAIL = [Link("timestep packing (TSP)", _FLOWGRPO_TSP),
         Link("split + pipeline (reward and generation overlap training, staleness 1, TAG)", _ASYNC1)]

CHAINS: dict[str, list[Link]] = {
    "colocated": [Link("baseline", _VERL_COLOCATED),
                  Link("old-log-prob recompute removed",
                       _variant(_VERL_COLOCATED, "colocated, no recompute", cost={"old_logprob_passes": 0.0})),
                  Link("engine switches removed", _FLOWGRPO), *_TAIL],
    "colocated-flowgrpo": [Link("baseline", _FLOWGRPO), *_TAIL],
    "verl-omni-async": [Link("baseline", _VERL_ASYNC),
                        Link("no aborts on weight sync", _NO_ABORTS),
                        Link("old-log-prob recompute removed", _NO_RECOMPUTE),
                        Link("step-range tokens + packed training (TSP)", PEERS["unirl"]),
                        Link("trainer-assisted generation (TAG)", _ASYNC1)],
    "unirl": [Link("baseline", PEERS["unirl"]), Link("trainer-assisted generation (TAG)", _ASYNC1)],
}


def decompose(sc: Scenario, num_batches: int, known: dict[str, float] | None = None) -> dict[str, Any]:
    """Every chain of ``CHAINS`` on ``sc``: per link its samples/s and factor, per chain the total.

    Args:
        known: samples/s already simulated, by run name (the bench's rows), to avoid re-running them.
    """
    sps: dict[str, float] = dict(known or {})
    out: dict[str, Any] = {}
    for baseline, chain in CHAINS.items():
        links = []
        prev = None
        for link in chain:
            name = link.run.name
            if name not in sps:
                sps[name] = summarize(simulate_peer(sc, link.run, num_batches)).steady.samples_per_s
            factor = sps[name] / prev if prev else 1.0
            links.append({"cause": link.cause, "run": name, "samples_per_s": sps[name], "factor": factor})
            prev = sps[name]
        out[baseline] = {"links": links, "total": links[-1]["samples_per_s"] / links[0]["samples_per_s"]}
    return out
