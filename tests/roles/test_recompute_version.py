"""A fragment recomputed from noise (its holder could not hand it over) is generated with the token's version.

Under async1 a rollout actor holds two versions and swaps between tokens: right after a token of batch k + 1
(version k) the model holds version k while a token continuing a batch-k fragment asks for version k - 1. The
recompute must swap to the token's version first, so the trajectory equals the one its holder would have given.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from digenrl.actors.base import ActorRef
from digenrl.config import config_from_dict
from digenrl.models.lora import trainable_state_dict
from digenrl.roles.rollout import RolloutActor

STEPS = 4
GEO = [1, 0, 0, 1, 0, 2, 2]  # batch 1, fragment 0: prompt 0, both members of its group of 2
PROMPTS = ["a red square", "a blue circle"]
CONF = {"model": {"name": "qwenimage", "preset": "tiny", "resolution": [32, 32], "text_len": 32},
        "rollout": {"num_steps": STEPS, "group_size": 2, "prompts_per_batch": 1},
        "schedule": {"name": "async1"}}


async def _actor(name: str) -> Any:
    """A rollout actor as a plain object (no actor system) holding versions 0 and 1 (different weights)."""
    actor = RolloutActor(config_from_dict(CONF).to_dict())
    actor._digenrl_ref = ActorRef(name, f"inproc://{name}")
    await actor.setup()
    v0 = trainable_state_dict(actor.engine.model)
    gen = torch.Generator().manual_seed(0)
    actor.weights.stage(0, v0)
    actor.weights.stage(1, {k: t + 0.2 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in v0.items()})
    return actor


@pytest.fixture
async def actors() -> Any:
    holder, taker = await _actor("rollout-0"), await _actor("rollout-1")
    taker.peers = {"rollout-0": holder}
    yield holder, taker
    for a in (holder, taker):
        await a.__cleanup__(None)


def _generated(actor: Any, version: int, stop: int) -> Any:
    """The fragment as its holder makes it: fresh noise, then steps [0, stop) at ``version``."""
    frag = actor.engine.fresh(GEO, version, PROMPTS)
    actor._rollout_compute([frag], version, 0, stop)
    return frag


async def test_a_recompute_uses_the_tokens_version_not_the_loaded_one(actors: Any) -> None:
    holder, taker = actors
    expected = _generated(holder, 0, 2)  # what the holder would hand over: version 0, steps [0, 2)
    taker.weights.ensure(1)  # its last token was of the next batch, at version 1
    # The holder lost the fragment (KeyError from its take_fragment): the taker recomputes it from noise.
    frag = await taker._obtain(GEO, "rollout-0", 0, PROMPTS, 2)
    assert (frag.version, frag.step) == (0, 2)
    assert torch.equal(frag.x, expected.x)
    for got, want in zip(frag.transitions().values(), expected.transitions().values(), strict=True):
        assert torch.equal(got, want)  # the behaviour log-probs included
    assert taker.weights.loaded == 0  # swapped to the token's version before computing
    # The weights matter here: the same steps at version 1 give another trajectory.
    assert not torch.allclose(_generated(holder, 1, 2).x, expected.x, atol=1e-4)
