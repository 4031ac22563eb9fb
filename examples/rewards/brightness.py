"""A reward written in Python: how bright the image is (docs/rewards.md).

Train the tiny default toward brighter images with it:

    digenrl run configs/tiny-qwenimage.toml --set 'reward.weights={brightness = 1.0}' \
        --set 'reward.models.brightness.python="examples/rewards/brightness.py:Brightness"'

or toward a mid-grey exposure, with a setting of the class (``target``) from its table:

    [reward.weights]
    brightness = 1.0

    [reward.models.brightness]
    python = "examples/rewards/brightness.py:Brightness"
    target = 0.5

The score is the mean luminance of the image (Rec. 709 weights of R, G and B), in [0, 1]; with ``target``
it is ``1 - |luminance - target|``, highest at that exposure. A video's score is the mean over its frames.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Rec. 709 / sRGB luminance weights of R, G and B (on the sRGB values, as most exposure meters do).
LUMA = (0.2126, 0.7152, 0.0722)


class Brightness:
    """Mean luminance of each image, or its closeness to ``target``.

    Args:
        target: the luminance in [0, 1] to reward (None: brighter is better).

    Raises:
        ValueError: a target outside [0, 1].
    """

    def __init__(self, target: float | None = None) -> None:
        if target is not None and not 0.0 <= target <= 1.0:
            raise ValueError(f"target must lie in [0, 1], got {target}")
        self.target = target

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """``images`` ``[B, 3, H, W]`` (or ``[B, 3, F, H, W]``) in [0, 1]; returns ``[B]`` scores."""
        weights = torch.tensor(LUMA, dtype=torch.float32, device=images.device)
        luma = torch.einsum("bc...,c->b...", images.float(), weights)  # [B, H, W] or [B, F, H, W]
        mean = luma.flatten(1).mean(dim=1)
        return mean if self.target is None else 1.0 - (mean - self.target).abs()
