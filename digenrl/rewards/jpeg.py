"""DDPO's JPEG rewards (ALGORITHM (c)): the size of the image saved as JPEG at quality 95.

``jpeg_compressibility`` = ``-kB / 500`` (Flow-GRPO's scale) rewards flat, simple images;
``jpeg_incompressibility`` = ``+kB`` rewards detail. Videos score the mean over frames.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch
from PIL import Image

from digenrl.rewards.base import as_frames, check_batch, to_uint8_hwc

__all__ = ["jpeg_kilobytes", "JpegCompressibility", "JpegIncompressibility"]


def jpeg_kilobytes(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """JPEG size in kB (1000 bytes) of each image ``[N, 3, H, W]`` in [0, 1]."""
    arr = to_uint8_hwc(images).numpy()
    sizes = []
    for im in arr:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def _per_sample_kb(images: torch.Tensor, prompts: Sequence[str], who: str) -> torch.Tensor:
    check_batch(images, prompts, who)
    frames, f = as_frames(images)
    return jpeg_kilobytes(frames).reshape(-1, f).mean(dim=1)


class JpegCompressibility:
    """``-kB(q=95) / 500`` (higher = smaller file)."""

    name = "jpeg_compressibility"

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch.

        Raises:
            RewardError: malformed batch.
        """
        return -_per_sample_kb(images, prompts, self.name) / 500.0


class JpegIncompressibility:
    """``+kB(q=95)`` (higher = larger file)."""

    name = "jpeg_incompressibility"

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch.

        Raises:
            RewardError: malformed batch.
        """
        return _per_sample_kb(images, prompts, self.name)
