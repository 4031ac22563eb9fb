"""TAG's switch cost is part of its decision (``base.SwitchCost``), and helping ahead keeps staleness <= 1."""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.schedule import Device, Role, UniformCost, Workload, make_schedule
from digenrl.schedule._replay import replay
from digenrl.schedule.base import Token, TokenKind

TINY = Workload(num_batches=1, prompts_per_batch=2, group_size=1, num_steps=4, trained_steps=1)
OPTS = {"fragment_groups": 1, "step_chunk": 2, "tag_steps": 2, "rollout_batch": 1}


@dataclass(frozen=True)
class SwitchingCost:
    """UniformCost plus a TAG onload/offload of ``switch`` seconds."""

    switch: float
    base: UniformCost = UniformCost()

    def seconds(self, token: Token, device: Device) -> float:
        return self.base.seconds(token, device)

    def helper_switch_seconds(self, device: Device) -> float:
        return self.switch / device.speed


def _helper_tokens(cost: object) -> list[Token]:
    devices = [Device("r0", Role.ROLLOUT, 0.25), Device("t0", Role.TRAINER)]
    schedule = make_schedule("tag", devices, TINY, cost, **OPTS)  # type: ignore[arg-type]
    by_name = {d.name: d for d in devices}
    rep = replay(schedule, devices, lambda t: cost.seconds(t, by_name[t.device]))  # type: ignore[attr-defined]
    assert rep.done
    return [s.token for s in rep.spans if s.token.helper and s.token.kind is TokenKind.ROLLOUT]


def test_cheap_switch_keeps_the_helper_and_a_costly_one_removes_it() -> None:
    # Slow rollout device: with a free switch the trainer generates fragment 1 itself (golden
    # "tag-slow-rollout"); a 10 s onload + offload is longer than the whole batch, so it must not.
    assert _helper_tokens(SwitchingCost(0.0))
    assert _helper_tokens(UniformCost())  # no SwitchCost: switches count 0
    assert _helper_tokens(SwitchingCost(10.0)) == []


def test_helper_ahead_is_at_most_one_version_stale() -> None:
    w = Workload(num_batches=3, prompts_per_batch=2, group_size=1, num_steps=4, trained_steps=1)
    devices = [Device("r0", Role.ROLLOUT, 0.5), Device("t0", Role.TRAINER)]
    cost = UniformCost()
    schedule = make_schedule("async1", devices, w, cost, **OPTS)
    by_name = {d.name: d for d in devices}
    rep = replay(schedule, devices, lambda t: cost.seconds(t, by_name[t.device]))
    assert rep.done
    ahead = [s.token for s in rep.spans if s.token.helper and s.token.kind is TokenKind.ROLLOUT
             and s.token.batch > s.token.policy_version]
    assert ahead, "the idle trainer should start the next batch with its current version"
    for s in rep.spans:
        if s.token.kind in (TokenKind.ROLLOUT, TokenKind.TRAIN):
            assert 0 <= s.token.batch - s.token.policy_version <= 1
