"""When penalties stop being the occasional failure: a run's failure budget for its reward.

:class:`~digenrl.rewards.base.GuardedReward` scores a failed call with ``reward.penalty``. That is
right for the occasional timeout, wrong for a reward that never answers: every sample then gets the
same score, every advantage is zero, and the run burns its devices learning nothing while only
warnings say why. :class:`FailureBudget` watches the penalised share of the last few batches and
stops the run once more than ``reward.max_failure_fraction`` of their samples failed. The window
fills from the run's first batch, so a reward that fails from the start stops the run at batch 0,
and one that dies mid-run stops it within a few batches; one failed call among many is penalised
and the run goes on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from digenrl.rewards.base import RewardError

__all__ = ["FailureBudget", "RewardFailing"]


class RewardFailing(RewardError):
    """Too many samples of the last batches were scored with the penalty; the run must stop."""


class FailureBudget:
    """The penalised share of the last ``window`` batches, checked at every batch boundary.

    Args:
        rewards: the reward names (``reward.weights``' keys), for the message.
        url: ``reward.url`` (empty when no remote reward is weighted).
        max_fraction: stop when more than this share of the window's samples failed (1 never stops).
        window: batches the share is taken over.

    Raises:
        ValueError: ``max_fraction`` outside [0, 1] or ``window`` < 1.
    """

    def __init__(self, rewards: Iterable[str], url: str, max_fraction: float, window: int) -> None:
        if not 0.0 <= max_fraction <= 1.0 or window < 1:
            raise ValueError(f"max_fraction must lie in [0, 1] and window be >= 1, got {max_fraction}, {window}")
        self.rewards, self.url = "+".join(rewards), url
        self.max_fraction, self.window = max_fraction, window
        self._batches: deque[tuple[int, int, int]] = deque(maxlen=window)  # (batch, failed, samples)

    @classmethod
    def for_config(cls, reward: Any) -> FailureBudget | None:
        """The budget a ``[reward]`` table (``RewardConfig``) asks for; ``None`` under ``on_error =
        "raise"``, where the first failure already stops the run."""
        if reward.on_error != "penalty":
            return None
        url = reward.url if "remote" in reward.weights else ""
        return cls(reward.weights, url, reward.max_failure_fraction, reward.failure_window)

    def add(self, batch: int, failed: int, samples: int, last_error: str = "") -> None:
        """Record a scored batch; raise when the window's penalised share is over budget.

        Raises:
            RewardFailing: naming the reward, its URL, the share and the last failure.
        """
        self._batches.append((batch, failed, samples))
        bad = sum(f for _, f, _ in self._batches)
        total = sum(n for _, _, n in self._batches)
        if total == 0 or bad / total <= self.max_fraction:
            return
        first = self._batches[0][0]
        span = f"batch {batch}" if first == batch else f"batches {first}..{batch}"
        where = f" at {self.url}" if self.url else ""
        raise RewardFailing(
            f"reward {self.rewards!r}{where} failed on {bad} of {total} samples of {span}: more than "
            f"reward.max_failure_fraction = {self.max_fraction:g} over reward.failure_window = {self.window} "
            f"batches, so the run stops instead of training on penalties. Last failure: {last_error or 'unknown'}")
