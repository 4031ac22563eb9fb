"""Deterministic tick tables: small cases whose token sequences were checked by hand, frozen.

Each line is ``start device kind batch detail`` from a replay; ``unit`` cases give every token one
second, ``cost`` cases use ``UniformCost`` durations (what the schedule itself predicts).
"""

from __future__ import annotations

import pytest

from digenrl.schedule import Device, Role, Token, TokenKind, UniformCost, Workload, make_schedule
from digenrl.schedule._replay import replay

R, T, H = (lambda n, s=1.0, role=role: Device(n, role, s) for role in (Role.ROLLOUT, Role.TRAINER, Role.HYBRID))
SMALL = Workload(num_batches=2, prompts_per_batch=2, group_size=2, num_steps=2, trained_steps=1)
TINY = Workload(num_batches=1, prompts_per_batch=2, group_size=1, num_steps=4, trained_steps=1)


def line(start: float, t: Token) -> str:
    text = f"{start:g} {t.device} {t.kind.value} b{t.batch}"
    frags = ",".join(str(f.index) for f in t.fragments)
    if t.kind is TokenKind.ROLLOUT:
        text += f" f{frags} s{t.step_start}-{t.step_end} v{t.policy_version}" + (" tag" if t.helper else "")
    elif t.kind is TokenKind.REWARD:
        text += f" f{frags}"
    elif t.kind is TokenKind.TRAIN:
        text += " " + " ".join(f"f{f.index}[{a}:{b}]" for f, (a, b) in zip(t.fragments, t.rows)) + f" v{t.policy_version}"
    elif t.kind is TokenKind.PUBLISH:
        text += f" v{t.policy_version}"
    elif t.kind is TokenKind.SWITCH:
        text += f" ->{t.switch_to}"
    elif t.kind is TokenKind.OPTIM:
        text += f" [{','.join(t.group)}]"
    return text


def table(name: str, devices: list[Device], workload: Workload, unit: bool, **options: object) -> list[str]:
    cost = UniformCost()
    by_name = {d.name: d for d in devices}
    schedule = make_schedule(name, devices, workload, cost, **options)
    rep = replay(schedule, devices, (lambda t: 1.0) if unit else (lambda t: cost.seconds(t, by_name[t.device])))
    assert rep.done
    return [line(round(s.start, 2), s.token) for s in rep.spans]


