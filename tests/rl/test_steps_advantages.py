"""Trained-step selection and group advantages (ALGORITHM (10), (11), (16), (f).5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from digenrl.rl.advantages import GroupAssembler, group_advantages
from digenrl.rl.steps import plan_steps


def test_all_but_last() -> None:
    p = plan_steps(6, [0, 0, 1])
    assert p.stochastic.all()
    assert p.trained[:, :5].all() and not p.trained[:, 5].any()
    assert p.trained_count() == 15


def test_window_is_shared_per_group_seeded_and_recorded() -> None:
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    p = plan_steps(10, groups, mode="window", window=3, seed=5)
    again = plan_steps(10, groups, mode="window", window=3, seed=5)
    assert torch.equal(p.trained, again.trained) and torch.equal(p.window_start, again.window_start)
    for j, gid in enumerate(groups):
        start = int(p.window_start[j])
        assert 0 <= start <= 10 - 1 - 3
        assert p.window_start[j] == p.window_start[groups.index(gid)]
        assert p.trained[j].nonzero().flatten().tolist() == [start, start + 1, start + 2]
    assert torch.equal(p.stochastic, p.trained)
    starts = {int(plan_steps(10, [0], mode="window", window=3, seed=s).window_start[0]) for s in range(20)}
    assert len(starts) > 2  # the seed actually moves the window
    with pytest.raises(ValueError, match="must fit"):
        plan_steps(10, groups, mode="window", window=3, window_range=(5, 7))


def test_fraction_per_sample() -> None:
    p = plan_steps(11, list(range(8)), mode="fraction", fraction=0.6, seed=1)
    assert (p.trained.sum(1) == 6).all()
    assert not p.trained[:, 10].any()
    assert p.stochastic.all()
    assert len({tuple(r.tolist()) for r in p.trained}) > 1
    with pytest.raises(ValueError, match="unknown step mode 'x'"):
        plan_steps(4, [0], mode="x")  # type: ignore[arg-type]


def test_group_std_normalises_each_group() -> None:
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 30.0, 20.0, 5.0, 5.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    res = group_advantages(r, gid, std="group")
    a = res.advantages
    for g in range(3):
        assert abs(float(a[gid == g].sum())) < 1e-5
    assert a[:3].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
    assert a[3:6].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(a[6:], torch.zeros(3)) and res.zero_std[6:].all() and not res.zero_std[:6].any()
    assert res.stats["zero_std_ratio"] == pytest.approx(1 / 3)


def test_global_std_uses_batch_std_and_clips() -> None:
    r = torch.tensor([0.0, 1.0, 100.0, 101.0])
    gid = [0, 0, 1, 1]
    res = group_advantages(r, gid, std="global")
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (r.std(unbiased=False) + 1e-4)
    assert torch.allclose(res.advantages, want, atol=1e-6)
    assert res.advantages.std(unbiased=False) < 1
    clipped = group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), [0, 0, 0, 0], std="group", clip=1.0)
    assert clipped.advantages.max() == 1.0
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([0.0, float("nan")]), [0, 0])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 5),
    st.integers(1, 5),
    st.sampled_from(["group", "global"]),
    st.randoms(use_true_random=False),
)
def test_assembler_any_arrival_order_equals_one_shot(g: int, k: int, std: str, rnd) -> None:
    rewards = torch.tensor([rnd.uniform(-1, 1) for _ in range(g * k)])
    if k > 1:
        rewards[:g] = 0.25  # one zero-std group
    items = [(p, p * 100 + s, float(rewards[p * g + s])) for p in range(k) for s in range(g)]
    rnd.shuffle(items)
    asm = GroupAssembler(g, std=std, num_groups=k)  # type: ignore[arg-type]
    got = {}
    pos = 0
    while pos < len(items):
        n = rnd.randint(1, 4)
        frag = items[pos : pos + n]
        pos += n
        for grp in asm.add([i[0] for i in frag], [i[1] for i in frag], [i[2] for i in frag]):
            assert grp.prompt_id not in got
            got[grp.prompt_id] = grp
            assert abs(float(grp.advantages.sum())) < 1e-5  # sums to zero per group
    assert sorted(got) == list(range(k)) and not asm.pending
    one = group_advantages(rewards, torch.arange(k).repeat_interleave(g), std=std)  # type: ignore[arg-type]
    for p in range(k):
        assert torch.allclose(got[p].advantages, one.advantages[p * g : (p + 1) * g], atol=1e-6)
        assert got[p].sample_ids == [p * 100 + s for s in range(g)]
        assert got[p].zero_std == bool(one.zero_std[p * g])


def test_assembler_emits_only_complete_groups_and_rejects_bad_fragments() -> None:
    asm = GroupAssembler(3, std="group")
    assert asm.add([7, 7], [0, 1], [1.0, 2.0]) == []
    assert asm.pending == {7: 2}
    with pytest.raises(ValueError, match="duplicate sample id 1"):
        asm.add([7], [1], [3.0])
    with pytest.raises(ValueError, match="more than group_size=3"):
        asm.add([7, 7, 8], [5, 6, 0], [0.0, 0.0, 0.0])
    assert asm.pending == {7: 2}  # a rejected fragment changes nothing
    (grp,) = asm.add([7], [2], [3.0])
    assert grp.prompt_id == 7 and torch.allclose(grp.advantages.sum(), torch.tensor(0.0), atol=1e-6)
    with pytest.raises(ValueError, match="already emitted"):
        asm.add([7], [9], [0.0])
    with pytest.raises(ValueError, match="lengths differ"):
        asm.add([1, 2], [1], [0.0])
    with pytest.raises(ValueError, match="num_groups"):
        GroupAssembler(3, std="global")


def test_window_range_pins_the_window_start() -> None:
    from digenrl.config import RolloutConfig

    ro = RolloutConfig(num_steps=6, steps="window", window=1, window_range=[0, 0])
    p = plan_steps(ro.num_steps, [0, 0, 1, 1, 2, 2], mode="window", window=ro.window, window_range=ro.window_bounds(), seed=3)
    assert p.stochastic[:, 0].all() and not p.stochastic[:, 1:].any()
    assert torch.equal(p.trained, p.stochastic) and (p.window_start == 0).all()
    assert RolloutConfig().window_bounds() is None
