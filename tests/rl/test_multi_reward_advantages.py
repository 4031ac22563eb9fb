"""``reward.normalize = "per_reward"`` (issue 31): each reward standardised per group, then weighted and summed,
against numbers computed by hand; failed samples; the assembler's pieces equal the one-shot batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.errors import ConfigError
from digenrl.rl.advantages import GroupAssembler, reward_advantages

W = {"a": 1.0, "b": 0.5}
# Two groups of four. Group 0: a = 1,3,1,3 (mean 2, std 1), b = 10,10,30,30 (mean 20, std 10).
# Group 1: a flat at 2 (no signal), b = 0,20,0,20 (mean 10, std 10).
A = [1.0, 3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 2.0]
B = [10.0, 10.0, 30.0, 30.0, 0.0, 20.0, 0.0, 20.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
R = [a + 0.5 * b for a, b in zip(A, B)]  # what WeightedReward returns: 6, 8, 16, 18, 2, 12, 2, 12


def _adv(normalize: str, std: str, **kw) -> torch.Tensor:
    res = reward_advantages(torch.tensor(R), GROUPS, components={"a": torch.tensor(A), "b": torch.tensor(B)},
                            weights=W, normalize=normalize, std=std, eps=0.0, **kw)  # type: ignore[arg-type]
    return res.advantages.double()


def test_per_reward_group_std_by_hand() -> None:
    # Group 0: a -> -1, 1, -1, 1; b -> -1, -1, 1, 1; A = a + 0.5 b.
    # Group 1: a is flat, so it adds 0; b -> -1, 1, -1, 1, times 0.5.
    want = [-1.5, 0.5, -0.5, 1.5, -0.5, 0.5, -0.5, 0.5]
    torch.testing.assert_close(_adv("per_reward", "group"), torch.tensor(want, dtype=torch.float64))


def test_per_reward_global_std_by_hand() -> None:
    # Batch std of a: values 1,3,1,3,2,2,2,2 (mean 2): var = 4/8, std = sqrt(1/2).
    # Batch std of b: values 10,10,30,30,0,20,0,20 (mean 15): var = (4*25 + 4*225)/8 = 125, std = sqrt(125).
    sa, sb = math.sqrt(0.5), math.sqrt(125.0)
    want = [-1 / sa - 0.5 * 10 / sb, 1 / sa - 0.5 * 10 / sb, -1 / sa + 0.5 * 10 / sb, 1 / sa + 0.5 * 10 / sb,
            -0.5 * 10 / sb, 0.5 * 10 / sb, -0.5 * 10 / sb, 0.5 * 10 / sb]
    torch.testing.assert_close(_adv("per_reward", "global"), torch.tensor(want, dtype=torch.float64))


def test_sum_is_todays_weighted_sum_and_ranks_differently() -> None:
    # "sum": R of group 0 = 6, 8, 16, 18 (mean 12, std sqrt(26)); b's larger scale dominates it.
    s = math.sqrt(26.0)
    torch.testing.assert_close(_adv("sum", "group")[:4], torch.tensor([-6 / s, -4 / s, 4 / s, 6 / s], dtype=torch.float64))
    # Sample 1 beats sample 2 under the sum (b's 20 points), loses under per-reward (a counts as much as b).
    per = _adv("per_reward", "group")
    assert _adv("sum", "group")[1] < _adv("sum", "group")[2] and per[1] > per[2]


def test_clip_applies_to_the_weighted_sum() -> None:
    adv = _adv("per_reward", "group", clip=1.0)
    assert adv.tolist()[:4] == [-1.0, 0.5, -0.5, 1.0]


def test_failed_samples_score_the_penalty_in_every_reward() -> None:
    # Group 0 failed whole (no scores): flat in every reward -> A = 0 and zero_std, as under "sum".
    # Group 1: samples 4 and 5 failed (NaN), 6 and 7 scored a = 1, 1 and b = 3, 3. With the penalty -1:
    # a = -1, -1, 1, 1 (mean 0, std 1) and b = -1, -1, 3, 3 (mean 1, std 2): both -1, -1, 1, 1.
    nan = float("nan")
    comps = {"a": torch.tensor([nan] * 4 + [nan, nan, 1.0, 1.0]), "b": torch.tensor([nan] * 4 + [nan, nan, 3.0, 3.0])}
    rewards = torch.tensor([-1.0] * 6 + [2.5, 2.5])
    res = reward_advantages(rewards, GROUPS, components=comps, weights=W, normalize="per_reward", penalty=-1.0,
                            std="group", eps=0.0)
    assert res.advantages.tolist() == [0.0] * 4 + [-1.5, -1.5, 1.5, 1.5]
    assert res.zero_std.tolist() == [True] * 4 + [False] * 4
    assert res.stats["zero_std_ratio"] == 0.5
    # A call that failed leaves no components at all (the colocated loop's {}): every sample is penalised.
    none = reward_advantages(torch.full((8,), -1.0), GROUPS, components={}, weights=W, normalize="per_reward")
    assert none.advantages.abs().sum() == 0 and bool(none.zero_std.all())


def test_weight_zero_is_left_out_and_bad_arguments_are_refused() -> None:
    only_a = reward_advantages(torch.tensor(R), GROUPS, components={"a": torch.tensor(A), "b": torch.tensor(B)},
                               weights={"a": 1.0, "b": 0.0}, normalize="per_reward", std="group", eps=0.0)
    assert only_a.advantages.tolist() == [-1.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert only_a.zero_std.tolist() == [False] * 4 + [True] * 4  # group 1 is flat in the one weighted reward
    with pytest.raises(ValueError, match="allowed: sum, per_reward"):
        reward_advantages(torch.tensor(R), GROUPS, normalize="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-zero weight"):
        reward_advantages(torch.tensor(R), GROUPS, weights={"a": 0.0}, normalize="per_reward")
    with pytest.raises(ValueError, match="scores for"):
        reward_advantages(torch.tensor(R), GROUPS, components={"a": [1.0]}, weights=W, normalize="per_reward")


@pytest.mark.parametrize("std", ["group", "global"])
def test_assembler_pieces_in_any_order_equal_the_batch(std: str) -> None:
    rng = random.Random(0)
    g, k = 4, 3
    a = [rng.random() for _ in range(g * k)]
    b = [rng.random() * 10 for _ in range(g * k)]
    rewards = [x + 0.5 * y for x, y in zip(a, b)]
    failed = {5, 6}  # one fragment of two samples failed: no components, the penalty as reward
    for i in failed:
        rewards[i] = -1.0
    groups = [i // g for i in range(g * k)]
    comps = {"a": torch.tensor([math.nan if i in failed else v for i, v in enumerate(a)]),
             "b": torch.tensor([math.nan if i in failed else v for i, v in enumerate(b)])}
    whole = reward_advantages(torch.tensor(rewards), groups, components=comps, weights=W, normalize="per_reward",
                              std=std)  # type: ignore[arg-type]
    asm = GroupAssembler(g, std=std, num_groups=k, normalize="per_reward", weights=W)  # type: ignore[arg-type]
    pieces = [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    rng.shuffle(pieces)
    got: dict[int, float] = {}
    for ids in pieces:
        frag_comps = {} if set(ids) & failed else {n: [float(v[i]) for i in ids] for n, v in comps.items()}
        for group in asm.add([groups[i] for i in ids], ids, [rewards[i] for i in ids], frag_comps):
            got.update(zip(group.sample_ids, group.advantages.tolist()))
    torch.testing.assert_close(torch.tensor([got[i] for i in range(g * k)]), whole.advantages)
    with pytest.raises(ValueError, match="non-zero weight"):
        GroupAssembler(g, normalize="per_reward", weights={})


def test_config_key() -> None:
    assert config_from_dict({}).reward.normalize == "sum"
    assert config_from_dict({"reward": {"normalize": "per_reward"}}).reward.normalize == "per_reward"
    with pytest.raises(ConfigError, match="reward.normalize"):
        config_from_dict({"reward": {"normalize": "mean"}})
