"""Processes sharing a host's CPU cores: how much each busy one slows when several run at once.

On one CPU host every actor is a single-thread process, so a schedule with more busy processes than
cores time-shares them (``digenrl bench bubbles --real``: rollout, trainer and reward actor on 2
cores). :class:`Contention` holds the slowdown measured for each number of busy processes (the bench
runs 2 and 3 independent single-thread colocated loops at once: ``real-2x1thread``,
``real-3x1thread``) and extends it by time-sharing beyond the largest measured count.

Why per moment, in the engine, and not one factor per row: a process slows only while others are
busy *with it*. The reward actor idles between batches, so charging every token the 3-process
slowdown would overshoot; the simulator knows which devices run a token at each instant, so
:class:`WallClock` lets it advance every running token at ``1 / slowdown(busy devices)``. All busy
processes share alike, so one work clock for the whole run is enough: tokens keep their order on it,
and only the mapping from work seconds to wall seconds changes at each launch and completion.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Any

from digenrl.errors import ConfigError
from digenrl.schedule.base import Token
from digenrl.telemetry.spans import Span

__all__ = ["Contention", "WallClock", "alone_seconds", "host_cores"]


def host_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Contention:
    """``cores`` shared by single-thread processes; ``slowdown[n]``: each one's run time factor when ``n`` are busy.

    ``slowdown`` holds measured counts (one process alone is 1). A count above the largest measured
    one ``k`` is time-shared from it: ``slowdown[k] x max(1, n / cores) / max(1, k / cores)``; a count
    between measured ones takes the nearest measured count below it.
    """

    cores: int
    slowdown: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ConfigError(f"contention.cores={self.cores}: needs at least 1")
        for n, f in self.slowdown.items():
            if n < 1 or not f > 0:
                raise ConfigError(f"contention.slowdown[{n}]={f}: needs a count >= 1 and a factor > 0")

    def factor(self, busy: int) -> float:
        """Run time factor of each of ``busy`` processes running at once (1 for 0 or 1 busy)."""
        if busy <= 1:
            return 1.0
        if busy in self.slowdown:
            return self.slowdown[busy]
        below = [n for n in self.slowdown if n <= busy]
        k = max(below, default=1)
        measured = self.slowdown.get(k, 1.0)
        return measured * max(1.0, busy / self.cores) / max(1.0, k / self.cores)

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "slowdown": {str(n): f for n, f in sorted(self.slowdown.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "contention") -> Contention:
        """Read :meth:`to_dict` back. Raises ConfigError naming the malformed field."""
        try:
            return cls(int(d["cores"]), {int(n): float(f) for n, f in d["slowdown"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where}: expected cores and slowdown ({type(exc).__name__}: {exc})") from exc


class WallClock:
    """Wall seconds of the simulator's work clock under ``contention``.

    The engine runs tokens on a work clock (a token of ``s`` seconds ends ``s`` work seconds after it
    starts); between two events the number of busy devices is fixed, so wall time there is work time x
    ``contention.factor(busy)``. :meth:`advance` records each event; :meth:`wall` maps any work time up
    to the last event back to wall seconds (piecewise linear, exact between events).
    """

    def __init__(self, contention: Contention) -> None:
        self.contention = contention
        self._work = [0.0]
        self._wall = [0.0]

    def advance(self, work: float, busy: int) -> None:
        """The work clock reached ``work`` with ``busy`` devices busy since the previous event."""
        if work > self._work[-1]:
            self._wall.append(self._wall[-1] + (work - self._work[-1]) * self.contention.factor(busy))
            self._work.append(work)

    def wall(self, work: float) -> float:
        i = min(max(bisect.bisect_right(self._work, work) - 1, 0), len(self._work) - 1)
        if i == len(self._work) - 1:
            return self._wall[i]
        w0, w1, t0, t1 = self._work[i], self._work[i + 1], self._wall[i], self._wall[i + 1]
        return t0 + (work - w0) * (t1 - t0) / (w1 - w0)


def alone_seconds(tokens: list[tuple[Token, float]], spans: list[Span],
                  contention: Contention) -> list[tuple[Token, float]]:
    """Each measured token's seconds as if its process had run alone on the host.

    A real run's token ran while others were busy: its seconds divided by the mean of
    ``contention.factor(busy processes)`` over its span (every span of the run counts its device as a
    busy process, as the engine counts them). Fitting costs to these and simulating with the same
    contention prices a placement with more or fewer busy processes than the runs had. A token without
    a span keeps its seconds.
    """
    edges = sorted({t for s in spans for t in (s.start, s.end)})
    delta = {t: 0 for t in edges}
    for s in spans:
        if s.end > s.start:
            delta[s.start] += 1
            delta[s.end] -= 1
    cum, busy, area = [0.0], 0, 0.0  # cum[i]: integral of the factor from edges[0] to edges[i]
    for a, b in zip(edges, edges[1:]):
        busy += delta[a]
        area += (b - a) * contention.factor(busy)
        cum.append(area)

    def mean_factor(lo: float, hi: float) -> float:
        def integral(t: float) -> float:
            i = min(max(bisect.bisect_right(edges, t) - 1, 0), len(edges) - 1)
            rate = (cum[i + 1] - cum[i]) / (edges[i + 1] - edges[i]) if i + 1 < len(edges) else 0.0
            return cum[i] + (t - edges[i]) * rate

        return (integral(hi) - integral(lo)) / (hi - lo) if hi > lo else 1.0

    where = {(s.device, s.token): (s.start, s.end) for s in spans}
    out = []
    for token, seconds in tokens:
        span = where.get((token.device, token.id))
        out.append((token, seconds / mean_factor(*span) if span else seconds))
    return out
