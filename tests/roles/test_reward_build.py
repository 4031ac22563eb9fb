"""Where the reward is built: on the actors that score, not on every generating one (a learned reward is GBs)."""

from __future__ import annotations

from typing import Any

import pytest

from digenrl.actors.base import ActorRef
from digenrl.config import config_from_dict
from digenrl.roles.reward import RewardActor
from digenrl.roles.rollout import RolloutActor

CONF: dict[str, Any] = {"model": {"name": "qwenimage", "preset": "tiny"}, "schedule": {"name": "gap"}}


async def _setup(cls: type, reward_actors: int) -> Any:
    actor = cls(config_from_dict({**CONF, "placement": {"reward": reward_actors}}).to_dict())
    actor._digenrl_ref = ActorRef(cls.__name__, f"inproc://{cls.__name__}")
    await actor.setup()
    return actor


@pytest.mark.parametrize(("cls", "reward_actors", "built"), [
    (RolloutActor, 0, True),  # no reward actor: the rollout actor scores what it finishes
    (RolloutActor, 1, False),  # a reward actor scores: the rollout actor holds no reward until it would need one
    (RewardActor, 1, True),
])
async def test_the_reward_is_built_where_it_scores(cls: type, reward_actors: int, built: bool) -> None:
    actor = await _setup(cls, reward_actors)
    try:
        assert (actor.engine._reward is not None) == built
        assert actor.engine.reward is not None  # built on first use where it was not (every reward actor died)
    finally:
        await actor.__cleanup__(None)
