"""Options, factory errors, and the fault paths a driver relies on (deterministic cases)."""

from __future__ import annotations

import pytest

from digenrl.errors import ConfigError
from digenrl.schedule import (
    SCHEDULES,
    Device,
    DeviceDied,
    DeviceJoined,
    Role,
    TokenKind,
    Workload,
    make_schedule,
)
from digenrl.schedule._replay import Fault, replay

W = Workload(num_batches=3, prompts_per_batch=4, group_size=2, num_steps=4, trained_steps=2)
DIS = [Device("r0", Role.ROLLOUT), Device("r1", Role.ROLLOUT), Device("t0", Role.TRAINER), Device("t1", Role.TRAINER)]


def test_schedule_names_stack_techniques() -> None:
    assert SCHEDULES == ("colocated", "colocated-tsp", "disaggregated", "gap", "tsp", "tag", "async1")
    packed = make_schedule("colocated-tsp", [Device("h", Role.HYBRID)], W)
    assert (packed.opt.colocated, packed.opt.tsp, packed.opt.gap, packed.opt.tag) == (True, True, False, False)
    s = make_schedule("async1", DIS, W)
    assert (s.opt.gap, s.opt.tsp, s.opt.tag, s.opt.staleness) == (True, True, True, 1)
    alone = make_schedule("disaggregated", DIS, W, tag=True)
    assert (alone.opt.gap, alone.opt.tsp, alone.opt.tag) == (False, False, True)


@pytest.mark.parametrize(
    ("name", "devices", "options", "message"),
    [
        ("nope", DIS, {}, "unknown schedule 'nope'"),
        ("gap", DIS, {"bogus": 1}, "unknown schedule option(s) ['bogus']"),
        ("gap", DIS, {"staleness": 2}, "schedule.staleness=2"),
        ("gap", DIS, {"fragment_groups": 9}, "fragment_groups=9 exceeds prompts_per_batch=4"),
        ("gap", DIS, {"step_chunk": 0}, "schedule.step_chunk=0"),
        ("colocated", [Device("h", Role.HYBRID)], {"gap": True}, "colocated=true cannot be combined"),
        ("colocated", DIS, {}, "device 'r0' has role 'rollout'"),
        ("gap", [Device("h", Role.HYBRID)], {}, "device 'h' has role 'hybrid'"),
        ("gap", [Device("r0", Role.ROLLOUT)], {}, "at least one Role.TRAINER"),
        ("gap", [Device("t0", Role.TRAINER)], {}, "nothing can generate"),
        ("gap", [*DIS, Device("r0", Role.ROLLOUT)], {}, "device 'r0' is already alive"),
    ],
)
def test_bad_configuration_names_the_problem(name: str, devices: list[Device], options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_schedule(name, devices, W, **options)
    assert message in str(err.value)


def test_dead_last_trainer_stops_the_schedule() -> None:
    s = make_schedule("gap", DIS, W)
    rep = replay(s, DIS, lambda t: 1.0, [Fault(2.5, DeviceDied("t0")), Fault(3.5, DeviceDied("t1"))])
    assert not rep.done and s.failed is not None and "no trainer left" in s.failed
    assert s.on_event(DeviceJoined(Device("t9", Role.TRAINER))) == []  # stopped for good


def test_dead_rollout_device_work_is_reissued_elsewhere() -> None:
    s = make_schedule("tsp", DIS, W)
    rep = replay(s, DIS, lambda t: 1.0, [Fault(0.5, DeviceDied("r0"))])
    assert rep.done
    voided = [sp.token for sp in rep.spans if sp.end is None]
    assert voided and all(t.device == "r0" for t in voided)
    lost = {(f.batch, f.index) for t in voided for f in t.fragments}
    redone = {(f.batch, f.index) for sp in rep.spans if sp.end is not None and sp.token.kind is TokenKind.ROLLOUT
              and sp.token.step_start == 0 and sp.start >= 0.5 for f in sp.token.fragments}
    assert lost <= redone
    assert all(sp.token.device != "r0" for sp in rep.spans if sp.start > 0.5)


def test_joined_device_gets_work() -> None:
    devices = [Device("r0", Role.ROLLOUT), Device("t0", Role.TRAINER)]
    s = make_schedule("gap", devices, W)
    rep = replay(s, devices, lambda t: 1.0, [Fault(1.5, DeviceJoined(Device("r9", Role.ROLLOUT, speed=2.0)))])
    assert rep.done
    assert any(sp.token.device == "r9" and sp.token.kind is TokenKind.ROLLOUT for sp in rep.spans)


def test_heterogeneous_speed_sizes_tokens() -> None:
    devices = [Device("slow", Role.ROLLOUT, 1.0), Device("fast", Role.ROLLOUT, 3.0), Device("t0", Role.TRAINER)]
    wl = Workload(num_batches=1, prompts_per_batch=16, group_size=2, num_steps=4, trained_steps=1)
    s = make_schedule("tsp", devices, wl, fragment_groups=1, fragment_members=1, step_chunk=4)
    speed = {d.name: d.speed for d in devices}
    rep = replay(s, devices, lambda t: (1 + t.num_samples) / speed[t.device])  # real speeds match declared
    per = {"slow": 0, "fast": 0}
    for sp in rep.spans:
        if sp.token.kind is TokenKind.ROLLOUT:
            per[sp.token.device] += sp.token.num_samples
    assert per["fast"] >= 2 * per["slow"]
    biggest = {n: max(sp.token.num_samples for sp in rep.spans if sp.token.device == n
                       and sp.token.kind is TokenKind.ROLLOUT) for n in per}
    assert biggest["fast"] > biggest["slow"]  # bigger tokens for the faster device, not only more of them


def test_tsp_defaults_keep_streaming_and_short_helper_tokens() -> None:
    from digenrl.schedule.options import PRESETS, resolve

    wl = Workload(num_batches=1, prompts_per_batch=32, group_size=16, num_steps=10, trained_steps=2)
    sizes = resolve(PRESETS["async1"], wl, n_rollout=4, n_trainer=12)
    frag = sizes.fragment_groups * sizes.fragment_members
    assert sizes.rollout_batch == frag  # one fragment per token: fragments finish one by one
    assert sizes.step_chunk == wl.num_steps  # depth-first anyway: no extra tokens
    assert sizes.tag_steps == 2  # a helper returns to training after ceil(ceil(10/4)/2) steps
    # Step-level batching of several fragments keeps step ranges shorter than the trajectory.
    from digenrl.schedule.options import ScheduleOptions

    batched = resolve(ScheduleOptions(gap=True, tsp=True, rollout_batch=2 * frag), wl, n_rollout=4, n_trainer=12)
    assert batched.step_chunk == 3
