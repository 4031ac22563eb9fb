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
"""

from __future__ import annotations

import heapq

from digenrl.errors import DigenrlError
from digenrl.schedule.base import Device, Role, Schedule, Token, TokenDone, TokenKind, Workload
from digenrl.sim.cost import CostModel
from digenrl.telemetry.spans import Span, Timeline

__all__ = ["SimulationError", "simulate"]


class SimulationError(DigenrlError):
    """The schedule broke the driver contract (busy device, unknown device) or stalled."""


def simulate(schedule: Schedule, devices: list[Device], workload: Workload, cost: CostModel,
             max_tokens: int = 50_000_000) -> Timeline:
    """Run ``schedule`` to completion on a virtual clock.

    Args:
        schedule: a fresh schedule object (``start()`` not yet called).
        devices: the devices the schedule was built with.
        workload: the workload the schedule was built with (kept for the metrics).
        cost: predicts each token's seconds.
        max_tokens: safety bound against a schedule that never finishes.

    Raises:
        SimulationError: a token names an unknown or busy device, the schedule stalls (no token
            running and not done), it reports ``failed``, or ``max_tokens`` is exceeded.
    """
    by_name = {d.name: d for d in devices}
    busy: dict[str, int] = {}
    mode: dict[str, bool] = {}  # trainer -> currently set up as a helper (holds rollout weights)
    heap: list[tuple[float, int, float, Token]] = []
    spans: list[Span] = []
    optim_end: dict[int, float] = {}
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
                    raise SimulationError(
                        f"token {token.id} ({token.kind}) issued to busy device {name!r} (running token {busy[name]})")
            device = by_name[token.device]
            start = now
            if device.role is Role.TRAINER and token.kind in (TokenKind.ROLLOUT, TokenKind.REWARD, TokenKind.TRAIN):
                want_helper = token.kind is not TokenKind.TRAIN
                if mode.get(device.name, False) != want_helper:
                    mode[device.name] = want_helper
                    extra = cost.tag_switch_seconds(device.name)
                    spans.append(Span(device.name, TokenKind.SWITCH, token.batch, -1, token.policy_version,
                                      start, start + extra, helper=want_helper, token=token.id))
                    start += extra
            seconds = cost.seconds(token, device)
            end = start + seconds
            for name in occupied:
                busy[name] = token.id
                spans.append(Span(name, token.kind, token.batch, token.fragment, token.policy_version, start, end,
                                  token.num_samples if name == token.device else 0, token.helper, token.id))
            heapq.heappush(heap, (end, seq, seconds, token))
            seq += 1

    launch(schedule.start())
    issued = len(heap)
    while heap:
        now, _, seconds, token = heapq.heappop(heap)
        for name in token.devices:
            del busy[name]
        if token.kind is TokenKind.OPTIM:
            optim_end[token.batch] = now
        new = schedule.on_event(TokenDone(token, observed_seconds=seconds))
        if schedule.failed:
            raise SimulationError(f"schedule {schedule.name!r} failed at t={now:.3f}s: {schedule.failed}")
        issued += len(new)
        if issued > max_tokens:
            raise SimulationError(f"more than {max_tokens} tokens issued; the schedule does not converge")
        launch(new)
    if not schedule.done:
        raise SimulationError(f"schedule {schedule.name!r} stalled at t={now:.3f}s: nothing running and not done")
    return Timeline(schedule.name, list(devices), workload, spans, now, issued, optim_end)
