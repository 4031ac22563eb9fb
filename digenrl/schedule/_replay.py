"""A tiny deterministic driver: runs a schedule on a virtual clock and records what happened.

It is the reference for what any driver must do (see ``digenrl.schedule.base``): start each token
on the devices it names, deliver ``TokenDone`` when its duration has passed, deliver deaths and
joins at their times, never deliver a dead device's completion. Tests use it with random durations
and faults; the simulator may reuse it with its cost model as ``duration``.

Ties at one instant are broken by insertion order, so a replay is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from digenrl.schedule.base import Device, DeviceDied, DeviceJoined, Schedule, Token, TokenDone

__all__ = ["Span", "Fault", "Replay", "replay"]


@dataclass(slots=True)
class Span:
    """One issued token: when it started and ended (``end`` None: voided by a death).

    ``issued_seq``/``ended_seq`` are the indices of the events that issued and completed it
    (``-1`` = ``start()``), which order things happening at the same instant.
    """

    token: Token
    start: float
    issued_seq: int
    end: float | None = None
    ended_seq: int | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """A death or a join, delivered at virtual time ``at``."""

    at: float
    event: DeviceDied | DeviceJoined


@dataclass(slots=True)
class Replay:
    """What a replay produced: spans in issue order, deaths/joins with their event index."""

    spans: list[Span] = field(default_factory=list)
    deaths: list[tuple[int, float, str]] = field(default_factory=list)  # (seq, time, device)
    joins: list[tuple[int, float, str]] = field(default_factory=list)
    events: int = 0
    clock: float = 0.0
    done: bool = False
    failed: str | None = None
    stalled: bool = False  # nothing running, nothing pending, not done: a liveness bug


def replay(
    schedule: Schedule,
    devices: Sequence[Device],
    duration: Callable[[Token], float],
    faults: Sequence[Fault] = (),
    max_events: int = 10_000_000,
    record: bool = True,
) -> Replay:
    """Drive ``schedule`` to completion on a virtual clock.

    Args:
        schedule: a fresh schedule (``start()`` not yet called).
        devices: the devices it was built with (alive at time zero).
        duration: seconds a token takes (called once per token, when it starts).
        faults: deaths and joins to deliver.
        max_events: safety bound on delivered events.
        record: keep every span (off for big simulations that only need the clock).

    Raises:
        ValueError: the schedule broke the driver contract (a token for a busy, dead or unknown
            device, or a non-positive duration).
    """
    out = Replay()
    busy: dict[str, int] = {}  # device -> running token id
    alive: set[str] = set()
    spans: dict[int, Span] = {}
    heap: list[tuple[float, int, int, object]] = []  # (time, order, kind 0=done 1=fault, payload)
    order = 0
    for f in faults:
        heapq.heappush(heap, (f.at, order, 1, f.event))
        order += 1

    def launch(tokens: list[Token], now: float, seq: int) -> None:
        nonlocal order
        for token in tokens:
            for name in token.devices:
                if name not in alive:
                    raise ValueError(f"token {token.id} ({token.kind}) issued to dead or unknown device {name!r}")
                if name in busy:
                    raise ValueError(f"token {token.id} ({token.kind}) issued to {name!r}, busy with token {busy[name]}")
                busy[name] = token.id
            secs = duration(token)
            if not secs > 0:
                raise ValueError(f"duration of token {token.id} is {secs!r}: must be > 0")
            span = Span(token, now, seq)
            spans[token.id] = span
            if record:
                out.spans.append(span)
            heapq.heappush(heap, (now + secs, order, 0, token))
            order += 1

    alive.update(d.name for d in devices)
    launch(schedule.start(), 0.0, -1)
    seq = 0
    while heap and not schedule.done and not schedule.failed and seq < max_events:
        now, _, kind, payload = heapq.heappop(heap)
        out.clock = now
        if kind == 0:
            token = payload
            assert isinstance(token, Token)
            span = spans.pop(token.id, None)
            if span is None:
                continue  # voided by a death
            span.end, span.ended_seq = now, seq
            for name in token.devices:
                if busy.get(name) == token.id:
                    del busy[name]
            tokens = schedule.on_event(TokenDone(token, observed_seconds=now - span.start))
        elif isinstance(payload, DeviceDied):
            name = payload.device
            if name not in alive:
                continue
            alive.discard(name)
            out.deaths.append((seq, now, name))
            token_id = busy.pop(name, None)
            if token_id is not None:
                span = spans.pop(token_id)
                for other in span.token.devices:  # a collective dies with any member
                    if busy.get(other) == token_id:
                        del busy[other]
            tokens = schedule.on_event(payload)
        else:
            assert isinstance(payload, DeviceJoined)
            if payload.device.name in alive:
                continue
            alive.add(payload.device.name)
            out.joins.append((seq, now, payload.device.name))
            tokens = schedule.on_event(payload)
        launch(tokens, now, seq)
        seq += 1
    out.events = seq
    out.done = schedule.done
    out.failed = schedule.failed
    out.stalled = not out.done and not out.failed and not busy and seq < max_events
    return out

