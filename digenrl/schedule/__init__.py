"""Schedules: pure, I/O-free state machines from events (completions, deaths, joins) to tokens.

``make_schedule(name, devices, workload)`` builds one of ``SCHEDULES``; ``build_schedule`` takes a
``ScheduleOptions`` to switch each technique alone. The real coordinator and the simulator drive the
same objects (see ``digenrl.schedule.base`` for the driver contract, ``digenrl.schedule._replay``
for a deterministic virtual-time driver).
"""

from __future__ import annotations

from digenrl.errors import ConfigError
from digenrl.schedule.base import (
    CostEstimate,
    SwitchCost,
    Device,
    DeviceDied,
    DeviceJoined,
    Event,
    Fragment,
    Role,
    Schedule,
    Token,
    TokenDone,
    TokenKind,
    Workload,
)
from digenrl.schedule.colocated import ColocatedSchedule
from digenrl.schedule.cost import SpeedTracker, UniformCost
from digenrl.schedule.disaggregated import DisaggregatedSchedule
from digenrl.schedule.options import PRESETS, SCHEDULES, ScheduleOptions, with_overrides

__all__ = [
    "SCHEDULES",
    "PRESETS",
    "ScheduleOptions",
    "make_schedule",
    "build_schedule",
    "ColocatedSchedule",
    "DisaggregatedSchedule",
    "UniformCost",
    "SpeedTracker",
    "CostEstimate",
    "SwitchCost",
    "Device",
    "DeviceDied",
    "DeviceJoined",
    "Event",
    "Fragment",
    "Role",
    "Schedule",
    "Token",
    "TokenDone",
    "TokenKind",
    "Workload",
]


def build_schedule(
    devices: list[Device],
    workload: Workload,
    options: ScheduleOptions,
    cost: CostEstimate | None = None,
    name: str | None = None,
) -> Schedule:
    """A schedule with exactly the given switches.

    Raises:
        ConfigError: invalid options, or devices whose roles the schedule cannot use.
    """
    if options.colocated:
        return ColocatedSchedule(devices, workload, options, cost, name or "colocated")
    return DisaggregatedSchedule(devices, workload, options, cost, name or "disaggregated")


def make_schedule(
    name: str,
    devices: list[Device],
    workload: Workload,
    cost: CostEstimate | None = None,
    **options: object,
) -> Schedule:
    """The named schedule (one of ``SCHEDULES``), with optional per-option overrides.

    Each name after ``disaggregated`` adds its technique to the previous ones: ``gap``, ``tsp``
    (+ gap), ``tag`` (+ gap, tsp), ``async1`` (+ gap, tsp, tag, staleness 1: the full digenrl
    schedule). Overrides are ``ScheduleOptions`` fields, e.g. ``make_schedule("tag", ..., tsp=False)``.

    Raises:
        ConfigError: an unknown name or option, or an invalid combination.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown schedule {name!r}: allowed are {list(SCHEDULES)}")
    return build_schedule(devices, workload, with_overrides(PRESETS[name], options), cost, name)
