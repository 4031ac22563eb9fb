"""Property tests: every schedule, random workloads, durations, speeds, deaths and joins.

Each example replays a schedule on the virtual-clock driver and hands the record to the independent
checker (tests/schedule/_checker.py): staleness bound, trajectory consistency, exactly-once
training, one OPTIM per batch after its rows, no device double-booked, TAG never ahead of ready
training, lost work re-issued, and liveness while a trainer and a generator survive.
"""

from __future__ import annotations

import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.schedule import (
    PRESETS,
    SCHEDULES,
    Device,
    DeviceDied,
    DeviceJoined,
    Role,
    ScheduleOptions,
    Token,
    TokenKind,
    UniformCost,
    Workload,
    build_schedule,
)
from digenrl.schedule._replay import Fault, replay
from tests.schedule._checker import Setup, check

SPEEDS = st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0])


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    steps = draw(st.integers(1, 8))
    return Workload(
        num_batches=draw(st.integers(1, 4)),
        prompts_per_batch=draw(st.integers(1, 6)),
        group_size=draw(st.integers(1, 4)),
        num_steps=steps,
        trained_steps=draw(st.integers(1, steps)),
    )


@st.composite
def scenarios(draw: st.DrawFn, options: ScheduleOptions | None = None) -> tuple:
    w = draw(workloads())
    if options is None:
        options = PRESETS[draw(st.sampled_from(SCHEDULES))]
    sizes = {
        "fragment_groups": draw(st.none() | st.integers(1, w.prompts_per_batch)),
        "fragment_members": draw(st.none() | st.integers(1, w.group_size)),
        "step_chunk": draw(st.none() | st.integers(1, w.num_steps)),
        "train_pack": draw(st.none() | st.integers(1, w.rows_per_batch)),
        "rollout_batch": draw(st.none() | st.integers(1, w.samples_per_batch)),
    }
    options = dataclasses.replace(options, **sizes)
    if options.colocated:
        devices = [Device(f"h{i}", Role.HYBRID, draw(SPEEDS)) for i in range(draw(st.integers(1, 4)))]
        join_roles = [Role.HYBRID, Role.REWARD]
    else:
        n_roll = draw(st.integers(0 if options.tag else 1, 4))
        devices = [Device(f"r{i}", Role.ROLLOUT, draw(SPEEDS)) for i in range(n_roll)]
        devices += [Device(f"t{i}", Role.TRAINER, draw(SPEEDS)) for i in range(draw(st.integers(1, 3)))]
        join_roles = [Role.ROLLOUT, Role.TRAINER, Role.REWARD]
    devices += [Device(f"w{i}", Role.REWARD, draw(SPEEDS)) for i in range(draw(st.integers(0, 2)))]
    faults = []
    names = [d.name for d in devices]
    for i in range(draw(st.integers(0, 4))):
        at = draw(st.floats(0.0, 40.0))
        if draw(st.booleans()):
            faults.append(Fault(at, DeviceDied(draw(st.sampled_from(names)))))
        else:
            d = Device(f"j{i}", draw(st.sampled_from(join_roles)), draw(SPEEDS))
            names.append(d.name)
            faults.append(Fault(at, DeviceJoined(d)))
    seed = draw(st.integers(0, 2**32 - 1))
    return w, options, devices, faults, seed


def run_and_check(w: Workload, options: ScheduleOptions, devices: list[Device], faults: list[Fault], seed: int):
    cost = UniformCost()
    schedule = build_schedule(devices, w, options, cost)
    roles = {d.name: d for d in devices}
    roles.update({f.event.device.name: f.event.device for f in faults if isinstance(f.event, DeviceJoined)})
    rng = random.Random(seed)

    def duration(token: Token) -> float:
        return cost.seconds(token, roles[token.device]) * rng.uniform(0.5, 2.0) + 1e-3

    rep = replay(schedule, devices, duration, faults)
    # (batch_advantages: a batch trains only once it is all scored, as without GAP)
    setup = Setup(w, options.staleness, options.gap and not options.batch_advantages, options.colocated,
                  {n: d.role for n, d in roles.items()}, frozenset(d.name for d in devices))
    errors = check(rep, setup)
    assert not errors, "\n".join(errors[:10])
    # Liveness: unless the survivors cannot make progress, the run finishes.
    alive = {d.name for d in devices}
    changes = [(q, n, False) for q, _, n in rep.deaths] + [(q, n, True) for q, _, n in rep.joins]
    for _, name, up in sorted(changes):  # what the schedule saw, in its order
        if up:
            alive.add(name)
        else:
            alive.discard(name)
    alive_roles = {roles[n].role for n in alive}
    if options.colocated:
        can_finish = Role.HYBRID in alive_roles
    else:
        can_finish = Role.TRAINER in alive_roles and (Role.ROLLOUT in alive_roles or options.tag)
    if rep.failed is not None:
        assert not can_finish, f"failed ({rep.failed}) although {sorted(alive)} could finish"
    else:
        assert rep.done, f"not done: stalled={rep.stalled} events={rep.events}"
    return schedule, rep


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_named_schedules_keep_invariants(scenario: tuple) -> None:
    run_and_check(*scenario)


SWITCHES = st.builds(
    ScheduleOptions,
    gap=st.booleans(),
    tsp=st.booleans(),
    tag=st.booleans(),
    staleness=st.sampled_from([0, 1]),
    batch_advantages=st.booleans(),
)


@SETTINGS
@given(SWITCHES.flatmap(lambda o: scenarios(o)))
def test_each_switch_alone_and_combined_keeps_invariants(scenario: tuple) -> None:
    run_and_check(*scenario)


@SETTINGS
@given(SWITCHES.flatmap(lambda o: scenarios(o)), st.booleans())
def test_batch_b_starts_with_version_b_minus_staleness_whatever_the_timing(scenario: tuple, resumed: bool) -> None:
    """With a rollout device alive (no faults), start versions are a function of the batch alone:
    runs are reproducible, and a one-step-stale run resumed holding version -1 starts batch 0 with it."""
    w, options, devices, _, seed = scenario
    if not any(d.role is Role.ROLLOUT for d in devices):
        return
    options = dataclasses.replace(options, previous_version=resumed and options.staleness == 1)
    if options.previous_version:
        rep = replay(build_schedule(devices, w, options, UniformCost()), devices,
                     lambda token: random.Random(seed + token.id).uniform(0.5, 2.0))
        assert rep.done
    else:
        _, rep = run_and_check(w, options, devices, [], seed)
    first = -1 if options.previous_version else 0
    starts = {(f.batch, f.index): s.token.policy_version for s in rep.spans
              if s.token.kind is TokenKind.ROLLOUT and s.token.step_start == 0 for f in s.token.fragments}
    assert starts and all(v == max(first, b - options.staleness) for (b, _), v in starts.items()), starts
