"""A procedural image-text dataset: one coloured shape on a coloured background, named by its prompt.

``"a red circle on a blue background"``: a circle, square or triangle of one colour on a background of
another, with its size and position jittered. Item ``i`` of seed ``s`` is a pure function of ``(s, i)``,
so a pretraining run reads the same images on every machine and needs no download. It is what the
tiny Qwen-Image preset is pretrained on (``bench/pretrain_tiny.py``), so the default run's samples show
shapes, and its prompts (:data:`SHAPE_PROMPTS`) are the ``shapes`` prompt set the RL run asks for.

The colour names and RGB values are the ``color`` reward's (a test checks that they agree); this layer
sits below the rewards, so it keeps its own copy.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SHAPE_COLORS", "SHAPES", "SHAPE_PROMPTS", "shape_prompt", "render_shape", "shapes_item", "shapes_batch"]

# Eight well-separated sRGB colours in [0, 1] (the ``color`` reward's values for these names).
SHAPE_COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.8, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")


def shape_prompt(color: str, shape: str, background: str) -> str:
    """The prompt that names one item: ``"a red circle on a blue background"``."""
    return f"a {color} {shape} on a {background} background"


# Every (shape colour, shape, background colour) with the two colours different: 8 x 3 x 7 = 168.
_TRIPLES: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, b) for c in SHAPE_COLORS for s in SHAPES for b in SHAPE_COLORS if b != c
)
SHAPE_PROMPTS: tuple[str, ...] = tuple(shape_prompt(*t) for t in _TRIPLES)

_SUPERSAMPLE = 4  # sub-pixel samples per side: anti-aliased edges, so the images are smooth to learn


def render_shape(shape: str, color: tuple[float, float, float], background: tuple[float, float, float], *,
                 size: int = 32, center: tuple[float, float] = (0.5, 0.5), radius: float = 0.3) -> torch.Tensor:
    """One image ``[3, size, size]`` in [0, 1]; ``center`` (x, y) and ``radius`` in units of the image side.

    ``radius`` is the circle's radius, the square's half side and the triangle's circumradius (an
    upright equilateral triangle).

    Raises:
        ValueError: unknown shape or a non-positive size.
    """
    import torch  # here, so the prompt set can be read without importing torch

    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: allowed {', '.join(SHAPES)}")
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    n = size * _SUPERSAMPLE
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    dx, dy = x - center[0], y - center[1]
    if shape == "circle":
        inside = dx * dx + dy * dy <= radius * radius
    elif shape == "square":
        inside = (dx.abs() <= radius) & (dy.abs() <= radius)
    else:  # apex up (y grows downwards): inside all three edges' half-planes
        inside = torch.ones_like(dx, dtype=torch.bool)
        for k in range(3):
            # outward normals of the edges of an apex-up equilateral triangle: down, up-left, up-right
            a = math.pi / 2 + k * 2 * math.pi / 3
            inside &= dx * math.cos(a) + dy * math.sin(a) <= radius / 2
    cover = inside.float().reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(dim=(1, 3))
    fg = torch.tensor(color).view(3, 1, 1)
    bg = torch.tensor(background).view(3, 1, 1)
    return bg + (fg - bg) * cover


def shapes_item(seed: int, index: int, size: int = 32) -> tuple[torch.Tensor, str]:
    """Item ``index`` of the dataset of ``seed``: ``(image [3, size, size] in [0, 1], prompt)``.

    The prompt is drawn uniformly from :data:`SHAPE_PROMPTS`; the radius from 0.22-0.32 of the side and
    the centre so that the shape keeps a margin of at least 0.1 of the side from every edge (the
    ``shapes`` reward reads the background from that margin).
    """
    rng = random.Random(seed * 1_000_003 + index)
    k = rng.randrange(len(_TRIPLES))
    color, shape, background = _TRIPLES[k]
    radius = rng.uniform(0.22, 0.32)
    lo, hi = 0.1 + radius, 0.9 - radius
    center = (rng.uniform(lo, hi), rng.uniform(lo, hi))
    image = render_shape(shape, SHAPE_COLORS[color], SHAPE_COLORS[background], size=size, center=center, radius=radius)
    return image, SHAPE_PROMPTS[k]


def shapes_batch(seed: int, start: int, count: int, size: int = 32) -> tuple[torch.Tensor, list[str]]:
    """Items ``start .. start+count-1``: ``(images [count, 3, size, size], prompts)``."""
    import torch

    items = [shapes_item(seed, i, size) for i in range(start, start + count)]
    return torch.stack([im for im, _ in items]), [p for _, p in items]
