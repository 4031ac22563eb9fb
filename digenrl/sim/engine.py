"""The virtual-clock driver: runs a real schedule object against a cost model, in CPU seconds.

The simulator is a driver in the sense of ``digenrl.schedule.base``: it calls ``start()``, runs
every returned token on the device(s) it names for the cost model's predicted seconds, and feeds
``TokenDone`` back at the token's virtual completion time. Running tokens sit in a heap keyed by
completion time (ties broken by issue order, so runs are deterministic). Every executed token
becomes one :class:`~digenrl.telemetry.spans.Span` per occupied device, and the run one
:class:`~digenrl.telemetry.spans.Timeline`, as a real run's.

A trainer that changes between training and TAG helping (``Token.helper``) first pays the cost
model's ``tag_switch_seconds`` (onload/offload of the rollout weights); that time is recorded as a
SWITCH span and is not reported to the schedule as the token's own run time.

``sync_aborts`` models a peer whose rollout engines abort the requests in flight when new weights
arrive and regenerate them (veRL-Omni v0.3, issues #586/#610): when a PUBLISH ends, every ROLLOUT
token running on a rollout device starts over; the work thrown away becomes an ``abort`` span
(overhead, not compute) and the token ends that much later.

``links`` models far sites behind slow links (:mod:`digenrl.sim.link_traffic`): a token that moves data
across one (a publication, a far fragment's upload or latents) holds its devices for the transfer, as the
runtime's do, and can be held longer still, when data queued ahead of the reply it awaits; a token whose
version has not reached its site yet first waits, as a ``link`` span.

``contention`` models devices that are single-thread processes sharing a CPU host's cores
(:mod:`digenrl.sim.contention`): the engine then runs on a work clock, every busy device advancing at
``1 / contention.mix_factor(kinds the busy devices run)``, and maps every time back to wall seconds at
the end. Without it work and wall seconds are the same and nothing is mapped.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from digenrl.errors import DigenrlError
from digenrl.schedule.base import Device, Role, Schedule, Token, TokenDone, TokenKind, Workload
from digenrl.sim.contention import Contention, WallClock
from digenrl.sim.link_traffic import LinkTraffic
from digenrl.telemetry.spans import Span, Timeline

__all__ = ["SimulationError", "TokenCost", "simulate"]


class TokenCost(Protocol):
    """What the engine asks of a cost model: the fitted ``CostModel`` or a ``MeasuredCost``."""

    def seconds(self, token: Token, device: Device) -> float: ...

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float: ...


class SimulationError(DigenrlError):
    """The schedule broke the driver contract (busy device, unknown device) or stalled."""


def simulate(schedule: Schedule, devices: list[Device], workload: Workload, cost: TokenCost,
             max_tokens: int = 50_000_000, sync_aborts: bool = False,
             contention: Contention | None = None, links: LinkTraffic | None = None) -> Timeline:
    """Run ``schedule`` to completion on a virtual clock.

    Args:
        schedule: a fresh schedule object (``start()`` not yet called).
        devices: the devices the schedule was built with.
        workload: the workload the schedule was built with (kept for the metrics).
        cost: predicts each token's seconds.
        max_tokens: safety bound against a schedule that never finishes.
        sync_aborts: every weight publication restarts the rollouts in flight (see the module docstring).
        contention: the devices share a host's cores (see the module docstring); ``None``: each owns its compute.
        links: the far sites' links (``link_traffic.py``): a token's transfers lengthen it, a version not yet
            at its site is waited for as a ``link`` span; ``None``: one fabric.

    Raises:
        SimulationError: a token names an unknown or busy device, the schedule stalls (no token
            running and not done), it reports ``failed``, or ``max_tokens`` is exceeded.
    """
    by_name = {d.name: d for d in devices}
    busy: dict[str, Token] = {}  # device -> the token it runs
    mode: dict[str, bool] = {}  # trainer -> currently set up as a helper (holds rollout weights)
    heap: list[tuple[float, int, float, Token]] = []
    spans: list[Span] = []
    rollout_span: dict[int, int] = {}  # token id -> index of its span (sync_aborts only)
    optim_end: dict[int, float] = {}
    clock = WallClock(contention) if contention is not None else None
    began: dict[int, float] = {}  # token id -> work time its own run began (after a switch; contention only)
    first_span: dict[int, int] = {}  # running token id -> index of its first span (links only)
    seq = 0
    now = 0.0

    def launch(tokens: list[Token]) -> None:
        nonlocal seq
        for token in tokens:
            occupied = token.devices
            for name in occupied:
                if name not in by_name:
                    raise SimulationError(f"token {token.id} ({token.kind}) names unknown device {name!r}")
                if name in busy:
                    raise SimulationError(f"token {token.id} ({token.kind}) issued to busy device {name!r} "
                                          f"(running token {busy[name].id})")
            device = by_name[token.device]
            start = now
            if device.role is Role.TRAINER and token.kind in (TokenKind.ROLLOUT, TokenKind.REWARD, TokenKind.TRAIN):
                want_helper = token.kind is not TokenKind.TRAIN
                if mode.get(device.name, False) != want_helper:
                    mode[device.name] = want_helper
                    extra = cost.tag_switch_seconds(device.name, want_helper)
                    spans.append(Span(device.name, TokenKind.SWITCH, token.batch, -1, token.policy_version,
                                      start, start + extra, helper=want_helper, token=token.id))
                    start += extra
            if links is not None and (wait := links.wait(token, device.name, start)) > 0:
                spans.extend(Span(name, "link", token.batch, token.fragment, token.policy_version, start, start + wait,
                                  token=token.id) for name in occupied)
                start += wait
            seconds = cost.seconds(token, device)
            if links is not None:
                seconds += links.carry(token, device.name, start, seconds)
                first_span[token.id] = len(spans)
            end = start + seconds
            if clock is not None:
                began[token.id] = start
            if sync_aborts and token.kind is TokenKind.ROLLOUT and device.role is Role.ROLLOUT:
                rollout_span[token.id] = len(spans)
            for name in occupied:
                busy[name] = token
                spans.append(Span(name, token.kind, token.batch, token.fragment, token.policy_version, start, end,
                                  token.num_samples if name == token.device else 0, token.helper, token.id))
            heapq.heappush(heap, (end, seq, seconds, token))
            seq += 1

    launch(schedule.start())
    issued = len(heap)
    while heap:
        now, order, seconds, token = heapq.heappop(heap)
        if links is not None and (later := links.hold(token, now)) > now:  # a reply it awaits queued behind data
            for i in range(first_span[token.id], first_span[token.id] + len(token.devices)):
                spans[i] = spans[i]._replace(end=later)
            heapq.heappush(heap, (later, order, seconds + later - now, token))
            continue
        first_span.pop(token.id, None)
        if clock is not None:
            clock.advance(now, [t.kind.value for t in busy.values()])  # what ran since the previous event
            seconds = clock.wall(now) - clock.wall(began.pop(token.id))  # what a real driver observes
        for name in token.devices:
            del busy[name]
        if links is not None:
            links.done(token, now)
        if token.kind is TokenKind.OPTIM:
            optim_end[token.batch] = now
        if token.kind is TokenKind.ROLLOUT:
            rollout_span.pop(token.id, None)
        elif token.kind is TokenKind.PUBLISH and rollout_span:
            heap = _abort_rollouts(heap, spans, rollout_span, now)
        new = schedule.on_event(TokenDone(token, observed_seconds=seconds))
        if schedule.failed:
            raise SimulationError(f"schedule {schedule.name!r} failed at t={now:.3f}s: {schedule.failed}")
        issued += len(new)
        if issued > max_tokens:
            raise SimulationError(f"more than {max_tokens} tokens issued; the schedule does not converge")
        launch(new)
    if not schedule.done:
        raise SimulationError(f"schedule {schedule.name!r} stalled at t={now:.3f}s: nothing running and not done")
    if clock is not None:
        spans = [s._replace(start=clock.wall(s.start), end=clock.wall(s.end)) for s in spans]
        optim_end = {b: clock.wall(t) for b, t in optim_end.items()}
        now = clock.wall(now)
    return Timeline(schedule.name, list(devices), workload, spans, now, issued, optim_end)


def _abort_rollouts(heap: list[tuple[float, int, float, Token]], spans: list[Span], running: dict[int, int],
                    now: float) -> list[tuple[float, int, float, Token]]:
    """Restart every tracked ROLLOUT token at ``now``: its elapsed part becomes an ``abort`` span."""
    out = []
    for end, seq, seconds, token in heap:
        i = running.get(token.id)
        if i is not None and spans[i].start < now:
            old = spans[i]
            spans[i] = old._replace(kind="abort", end=now, samples=0)
            running[token.id] = len(spans)
            spans.append(old._replace(start=now, end=end + (now - old.start)))
            end += now - old.start
        out.append((end, seq, seconds, token))
    heapq.heapify(out)
    return out
