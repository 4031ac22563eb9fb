"""Fragments: step ranges on different actors, hand-over on the wire, recompute, step-level batching."""

from __future__ import annotations

import pytest
import torch

from digenrl.policy import build_model, trained_steps
from digenrl.roles.fragments import FragmentData, FragmentEngine
from digenrl.config import config_from_dict

PROMPTS = ["a red square", "a blue circle", "a green square", "a white circle"]


@pytest.fixture(scope="module")
def engines():
    cfg = config_from_dict({"model": {"name": "qwenimage", "preset": "tiny"},
                            "rollout": {"num_steps": 6, "group_size": 2, "prompts_per_batch": 4}})
    a = FragmentEngine(cfg, build_model(cfg)[0])
    b = FragmentEngine(cfg, build_model(cfg)[0])  # a second "actor" with its own replica
    return cfg, a, b


def _same(x: FragmentData, y: FragmentData) -> None:
    assert torch.equal(x.x, y.x)
    tx, ty = x.transitions(), y.transitions()
    assert tx.keys() == ty.keys()
    for k in tx:
        assert torch.equal(tx[k], ty[k]), k


def test_handover_between_actors_is_bit_exact(engines) -> None:
    cfg, a, b = engines
    geo = [3, 1, 2, 4, 0, 2, 2]
    whole = a.fresh(geo, 0, PROMPTS)
    a.advance([whole], 0, 6)
    part = a.fresh(geo, 0, PROMPTS)
    a.advance([part], 0, 2)
    moved = FragmentData.from_wire(part.to_wire())  # what take_fragment sends
    b.advance([moved], 2, 4)
    a.advance([moved], 4, 6)
    _same(whole, moved)
    t = whole.transitions()
    n, steps = whole.num_samples, trained_steps(cfg)
    assert len(t["sample"]) == n * steps
    # Row i * T + t is local sample i at its t-th trained step (the schedule's row indexing).
    assert t["sample"].tolist() == [i for i in range(n) for _ in range(steps)]
    assert t["step"].tolist() == list(range(steps)) * n
    _same(whole, a.recompute(geo, 0, PROMPTS, 6))


def test_step_level_batching_matches_separate_fragments(engines) -> None:
    _, a, _ = engines
    geos = [[0, 0, 0, 2, 0, 2, 2], [0, 1, 2, 4, 0, 2, 2]]
    apart = [a.fresh(g, 0, PROMPTS) for g in geos]
    for f in apart:
        a.advance([f], 0, 6)
    together = [a.fresh(g, 0, PROMPTS) for g in geos]
    a.advance(together, 0, 3)
    a.advance(together, 3, 6)
    for x, y in zip(apart, together, strict=True):
        torch.testing.assert_close(y.x, x.x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y.transitions()["log_prob"], x.transitions()["log_prob"], atol=1e-5, rtol=1e-5)
    assert not torch.equal(apart[0].x, apart[1].x), "different fragments must get different noise"


def test_batch_prompts_are_a_seeded_balanced_function_of_the_batch() -> None:
    from collections import Counter

    from digenrl.data.prompts import batch_prompts
    from digenrl.data.prompts import load_prompts

    pool = load_prompts("color")
    batch = batch_prompts(pool, 0, 3, 20)
    assert batch == batch_prompts(pool, 0, 3, 20)  # resuming needs only the batch index
    assert batch != batch_prompts(pool, 0, 4, 20)
    counts = Counter(batch)  # more prompts than the pool: whole shuffled passes, no prompt left out
    assert set(counts) == set(pool) and set(counts.values()) == {2, 3}
    assert sorted(batch_prompts(pool, 0, 3, len(pool))) == sorted(pool)
