"""Reward functions: ``score(images, prompts) -> Tensor[B]``, a registry, weighted sums, an HTTP service."""

from __future__ import annotations

from digenrl.rewards.base import GuardedReward, Reward, RewardError, WeightedReward
from digenrl.rewards.failures import FailureBudget, RewardFailing
from digenrl.rewards.registry import REWARD_NAMES, build_reward, make_reward

__all__ = ["FailureBudget", "GuardedReward", "REWARD_NAMES", "Reward", "RewardError", "RewardFailing", "WeightedReward",
           "build_reward", "make_reward"]
