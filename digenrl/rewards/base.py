"""The reward interface, the failure policy and weighted sums.

A reward is a small object with ``score(images, prompts) -> Tensor[B]``: ``images`` are ``[B, 3, H, W]``
(or videos ``[B, 3, F, H, W]``) in ``[0, 1]`` as returned by ``GeneratorModel.decode``. Higher is better.

A reward of an image-conditioned model (an edit reward: a function of the output *and* its input) sets
``uses_sources = True`` and takes ``score(images, prompts, sources=...)``: ``sources`` are the samples'
input images ``[B, K, 3, H, W]`` in ``[0, 1]`` at the outputs' size (``data/images.py``). The wrappers
here hand ``sources`` to the rewards that declare it and only to them, so every other reward keeps its
two-argument ``score``.

A reward that cannot score raises :class:`RewardError`. It never returns a silent zero: a zero is a
valid score that would quietly bias the advantages. :class:`GuardedReward` turns failures into a
configured penalty instead, and counts and logs every substitution so it shows up in the metrics;
:class:`~digenrl.rewards.failures.FailureBudget` stops a run whose penalties are no longer occasional.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from digenrl.errors import DigenrlError

__all__ = ["RewardError", "Reward", "WeightedReward", "GuardedReward", "check_batch", "as_frames", "score_with_sources"]

log = logging.getLogger(__name__)


class RewardError(DigenrlError):
    """A reward could not score a batch (bad input, a missing optional dependency, a dead server)."""


@runtime_checkable
class Reward(Protocol):
    """``score(images, prompts) -> Tensor[B]`` (fp32, finite); an edit reward also ``uses_sources`` (module docstring)."""

    name: str

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch."""
        ...


def check_batch(images: torch.Tensor, prompts: Sequence[str], who: str) -> None:
    """Validate a batch.

    Raises:
        RewardError: wrong rank, channel count, value range, or prompt count.
    """
    if not isinstance(images, torch.Tensor) or images.ndim not in (4, 5) or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise RewardError(f"{who}: images must be [B, 3, H, W] or [B, 3, F, H, W], got {shape}")
    if len(prompts) != images.shape[0]:
        raise RewardError(f"{who}: {images.shape[0]} images but {len(prompts)} prompts")
    if images.numel() and (float(images.min()) < -1e-4 or float(images.max()) > 1 + 1e-4):
        raise RewardError(f"{who}: image values must lie in [0, 1], got [{float(images.min()):.3f}, {float(images.max()):.3f}]")


def score_with_sources(reward: Reward, images: torch.Tensor, prompts: Sequence[str],
                       sources: torch.Tensor | None) -> torch.Tensor:
    """``reward.score(images, prompts)``, with ``sources=`` for a reward that ``uses_sources``.

    Raises:
        RewardError: the reward uses sources and there are none (its prompts carry no input images).
    """
    if not getattr(reward, "uses_sources", False):
        return reward.score(images, prompts)
    if sources is None:
        raise RewardError(f"{reward.name}: scores an output against its input images, and these prompts carry none "
                          "(an image-conditioned model with a JSONL prompt file: data.prompt_file)")
    return reward.score(images, prompts, sources=sources)  # type: ignore[call-arg]


def as_frames(images: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, 3, H, W]`` or ``[B, 3, F, H, W]`` as ``[B*F, 3, H, W]`` plus ``F`` (sample-major)."""
    if images.ndim == 4:
        return images, 1
    b, c, f, h, w = images.shape
    return images.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w), f


def to_uint8_hwc(images: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N, H, W, 3]`` uint8 (round to nearest)."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()


class WeightedReward:
    """``R = sum_k w_k r_k`` (ALGORITHM (9)); each component is also reported in :attr:`last_components`.

    Raises:
        ValueError: on an empty mapping.
    """

    def __init__(self, parts: Mapping[str, tuple[Reward, float]]) -> None:
        if not parts:
            raise ValueError("a weighted reward needs at least one component")
        self.parts = dict(parts)
        self.name = "+".join(f"{w:g}*{n}" for n, (_, w) in self.parts.items())
        self.last_components: dict[str, torch.Tensor] = {}

    @property
    def uses_sources(self) -> bool:
        """Some component scores against the samples' input images (the caller loads them only then)."""
        return any(getattr(r, "uses_sources", False) for r, _ in self.parts.values())

    def score(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum of the components' scores (``sources``: the input images, for the rewards that use them).

        Raises:
            RewardError: a component failed or returned a wrong shape or non-finite values.
        """
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        comps: dict[str, torch.Tensor] = {}
        for name, (reward, weight) in self.parts.items():
            s = torch.as_tensor(score_with_sources(reward, images, prompts, sources), dtype=torch.float32).cpu()
            if s.shape != (images.shape[0],):
                raise RewardError(f"reward {name!r} returned shape {tuple(s.shape)}, expected [{images.shape[0]}]")
            if not bool(torch.isfinite(s).all()):
                raise RewardError(f"reward {name!r} returned non-finite scores {s.tolist()}")
            comps[name] = s
            total += weight * s
        self.last_components = comps
        return total


class GuardedReward:
    """Applies the failure policy: re-raise (default) or substitute a logged, counted penalty.

    Args:
        inner: the reward.
        on_error: ``"raise"`` or ``"penalty"``.
        penalty: the score every sample of a failed batch gets under ``"penalty"``.

    Raises:
        ValueError: for an unknown ``on_error``.
    """

    def __init__(self, inner: Reward, *, on_error: str = "raise", penalty: float = -1.0) -> None:
        if on_error not in ("raise", "penalty"):
            raise ValueError(f"on_error must be 'raise' or 'penalty', got {on_error!r}")
        self.inner, self.on_error, self.penalty = inner, on_error, penalty
        self.name = inner.name
        self.failures = 0
        self.last_error = ""  # the latest failure's message (the run's failure budget quotes it)

    @property
    def uses_sources(self) -> bool:
        """The inner reward scores against the samples' input images (``score(..., sources=)``)."""
        return bool(getattr(self.inner, "uses_sources", False))

    def score(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> torch.Tensor:
        """The inner score, or the penalty after a logged failure.

        Raises:
            RewardError: the inner reward failed and ``on_error == "raise"``.
        """
        try:
            s = torch.as_tensor(score_with_sources(self.inner, images, prompts, sources), dtype=torch.float32)
            if not bool(torch.isfinite(s).all()):
                raise RewardError(f"reward {self.name!r} returned non-finite scores {s.tolist()}")
            return s
        except RewardError as exc:
            if self.on_error == "raise":
                raise
            self.failures += 1
            self.last_error = str(exc)
            log.warning("reward %s failed (%s); using penalty %g for %d samples (failures=%d)",
                        self.name, exc, self.penalty, images.shape[0], self.failures)
            return torch.full((images.shape[0],), float(self.penalty))