CASES = {
    # Naive split: a full-batch barrier, then OPTIM, then PUBLISH v1 before batch 1 may roll out.
    "disaggregated": (("disaggregated", [R("r0"), T("t0")], SMALL, True, {}), """
        0 r0 rollout b0 f0 s0-2 v0 | 1 r0 reward b0 f0 | 2 t0 train b0 f0[0:4] v0 | 3 t0 optim b0 [t0]
        4 t0 publish b0 v1 | 5 r0 rollout b1 f0 s0-2 v1 | 6 r0 reward b1 f0 | 7 t0 train b1 f0[0:4] v1
        8 t0 optim b1 [t0]"""),
    # Hybrid engine: sample, SWITCH to train, train each its share, one OPTIM over both, SWITCH back.
    "colocated": (("colocated", [H("h0"), H("h1")], SMALL, True, {}), """
        0 h0 rollout b0 f0 s0-2 v0 | 0 h1 rollout b0 f1 s0-2 v0 | 1 h0 reward b0 f0 | 1 h1 reward b0 f1
        2 h1 switch b0 ->train | 2 h0 switch b0 ->train | 3 h1 train b0 f0[0:2] v0 | 3 h0 train b0 f1[0:2] v0
        4 h0 optim b0 [h0,h1] | 5 h0 switch b1 ->rollout | 5 h1 switch b1 ->rollout
        6 h0 rollout b1 f0 s0-2 v1 | 6 h1 rollout b1 f1 s0-2 v1 | 7 h0 reward b1 f0 | 7 h1 reward b1 f1
        8 h1 switch b1 ->train | 8 h0 switch b1 ->train | 9 h1 train b1 f0[0:2] v1 | 9 h0 train b1 f1[0:2] v1
        10 h0 optim b1 [h0,h1]"""),
    # GAP: fragment 0 (prompt 0's whole group) trains while fragment 1 is generated.
    "gap": (("gap", [R("r0"), T("t0")], SMALL, True, {"fragment_groups": 1}), """
        0 r0 rollout b0 f0 s0-2 v0 | 1 r0 reward b0 f0 | 2 t0 train b0 f0[0:1] v0 | 2 r0 rollout b0 f1 s0-2 v0
        3 t0 train b0 f0[1:2] v0 | 3 r0 reward b0 f1 | 4 t0 train b0 f1[0:1] v0 | 5 t0 train b0 f1[1:2] v0
        6 t0 optim b0 [t0] | 7 t0 publish b0 v1 | 8 r0 rollout b1 f0 s0-2 v1 | 9 r0 reward b1 f0
        10 t0 train b1 f0[0:1] v1 | 10 r0 rollout b1 f1 s0-2 v1 | 11 t0 train b1 f0[1:2] v1
        11 r0 reward b1 f1 | 12 t0 train b1 f1[0:1] v1 | 13 t0 train b1 f1[1:2] v1 | 14 t0 optim b1 [t0]"""),
    # TSP: two fragments share one forward pass per step; step 1-2 continues on the other actor.
    "tsp": (("tsp", [R("r0"), R("r1"), T("t0")], SMALL, True,
             {"fragment_groups": 1, "step_chunk": 1, "rollout_batch": 4, "train_pack": 2}), """
        0 r0 rollout b0 f0,1 s0-1 v0 | 1 r1 rollout b0 f0,1 s1-2 v0 | 2 r1 reward b0 f0,1
        3 t0 train b0 f0[0:2] v0 | 4 t0 train b0 f1[0:2] v0 | 5 t0 optim b0 [t0] | 6 t0 publish b0 v1
        7 r0 rollout b1 f0,1 s0-1 v1 | 8 r1 rollout b1 f0,1 s1-2 v1 | 9 r1 reward b1 f0,1
        10 t0 train b1 f0[0:2] v1 | 11 t0 train b1 f1[0:2] v1 | 12 t0 optim b1 [t0]"""),
    # One-step async: batch 1 rolls out with v0 while batch 0 trains, and trains from v0 (staleness 1).
    # (TAG off here: with every token 1 s the trainer's idle instants are artefacts of event order.)
    "async1": (("async1", [R("r0"), T("t0")], SMALL, True,
                {"fragment_groups": 1, "step_chunk": 2, "rollout_batch": 2, "tag": False}), """
        0 r0 rollout b0 f0 s0-2 v0 | 1 r0 reward b0 f0 | 2 t0 train b0 f0[0:1] v0 | 2 r0 rollout b0 f1 s0-2 v0
        3 t0 train b0 f0[1:2] v0 | 3 r0 reward b0 f1 | 4 t0 train b0 f1[0:1] v0 | 4 r0 rollout b1 f0 s0-2 v0
        5 t0 train b0 f1[1:2] v0 | 5 r0 reward b1 f0 | 6 t0 optim b0 [t0] | 6 r0 rollout b1 f1 s0-2 v0
        7 t0 publish b0 v1 | 7 r0 reward b1 f1 | 8 t0 train b1 f0[0:1] v0 | 9 t0 train b1 f0[1:2] v0
        10 t0 train b1 f1[0:1] v0 | 11 t0 train b1 f1[1:2] v0 | 12 t0 optim b1 [t0]"""),
    # TAG pays: the rollout device is 4x slower than the trainer, which generates fragment 1 itself.
    "tag-slow-rollout": (("tag", [R("r0", 0.25), T("t0")], TINY, False,
                          {"fragment_groups": 1, "step_chunk": 2, "tag_steps": 2, "rollout_batch": 1}), """
        0 r0 rollout b0 f0 s0-2 v0 | 0 t0 rollout b0 f1 s0-2 v0 tag | 0.25 t0 rollout b0 f1 s2-4 v0 tag
        0.5 t0 reward b0 f1 | 0.55 t0 train b0 f1[0:1] v0 | 1 r0 rollout b0 f0 s2-4 v0 | 2 r0 reward b0 f0
        2.2 t0 train b0 f0[0:1] v0 | 2.45 t0 optim b0 [t0]"""),
    # TAG does not pay: the rollout device is 4x faster than the trainer, which waits for it.
    "tag-fast-rollout": (("tag", [R("r0", 4.0), T("t0")], TINY, False,
                          {"fragment_groups": 1, "step_chunk": 2, "tag_steps": 2, "rollout_batch": 1}), """
        0 r0 rollout b0 f0 s0-2 v0 | 0.06 r0 rollout b0 f0 s2-4 v0 | 0.12 r0 reward b0 f0
        0.14 t0 train b0 f0[0:1] v0 | 0.14 r0 rollout b0 f1 s0-2 v0 | 0.2 r0 rollout b0 f1 s2-4 v0
        0.26 r0 reward b0 f1 | 0.39 t0 train b0 f1[0:1] v0 | 0.64 t0 optim b0 [t0]"""),
    # TAG ahead with staleness 1: the idle trainer starts batch 1's f0 with v0 (s0-2); after v1 is
    # published the rollout device finishes it with v0, its previous version (s2-4), and it trains into
    # v2 (staleness 1). Without TAG the same run ends at 4.25.
    "async1-tag-ahead": (("async1", [R("r0", 0.5), T("t0")],
                          Workload(num_batches=2, prompts_per_batch=2, group_size=1, num_steps=4, trained_steps=1),
                          False, {"fragment_groups": 1, "step_chunk": 4, "tag_steps": 2, "rollout_batch": 1}), """
        0 r0 rollout b0 f0 s0-4 v0 | 0 t0 rollout b0 f1 s0-2 v0 tag | 0.25 t0 rollout b0 f1 s2-4 v0 tag
        0.5 t0 reward b0 f1 | 0.55 t0 train b0 f1[0:1] v0 | 0.8 t0 rollout b1 f0 s0-2 v0 tag
        0.9 r0 reward b0 f0 | 1 r0 rollout b1 f1 s0-4 v0 | 1.05 t0 train b0 f0[0:1] v0 | 1.3 t0 optim b0 [t0]
        1.8 t0 publish b0 v1 | 1.9 r0 reward b1 f1 | 2 r0 rollout b1 f0 s2-4 v0 | 2.3 t0 train b1 f1[0:1] v0
        2.5 r0 reward b1 f0 | 2.6 t0 train b1 f0[0:1] v0 | 2.85 t0 optim b1 [t0]"""),
    # No rollout device at all: the trainer generates everything, training first.
    "tag-trainer-only": (("tag", [T("t0")], TINY, False,
                          {"fragment_groups": 1, "step_chunk": 2, "tag_steps": 2, "rollout_batch": 1}), """
        0 t0 rollout b0 f0 s0-2 v0 tag | 0.25 t0 rollout b0 f0 s2-4 v0 tag | 0.5 t0 reward b0 f0
        0.55 t0 train b0 f0[0:1] v0 | 0.8 t0 rollout b0 f1 s0-2 v0 tag | 1.05 t0 rollout b0 f1 s2-4 v0 tag
        1.3 t0 reward b0 f1 | 1.35 t0 train b0 f1[0:1] v0 | 1.6 t0 optim b0 [t0]"""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_token_sequence(case: str) -> None:
    (name, devices, workload, unit, options), golden = CASES[case]
    want = [part.strip() for row in golden.strip().splitlines() for part in row.split("|")]
    assert table(name, devices, workload, unit, **options) == want
