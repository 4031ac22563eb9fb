"""A reward you can see: does the image show the prompt's shape colour on the prompt's background?

For ``"a red circle on a blue background"`` (the ``shapes`` prompt set) it scores two regions with a
small, deterministic image analysis, no learned model:

* background: the mean closeness to the background colour of the margin (the outer tenth of each side,
  where the ``shapes`` dataset never draws the shape);
* shape: over the inner pixels, closeness to the shape colour times distinctness from the image's own
  margin colour (``min(||p - margin|| / 0.5, 1)``: 1 for any two palette colours), averaged over the best-scoring pixels, as many as the smallest
  shape of the dataset covers (5% of the image). A shape anywhere inside counts; a shape-coloured
  background does not (it is no figure on a ground), so a colour-swapped image scores ~0, not 0.5.

* form: the figure mask (those pixel weights over the whole image) against the named shape drawn with
  the mask's own area and centroid (anti-aliased by signed distance), as a soft IoU: 1 for the named
  shape, ~0.83 for a circle asked to be a square, lower for blobs and fragments.

Closeness is ``1 - min(||p - c|| / 1.0, 1)`` in RGB: 0 at the distance between two palette colours
(>= 0.8; the ``color`` reward's ``/ sqrt(3)`` leaves a wrong colour 0.4-0.5), so a muddy or wrong colour
scores low and the reward spans [0, 1] on these images. The score is the *product* of the three parts: a
picture is right when all three are (as GenEval counts an image right only when every asked attribute is),
so a blob scores its form, a shape in the wrong colour or on the wrong background ~0. (The mean of the parts,
the score before, gave a picture 0.33 for the background alone, which any model gets right, and the tiny
model's muddy triangle blobs 0.70, so all a policy could gain lay in the last ~0.15; a learning run moves
the parts alike under either: tiny4x, seed 0, 80 iterations, form 0.766 vs 0.766, shape colour 0.988 vs 0.988.)
The same picture scores differently for different prompts, so the policy has to read the prompt.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from digenrl.rewards.base import RewardError, as_frames, check_batch
from digenrl.rewards.color import COLORS

__all__ = ["parse_shape_prompt", "ShapesReward"]

_NAMES = "|".join(re.escape(c) for c in COLORS)
_PATTERN = re.compile(rf"\b({_NAMES})\s+(\w+)\s+on\s+an?\s+({_NAMES})\s+background\b", re.IGNORECASE)
_FAR = 1.0  # RGB distance at which closeness reaches 0
_APART = 0.5  # RGB distance from the margin colour at which a pixel counts fully as figure
_MARGIN = 0.1  # the background band, as a fraction of each side
_SHAPE_AREA = 0.05  # fraction of the image taken as the shape's best-matching pixels


def parse_shape_prompt(prompt: str) -> tuple[tuple[float, float, float], str, tuple[float, float, float]]:
    """``(shape colour, shape word, background colour)`` of ``"a <colour> <shape> on a <colour> background"``.

    Raises:
        RewardError: the prompt does not have that form or names an unknown colour.
    """
    m = _PATTERN.search(prompt)
    if m is None:
        raise RewardError(f"shapes: prompt {prompt!r} is not 'a <colour> <shape> on a <colour> background' "
                          f"(colours: {', '.join(COLORS)})")
    return COLORS[m.group(1).lower()], m.group(2).lower(), COLORS[m.group(3).lower()]


def _template(shape: str, area: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Coverage ``[N, h, w]`` of ``shape`` with ``area`` (pixels) centred at ``(cx, cy)`` (pixel units)."""
    ys, xs = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    dx, dy = xs - cx.view(-1, 1, 1), ys - cy.view(-1, 1, 1)
    area = area.view(-1, 1, 1)
    if shape == "circle":
        sd = torch.sqrt(dx * dx + dy * dy) - torch.sqrt(area / math.pi)
    elif shape == "square":
        sd = torch.maximum(dx.abs(), dy.abs()) - torch.sqrt(area) / 2
    else:  # an upright equilateral triangle with that area: circumradius R, edges at R/2 from the centre
        r = torch.sqrt(area * 4 / (3 * math.sqrt(3)))
        sd = torch.stack([dx * math.cos(a) + dy * math.sin(a) for a in (math.pi / 2, 7 * math.pi / 6, 11 * math.pi / 6)])
        sd = sd.amax(dim=0) - r / 2
    return (0.5 - sd).clamp(0.0, 1.0)


