"""Throughput, bubbles, staleness and overhead shares of a run's spans (simulated or real).

Definitions (DESIGN.md §2):

- A device is *busy* while it holds a compute span: ROLLOUT, REWARD, TRAIN or OPTIM. SWITCH
  (colocated phase switches, TAG onload/offload) and PUBLISH (weight sync) are overheads, not
  compute, and count as bubble; their shares are reported separately.
- ``bubble ratio = 1 - busy / window`` per device; per role it is the mean over that role's devices
  (HYBRID devices count for both rollout and trainer; REWARD devices count as rollout).
- Two windows are reported. ``steady`` (the headline figure) starts when batch 0's optimizer step
  ends, so the pipeline's fill during the first batch (warm-up) is excluded; with three or more
  batches it ends at the second-to-last optimizer step, so the drain is excluded too (while the last
  batch trains, the rollout side has no next batch to generate: an end-of-run idle a longer run does
  not have, not a bubble of the schedule); with two, at the last. ``full`` is ``[0, wall]``.
- ``samples_per_s`` over a window = the samples whose compute the window holds / its length: every
  trained batch (one with an optimizer step) is credited its samples x the share of its compute
  device-seconds that lie inside the window. Counting whole batches whose optimizer step ends in the
  window credited it with work done before it starts: a pipeline's first batches carry more of the
  next batch's work than its steady state does (async1, tiny Qwen-Image at 3 steps, 1 rollout + 1
  trainer: batch 1 had 2x the steady lead done by the end of batch 0's step), so an 8-batch window
  read 2.4% above what two fully busy devices can do. Credited by work, a window's samples/s is at
  most (1 - bubble) x devices / (device-seconds per sample). Over ``[0, wall]`` it is every trained
  sample.
- ``max_staleness`` = max over ROLLOUT spans of ``batch - policy_version``.
- ``weight_sync_share`` / ``switch_share`` = device-seconds in PUBLISH / SWITCH spans over
  device-seconds of the window (devices x length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from typing import Any

from digenrl.telemetry.spans import COMPUTE_KINDS, Span, Timeline, busy_seconds

__all__ = ["WindowStats", "RunStats", "summarize", "run_stats"]

_ROLLOUT_SIDE = ("rollout", "reward", "hybrid")  # device roles counted in the rollout bubble
_TRAINER_SIDE = ("trainer", "hybrid")


@dataclass(frozen=True, slots=True)
class WindowStats:
    start: float
    end: float
    samples_per_s: float
    bubble_rollout: float
    bubble_trainer: float
    bubble_overall: float
    weight_sync_share: float
    switch_share: float


@dataclass(frozen=True, slots=True)
class RunStats:
    steady: WindowStats
    full: WindowStats
    max_staleness: int
    samples_scored: int
    per_device_bubble: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _window(result: Timeline, by_device: dict[str, list[Span]], start: float, end: float
            ) -> tuple[WindowStats, dict[str, float]]:
    length = max(end - start, 1e-12)
    bubbles: dict[str, float] = {}
    sync = switch = 0.0
    for d in result.devices:
        own = by_device.get(d.name, [])
        bubbles[d.name] = 1.0 - busy_seconds(own, start, end) / length
        sync += busy_seconds(own, start, end, frozenset({"publish"}))
        switch += busy_seconds(own, start, end, frozenset({"switch"}))

    def mean(roles: tuple[str, ...]) -> float:
        vals = [bubbles[d.name] for d in result.devices if d.role in roles]
        return sum(vals) / len(vals) if vals else 0.0

    samples = result.workload.samples_per_batch * _batches_worked(result, start, end)
    n = len(result.devices)
    return WindowStats(
        start, end, samples / length,
        mean(_ROLLOUT_SIDE), mean(_TRAINER_SIDE),
        sum(bubbles.values()) / n, sync / (n * length), switch / (n * length),
    ), bubbles


def _batches_worked(result: Timeline, start: float, end: float) -> float:
    """Trained batches' worth of compute inside ``[start, end]``: each batch's share of its compute there."""
    total: dict[int, float] = {}
    inside: dict[int, float] = {}
    for s in result.spans:
        if s.kind in COMPUTE_KINDS and s.batch in result.optim_end:
            total[s.batch] = total.get(s.batch, 0.0) + (s.end - s.start)
            inside[s.batch] = inside.get(s.batch, 0.0) + max(0.0, min(s.end, end) - max(s.start, start))
    worked = 0.0
    for batch, t in result.optim_end.items():
        if total.get(batch, 0.0) > 0.0:
            worked += inside[batch] / total[batch]
        elif start == 0.0 or start < t <= end + 1e-9:  # no compute recorded: the batch where its step ends
            worked += 1.0
    return worked


def summarize(result: Timeline) -> RunStats:
    """Metrics of one run (see the module docstring for the definitions)."""
    by_device: dict[str, list[Span]] = {}
    staleness = 0
    scored = 0
    for s in result.spans:
        by_device.setdefault(s.device, []).append(s)
        if s.kind == "rollout":
            staleness = max(staleness, s.batch - s.version)
        elif s.kind == "reward":
            scored += s.samples
    first = result.optim_end.get(0, 0.0)
    ends = sorted(result.optim_end.values()) or [result.wall]
    last = ends[-2] if len(ends) >= 3 else ends[-1]
    if len(ends) < 2:
        first = 0.0
    steady, _ = _window(result, by_device, first, last)
    full, per_device = _window(result, by_device, 0.0, result.wall)
    return RunStats(steady, full, staleness, scored, per_device)


def run_stats(result: Timeline) -> dict[str, Any]:
    """:func:`summarize` as plain data (a real run's ``summary.json``)."""
    return summarize(result).to_dict()
