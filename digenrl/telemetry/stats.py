"""Throughput, bubbles, staleness and overhead shares of a run's spans (simulated or real).

Definitions (DESIGN.md §2):

- A device is *busy* while it holds a compute span: ROLLOUT, REWARD, TRAIN or OPTIM. SWITCH
  (colocated phase switches, TAG onload/offload) and PUBLISH (weight sync) are overheads, not
  compute, and count as bubble; their shares are reported separately.
- ``bubble ratio = 1 - busy / window`` per device; per role it is the mean over that role's devices
  (HYBRID devices count for both rollout and trainer; REWARD devices count as rollout).
- Two windows are reported. ``steady`` (the headline figure) starts when batch 0's optimizer step
  ends, so the pipeline's fill during the first batch (warm-up) is excluded; it ends at the last
  optimizer step. ``full`` is ``[0, wall]``.
- ``samples_per_s`` over a window = samples of the batches whose optimizer step ends in it / its length.
- ``max_staleness`` = max over ROLLOUT spans of ``batch - policy_version``.
- ``weight_sync_share`` / ``switch_share`` = device-seconds in PUBLISH / SWITCH spans over
  device-seconds of the window (devices x length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from typing import Any

from digenrl.telemetry.spans import Span, Timeline, busy_seconds

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

    batches = [k for k, t in result.optim_end.items() if start < t <= end + 1e-9]
    if start == 0.0:
        batches = list(result.optim_end)
    samples = len(batches) * result.workload.samples_per_batch
    n = len(result.devices)
    return WindowStats(
        start, end, samples / length,
        mean(_ROLLOUT_SIDE), mean(_TRAINER_SIDE),
        sum(bubbles.values()) / n, sync / (n * length), switch / (n * length),
    ), bubbles


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
    last = max(result.optim_end.values(), default=result.wall)
    if len(result.optim_end) < 2:
        first = 0.0
    steady, _ = _window(result, by_device, first, last)
    full, per_device = _window(result, by_device, 0.0, result.wall)
    return RunStats(steady, full, staleness, scored, per_device)


def run_stats(result: Timeline) -> dict[str, Any]:
    """:func:`summarize` as plain data (a real run's ``summary.json``)."""
    return summarize(result).to_dict()