def _form(mask: torch.Tensor, shapes: list[str]) -> torch.Tensor:
    """Soft IoU of each figure ``mask [N, h, w]`` with its named shape of the same area and centroid."""
    n, h, w = mask.shape
    ys, xs = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    area = mask.sum(dim=(1, 2)).clamp(min=1e-6)
    cx, cy = (mask * xs).sum(dim=(1, 2)) / area, (mask * ys).sum(dim=(1, 2)) / area
    out = torch.zeros(n)
    for shape in set(shapes):
        rows = torch.tensor([k for k, s in enumerate(shapes) if s == shape])
        t = _template(shape, area[rows], cx[rows], cy[rows], h, w)
        m = mask[rows]
        out[rows] = torch.minimum(m, t).sum(dim=(1, 2)) / (torch.maximum(m, t).sum(dim=(1, 2)) + 1e-6)
    return out


def _closeness(pixels: torch.Tensor, color: torch.Tensor) -> torch.Tensor:
    """Per-pixel closeness in [0, 1] of ``pixels [N, 3, ...]`` to ``color [N, 3]``."""
    c = color.view(*color.shape, *([1] * (pixels.ndim - 2)))
    return 1.0 - (torch.linalg.vector_norm(pixels - c, dim=1) / _FAR).clamp(max=1.0)


class ShapesReward:
    """Background, shape colour and form, all at once (module docstring)."""

    name = "shapes"

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch: the product of :meth:`parts`.

        Raises:
            RewardError: malformed batch, an image under 10x10 pixels, or a prompt not of the shapes form.
        """
        return self.total(self.parts(images, prompts))

    @staticmethod
    def total(parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The score of :meth:`parts`: their product (all three must hold)."""
        return parts["background"] * parts["shape_colour"] * parts["form"]

    def parts(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The three scores per sample (``background``, ``shape_colour``, ``form``): where a sample loses reward.

        Raises:
            RewardError: as :meth:`score`.
        """
        check_batch(images, prompts, self.name)
        frames, f = as_frames(images.float().cpu())
        n, _, h, w = frames.shape
        if h < 10 or w < 10:
            raise RewardError(f"shapes: images must be at least 10x10 pixels, got {h}x{w}")
        parsed = [parse_shape_prompt(p) for p in prompts]
        fg = torch.tensor([p[0] for p in parsed], dtype=torch.float32).repeat_interleave(f, dim=0)
        bg = torch.tensor([p[2] for p in parsed], dtype=torch.float32).repeat_interleave(f, dim=0)
        mh, mw = max(1, round(_MARGIN * h)), max(1, round(_MARGIN * w))
        band = torch.ones(h, w, dtype=torch.bool)
        band[mh:h - mh, mw:w - mw] = False
        bg_score = _closeness(frames, bg)[:, band].mean(dim=1)
        margin_color = frames[:, :, band].mean(dim=2)
        apart = (torch.linalg.vector_norm(frames - margin_color[:, :, None, None], dim=1) / _APART).clamp(max=1.0)
        figure = _closeness(frames, fg) * apart  # [N, h, w]: how much each pixel is a shape-coloured figure
        inner = figure[:, mh:h - mh, mw:w - mw].reshape(n, -1)
        k = max(1, round(_SHAPE_AREA * h * w))
        fg_score = inner.topk(k, dim=1).values.mean(dim=1)
        form = _form(figure, [s for p in parsed for s in [p[1]] * f])
        return {name: part.reshape(-1, f).mean(dim=1)
                for name, part in (("background", bg_score), ("shape_colour", fg_score), ("form", form))}
