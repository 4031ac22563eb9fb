"""Spans: who ran what, when. The one record of activity for the simulator and for real runs.

A :class:`Span` is one device running one piece of work (a token: rollout steps, reward, train,
optimizer step, weight publication, or a switch) over ``[start, end)`` seconds. A
:class:`Timeline` holds every span of one run with the devices and the run's shape; the simulator
(:mod:`digenrl.sim.engine`) makes one on a virtual clock, a real run's coordinator records one
with :class:`SpanLog` from the times its actors measured. Everything computed from spans
(:mod:`.stats`, :mod:`.trace`, :func:`window_bubbles`) therefore means the same in both.

The telemetry package sits below the schedules: a span's ``kind`` is the token kind's string
(``digenrl.schedule.TokenKind`` is a ``StrEnum``, so its members are these strings) and a device
is anything with a ``name`` and a ``role`` string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

__all__ = ["Span", "Timeline", "SpanLog", "DeviceInfo", "COMPUTE_KINDS", "busy_seconds", "window_bubbles"]

#: Span kinds that are compute. ``switch`` (phase switches, TAG onload/offload) and ``publish``
#: (weight sync) are overheads: they count as bubble and their shares are reported apart.
COMPUTE_KINDS = frozenset({"rollout", "reward", "train", "optim"})


class DeviceInfo(Protocol):
    """A device of a run: ``digenrl.schedule.Device`` or anything with these two fields."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...


class Span(NamedTuple):
    """One device running one token (or a TAG switch) over ``[start, end)`` seconds.

    A NamedTuple rather than a frozen dataclass: a 1024-GPU simulation records over a million
    spans, and tuple construction is several times cheaper.
    """

    device: str
    kind: str
    batch: int
    fragment: int
    version: int
    start: float
    end: float
    samples: int = 0
    helper: bool = False
    token: int = -1


@dataclass(slots=True)
class Timeline:
    """Every span of one run (simulated or real), with its devices and its shape.

    ``workload`` is the run's ``digenrl.schedule.Workload`` (``num_batches``, ``samples_per_batch``);
    ``optim_end`` maps a logical batch to the end of its optimizer step.
    """

    schedule: str
    devices: list[Any]
    workload: Any
    spans: list[Span]
    wall: float
    tokens: int
    optim_end: dict[int, float] = field(default_factory=dict)


class SpanLog:
    """Spans of all actors of a real run, in seconds since ``t0`` (a ``time.time()`` value shared by
    every process of the run)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.spans: list[Span] = []
        self.optim_end: dict[int, float] = {}

    def add(self, device: str, kind: str, batch: int, fragment: int, version: int, start: float, end: float,
            samples: int = 0, helper: bool = False, token: int = -1) -> Span:
        """Record one span measured in ``time.time()`` seconds; returns it relative to ``t0``."""
        span = Span(device, kind, batch, fragment, version, start - self.t0, max(end, start) - self.t0, samples,
                    helper, token)
        self.spans.append(span)
        if kind == "optim":
            self.optim_end[batch] = max(self.optim_end.get(batch, 0.0), span.end)
        return span

    def timeline(self, schedule: str, devices: Sequence[DeviceInfo], workload: Any, wall: float) -> Timeline:
        """The run so far as a :class:`Timeline`."""
        return Timeline(schedule, list(devices), workload, list(self.spans), wall, len(self.spans),
                        dict(self.optim_end))


def busy_seconds(spans: Iterable[Span], start: float, end: float, kinds: frozenset[str] = COMPUTE_KINDS) -> float:
    """Seconds of ``[start, end)`` covered by ``spans`` of ``kinds`` (one device's spans, non-overlapping)."""
    total = 0.0
    for s in spans:
        if s.kind in kinds:
            lo, hi = max(s.start, start), min(s.end, end)
            if hi > lo:
                total += hi - lo
    return total


def window_bubbles(spans: Iterable[Span], devices: Sequence[str], start: float, end: float,
                   running: dict[str, float] | None = None) -> dict[str, float]:
    """Bubble ratio (1 - compute time / window) per device over ``[start, end)``.

    ``running[device]`` is the start of a compute token still running at ``end``: it counts as busy.
    """
    length = max(end - start, 1e-9)
    by: dict[str, list[Span]] = {d: [] for d in devices}
    for s in spans:
        if s.device in by and s.end > start:
            by[s.device].append(s)
    out = {}
    for d in devices:
        busy = busy_seconds(by[d], start, end)
        if running and d in running:
            busy += max(0.0, end - max(start, running[d]))
        out[d] = max(0.0, min(1.0, 1.0 - busy / length))
    return out
