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

What runs beside a process matters too, not only how many: on this 2-core machine a rollout beside a
backward pass ran 8-13% slower than beside another rollout (the plan check's traces, 1 rollout / 1
trainer against 2 trainers in lockstep). ``Contention.mix`` holds a factor per running-kind mix
(``"rollout+train"``: every busy process's factor while exactly a rollout and a train token run),
fitted by :func:`fit_mix` to real runs' tokens; a mix it does not hold takes the count's factor, on the
fit's scale (``mix_scale``). Within
a mix all busy processes still slow alike (one work clock), which is what lets the planner see that
two trainers in lockstep (like beside like) outrun a rollout beside a trainer.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from digenrl.errors import ConfigError
from digenrl.schedule.base import Token
from digenrl.telemetry.spans import Span

__all__ = ["Contention", "WallClock", "alone_seconds", "fit_mix", "host_cores", "mix_key"]


def host_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mix_key(kinds: Iterable[str]) -> str:
    """The name of a running-kind mix: its kinds sorted, ``+``-joined (``"rollout+train"``)."""
    return "+".join(sorted(kinds))


@dataclass(frozen=True)
class Contention:
    """``cores`` shared by single-thread processes; ``slowdown[n]``: each one's run time factor when ``n`` are busy.

    ``slowdown`` holds measured counts (one process alone is 1). A count above the largest measured
    one ``k`` is time-shared from it: ``slowdown[k] x max(1, n / cores) / max(1, k / cores)``; a count
    between measured ones takes the nearest measured count below it. ``mix``: a factor per running-kind
    mix (:func:`mix_key`) where one was fitted; :meth:`mix_factor` gives any other mix its count's factor
    times ``mix_scale``, the fitted mixes' mean ratio to their counts' factors (the fit's own scale: its
    costs alone are priced against it).
    """

    cores: int
    slowdown: dict[int, float] = field(default_factory=dict)
    mix: dict[str, float] = field(default_factory=dict)
    mix_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ConfigError(f"contention.cores={self.cores}: needs at least 1")
        for n, f in self.slowdown.items():
            if n < 1 or not f > 0:
                raise ConfigError(f"contention.slowdown[{n}]={f}: needs a count >= 1 and a factor > 0")
        for key, f in self.mix.items():
            if not key or not f > 0:
                raise ConfigError(f"contention.mix[{key!r}]={f}: needs a kind mix and a factor > 0")
        if not self.mix_scale > 0:
            raise ConfigError(f"contention.mix_scale={self.mix_scale}: needs a factor > 0")

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

    def mix_factor(self, kinds: Sequence[str]) -> float:
        """Run time factor of each busy process while exactly ``kinds`` run (one entry per busy process)."""
        if len(kinds) <= 1:
            return 1.0
        fitted = self.mix.get(mix_key(kinds)) if self.mix else None
        return fitted if fitted is not None else self.factor(len(kinds)) * self.mix_scale

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cores": self.cores, "slowdown": {str(n): f for n, f in sorted(self.slowdown.items())}}
        if self.mix:
            out["mix"] = dict(sorted(self.mix.items()))
            out["mix_scale"] = self.mix_scale
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "contention") -> Contention:
        """Read :meth:`to_dict` back. Raises ConfigError naming the malformed field."""
        try:
            return cls(int(d["cores"]), {int(n): float(f) for n, f in d["slowdown"].items()},
                       {str(k): float(f) for k, f in d.get("mix", {}).items()}, float(d.get("mix_scale", 1.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where}: expected cores and slowdown ({type(exc).__name__}: {exc})") from exc


class WallClock:
    """Wall seconds of the simulator's work clock under ``contention``.

    The engine runs tokens on a work clock (a token of ``s`` seconds ends ``s`` work seconds after it
    starts); between two events the number of busy devices is fixed, so wall time there is work time x
    ``contention.mix_factor(busy kinds)``. :meth:`advance` records each event; :meth:`wall` maps any work
    time up to the last event back to wall seconds (piecewise linear, exact between events).
    """

    def __init__(self, contention: Contention) -> None:
        self.contention = contention
        self._work = [0.0]
        self._wall = [0.0]

    def advance(self, work: float, kinds: Sequence[str]) -> None:
        """The work clock reached ``work`` with one busy device per entry of ``kinds`` (its token's kind)
        since the previous event."""
        if work > self._work[-1]:
            self._wall.append(self._wall[-1] + (work - self._work[-1]) * self.contention.mix_factor(kinds))
            self._work.append(work)

    def wall(self, work: float) -> float:
        i = min(max(bisect.bisect_right(self._work, work) - 1, 0), len(self._work) - 1)
        if i == len(self._work) - 1:
            return self._wall[i]
        w0, w1, t0, t1 = self._work[i], self._work[i + 1], self._wall[i], self._wall[i + 1]
        return t0 + (work - w0) * (t1 - t0) / (w1 - w0)


def _mixes(spans: list[Span]) -> tuple[list[float], list[tuple[str, ...]]]:
    """The run's event times and, between each two, the kinds of its busy devices (one entry per span)."""
    edges = sorted({t for s in spans for t in (s.start, s.end)})
    change: dict[float, Counter[str]] = {t: Counter() for t in edges}
    for s in spans:
        if s.end > s.start:
            change[s.start][s.kind] += 1
            change[s.end][s.kind] -= 1
    running: Counter[str] = Counter()
    mixes = []
    for t in edges[:-1]:
        running.update(change[t])  # update adds counts, negative ones included
        mixes.append(tuple(sorted(running.elements())))
    return edges, mixes


def _time_in(edges: list[float], mixes: list[tuple[str, ...]], lo: float, hi: float) -> dict[tuple[str, ...], float]:
    """Seconds of ``[lo, hi)`` spent in each mix."""
    out: dict[tuple[str, ...], float] = {}
    i = max(bisect.bisect_right(edges, lo) - 1, 0)
    while i < len(mixes) and edges[i] < hi:
        overlap = min(hi, edges[i + 1]) - max(lo, edges[i])
        if overlap > 0:
            out[mixes[i]] = out.get(mixes[i], 0.0) + overlap
        i += 1
    return out


def _spans_of(tokens: list[tuple[Token, float]], spans: list[Span]
              ) -> list[tuple[Token, float, dict[tuple[str, ...], float] | None]]:
    """Each token with its seconds and the time its span spent in each running-kind mix (``None``: no span)."""
    edges, mixes = _mixes(spans)
    where = {(s.device, s.token): (s.start, s.end) for s in spans}
    out = []
    for token, seconds in tokens:
        span = where.get((token.device, token.id))
        out.append((token, seconds, _time_in(edges, mixes, *span) if span and span[1] > span[0] else None))
    return out


def alone_seconds(tokens: list[tuple[Token, float]], spans: list[Span],
                  contention: Contention) -> list[tuple[Token, float]]:
    """Each measured token's seconds as if its process had run alone on the host.

    A real run's token ran while others were busy: its seconds divided by the mean of
    ``contention.mix_factor(busy kinds)`` over its span (every span of the run counts its device as a
    busy process, as the engine counts them). Fitting costs to these and simulating with the same
    contention prices a placement with more, fewer or other busy processes than the runs had. A token
    without a span keeps its seconds.
    """
    out = []
    for token, seconds, time_in in _spans_of(tokens, spans):
        if time_in:
            mean = sum(t * contention.mix_factor(m) for m, t in time_in.items()) / sum(time_in.values())
            seconds /= mean
        out.append((token, seconds))
    return out


def fit_mix(runs: Sequence[tuple[list[tuple[Token, float]], list[Span]]], alone: Callable[[Token], float],
            contention: Contention, min_share: float = 0.02, prior_weight: float = 0.05) -> Contention:
    """``contention`` with a factor per running-kind mix, fitted to real runs' tokens.

    Each token ``i`` of ``runs`` (its measured seconds ``s_i`` and its run's spans) gives one equation:
    ``s_i / alone(token_i) = sum over mixes m of (share of its span in m) x F_m``, where ``alone`` is a
    cost fit of the tokens taken back to their process alone. A mix of two or more busy processes that
    holds at least ``min_share`` of the tokens' time gets its own ``F_m`` (least squares, weighted by the
    token's seconds, pulled toward the count's factor with ``prior_weight`` of the data's weight, so a
    mix seen briefly stays near it); a lone process is 1. A rarer mix, or one the runs never had, takes
    its count's factor times ``mix_scale``: the fitted factors' mean ratio to their counts' (weighted by
    the time in each), as the alone costs fitted beside them are priced on that scale.
    """
    import numpy as np

    base = Contention(contention.cores, contention.slowdown)
    rows = [(s, a, t) for tokens, spans in runs for token, s, t in _spans_of(tokens, spans)
            if t and s > 0 and (a := alone(token)) > 0]
    total: dict[tuple[str, ...], float] = {}
    for _, _, time_in in rows:
        for m, t in time_in.items():
            total[m] = total.get(m, 0.0) + t
    everything = sum(total.values())
    free = sorted(m for m, t in total.items() if len(m) > 1 and t >= min_share * everything)
    if not free:
        return base
    col = {m: j for j, m in enumerate(free)}
    a_rows, b_rows, weights = [], [], []
    for s, a, time_in in rows:
        span = sum(time_in.values())
        coef = np.zeros(len(free))
        fixed = 0.0
        for m, t in time_in.items():
            if m in col:
                coef[col[m]] += t / span
            else:
                fixed += t / span * base.mix_factor(m)
        a_rows.append(coef)
        b_rows.append(s / a - fixed)
        weights.append(span)
    w = np.sqrt(np.asarray(weights))
    a_mat, b_vec = np.asarray(a_rows) * w[:, None], np.asarray(b_rows) * w
    prior = np.sqrt(prior_weight * float(np.sum(w ** 2)) / len(free))
    a_mat = np.vstack([a_mat, prior * np.eye(len(free))])
    b_vec = np.concatenate([b_vec, [prior * base.factor(len(m)) for m in free]])
    fitted, *_ = np.linalg.lstsq(a_mat, b_vec, rcond=None)
    mix = {m: max(float(f), 0.1) for m, f in zip(free, fitted)}
    scale = sum(total[m] * f / base.factor(len(m)) for m, f in mix.items()) / sum(total[m] for m in mix)
    return Contention(base.cores, base.slowdown, {mix_key(m): f for m, f in mix.items()}, scale)
