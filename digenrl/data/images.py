"""The input images of image-conditioned prompts (:func:`~digenrl.data.prompts.edit_prompt`), read from disk.

:func:`prompt_images` gives an edit model its conditioning images (PIL, as the diffusers pipelines take
them; the model resizes them itself, as its pipeline does); :func:`source_pixels` gives a reward the same
images as pixels at the generated images' size, resized as the pipelines resize: PIL's Lanczos filter to
exactly ``(height, width)`` (``VaeImageProcessor.resize``'s default mode, which stretches). A file is read
once per process (:func:`read_image` caches the decoded image).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from digenrl.data.prompts import split_prompt
from digenrl.errors import ConfigError

__all__ = ["read_image", "prompt_images", "resize_image", "source_pixels", "reward_inputs"]


@functools.lru_cache(maxsize=1024)
def read_image(path: str) -> Any:
    """The RGB ``PIL.Image`` at ``path`` (cached per process: treat it as read-only).

    Raises:
        ConfigError: the file is missing or not an image PIL can read.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise ConfigError(f"data.prompt_file: cannot read image {path!r}: {exc}") from exc


def prompt_images(prompts: Sequence[str]) -> list[list[Any]] | None:
    """Each prompt's input images (``PIL.Image``, in file order), or ``None`` when no prompt carries any.

    Raises:
        ConfigError: some prompts carry images and others do not, or an image cannot be read.
    """
    paths = [split_prompt(p)[1] for p in prompts]
    if not any(paths):
        return None
    if not all(paths):
        bare = next(p for p, ps in zip(prompts, paths, strict=True) if not ps)
        raise ConfigError(f"data: prompt {bare!r} carries no input images while others do; an image-conditioned run "
                          "gives every prompt its images (a JSONL prompt file)")
    return [[read_image(p) for p in ps] for ps in paths]


def resize_image(image: Any, height: int, width: int) -> Any:
    """``image`` resized to exactly ``height x width`` as diffusers' ``VaeImageProcessor.resize`` does (Lanczos)."""
    from PIL import Image

    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def source_pixels(prompts: Sequence[str], height: int, width: int) -> torch.Tensor | None:
    """The prompts' input images as ``[B, K, 3, height, width]`` fp32 in [0, 1], or ``None`` without images.

    Raises:
        ConfigError: as :func:`prompt_images`; prompts with different numbers of images.
    """
    images = prompt_images(prompts)
    if images is None:
        return None
    if len({len(i) for i in images}) > 1:
        raise ConfigError("data: prompts carry different numbers of input images; every prompt of a run has the same")
    arrays = [[np.asarray(resize_image(img, height, width), dtype=np.float32) for img in row] for row in images]
    pixels = torch.from_numpy(np.stack([np.stack(row) for row in arrays]))  # [B, K, H, W, 3]
    return pixels.permute(0, 1, 4, 2, 3).contiguous() / 255.0


def reward_inputs(prompts: Sequence[str], images: torch.Tensor, sources: bool) -> tuple[list[str], torch.Tensor | None]:
    """What a reward is called with for ``images`` (``[B, 3, H, W]`` or videos) of ``prompts``: the prompts' texts
    (an edit prompt's instruction, never its JSON record) and, when the reward ``sources`` (``uses_sources``),
    their input images at the outputs' size (``None`` for prompts without any).

    Raises:
        ConfigError: as :func:`source_pixels`.
    """
    texts = [split_prompt(p)[0] for p in prompts]
    if not sources:
        return texts, None
    return texts, source_pixels(prompts, int(images.shape[-2]), int(images.shape[-1]))
