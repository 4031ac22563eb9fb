"""A weight-free edit reward: stay close to the input image, and move toward the colour the instruction names.

For an instruction such as "make the square blue" and its input image ``s`` (the first input image: an
Edit-Plus prompt's "Picture 1"), the output ``o`` scores ``C · T`` with, over the pixels,

* consistency ``C = 1 − mean ||o − s|| / √3``: 1 when the output is the input (RGB in [0, 1]);
* instruction ``T = 1 − mean ||o − c|| / √3`` for the instruction's colour ``c`` (the ``color`` reward's
  term, :func:`~digenrl.rewards.color.target_color`): 1 when every pixel is that colour.

Both lie in [0, 1], so ``C · T`` does too; neither alone is maximal at the optimum of the product, which
trades fidelity to the input against the requested change. What it does not know: where the edit belongs
(no masks or segmentation): a global tint toward the colour and a recoloured object can score alike. It is
the tiny edit config's reward and the tests'; a real edit run weights learned or judged rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from digenrl.rewards.base import RewardError, check_batch
from digenrl.rewards.color import target_color

__all__ = ["EditConsistencyReward"]


class EditConsistencyReward:
    """``(1 − mean ||o − s|| / √3) · (1 − mean ||o − c|| / √3)`` (module docstring)."""

    name = "edit_consistency"
    uses_sources = True  # the wrappers pass the samples' input images (rewards/base.py)

    def __init__(self) -> None:
        self.last_terms: dict[str, torch.Tensor] = {}

    def score(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> torch.Tensor:
        """Score outputs ``[B, 3, H, W]`` against their input images ``sources`` ``[B, K, 3, H, W]`` (the first is used).

        Raises:
            RewardError: malformed batch, no or mis-shaped sources, or an instruction without a colour word.
        """
        check_batch(images, prompts, self.name)
        if images.ndim != 4:
            raise RewardError(f"{self.name}: scores images [B, 3, H, W], got a video batch {tuple(images.shape)}")
        b, _, h, w = images.shape
        if sources is None or sources.ndim != 5 or tuple(sources.shape[:1]) + tuple(sources.shape[2:]) != (b, 3, h, w):
            got = None if sources is None else tuple(sources.shape)
            raise RewardError(f"{self.name}: needs each sample's input images as [B={b}, K, 3, {h}, {w}], got {got}")
        out = images.float().cpu()
        src = sources[:, 0].float().cpu()
        target = torch.tensor([target_color(p) for p in prompts], dtype=torch.float32)[:, :, None, None]
        consistency = 1.0 - torch.linalg.vector_norm(out - src, dim=1).mean(dim=(1, 2)) / math.sqrt(3.0)
        instruction = 1.0 - torch.linalg.vector_norm(out - target, dim=1).mean(dim=(1, 2)) / math.sqrt(3.0)
        self.last_terms = {"consistency": consistency, "instruction": instruction}
        return consistency * instruction
