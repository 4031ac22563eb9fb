"""``RewardActor``: decodes and scores finished fragments on a device of its own.

With ``placement.reward >= 1`` the schedule sends every REWARD token here. The actor takes each
fragment from the device holding its final latents (``take_fragment`` on that rollout actor or TAG
trainer), decodes it with the model's VAE, scores it with the configured reward, hands the
transitions to the trainer-side fragment store and returns the rewards. Without a reward actor, the
holder scores its own fragments (same code: :class:`~digenrl.roles.rollout.GenerationMixin`).

A reward actor cannot regenerate a fragment whose holder died during the hand-over (it has no policy
weights); that REWARD token then fails and the coordinator reports the death, which restarts the
fragment.
"""

from __future__ import annotations

from typing import Any

from digenrl.actors.base import Actor, endpoint
from digenrl.roles.rollout import GenerationMixin

__all__ = ["RewardActor"]


class RewardActor(GenerationMixin, Actor):
    """Scores fragments handed over by their holders.

    Args:
        config: the run config as a plain dict (``Config.to_dict()``).
        threads: torch threads of this process.
    """

    def __init__(self, config: dict[str, Any], threads: int = 1) -> None:
        self.config = config
        self.threads = threads
        self.peers = {}

    async def setup(self) -> None:
        await self._setup_frozen_engine(scores=True)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)

    def _use_version(self, version: int) -> None:
        raise RuntimeError(f"{self.name} is a reward actor; it runs no ROLLOUT tokens")

    @endpoint
    async def connect(self, peers: dict[str, Any]) -> str:
        """Learn the other actors' refs."""
        self.peers = dict(peers)
        return self.name
