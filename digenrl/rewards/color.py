"""A prompt-conditioned, verifiable colour reward that a tiny random-init model can learn quickly.

The prompt names a colour ("a red square", "a photo of something teal"); the reward is
``1 - mean_pixels ||p - c|| / sqrt(3)`` in RGB, in ``[0, 1]``: 1 when every pixel is the target colour.
A per-pixel mean distance (rather than a hit/miss test) changes smoothly with every pixel, so even
small changes of a random generator's output move it, and the group-normalised advantage always has
signal. It is prompt-conditioned: the same image scores differently for "red" and "blue", so the policy
has to read the prompt, not just shift every image one way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from digenrl.rewards.base import RewardError, as_frames, check_batch

__all__ = ["COLORS", "target_color", "ColorReward"]

# sRGB in [0, 1]. Multi-word names come first so "light blue" wins over "blue".
COLORS: dict[str, tuple[float, float, float]] = {
    "light blue": (0.68, 0.85, 0.90),
    "dark green": (0.0, 0.39, 0.0),
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.8, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "orange": (1.0, 0.55, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "pink": (1.0, 0.75, 0.8),
    "teal": (0.0, 0.5, 0.5),
    "brown": (0.55, 0.27, 0.07),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
    "grey": (0.5, 0.5, 0.5),
}
_PATTERN = re.compile(r"\b(" + "|".join(re.escape(c) for c in COLORS) + r")\b", re.IGNORECASE)


def target_color(prompt: str) -> tuple[float, float, float]:
    """The RGB target named in ``prompt`` (the first colour word).

    Raises:
        RewardError: the prompt names no known colour.
    """
    m = _PATTERN.search(prompt)
    if m is None:
        raise RewardError(f"color: prompt {prompt!r} names no colour; known: {', '.join(COLORS)}")
    return COLORS[m.group(1).lower()]


class ColorReward:
    """``1 - mean pixel RGB distance to the prompt's colour / sqrt(3)``."""

    name = "color"

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch.

        Raises:
            RewardError: malformed batch, or a prompt without a colour word.
        """
        check_batch(images, prompts, self.name)
        frames, f = as_frames(images.float().cpu())
        target = torch.tensor([target_color(p) for p in prompts], dtype=torch.float32)
        target = target.repeat_interleave(f, dim=0)[:, :, None, None]
        dist = torch.linalg.vector_norm(frames - target, dim=1).mean(dim=(1, 2))
        return 1.0 - dist.reshape(-1, f).mean(dim=1) / math.sqrt(3.0)
