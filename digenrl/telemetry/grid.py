"""Sample grids a person can read: tiles enlarged to ``log.tile_px``, each captioned with its prompt and reward.

::

    grid = render_grid(images, ["a red circle on a blue background", ...], [0.784, ...], columns=4,
                       tile_px=256, title="step 10 | fixed evaluation ...")
    grid.save(Path("runs/x/samples/step_00010.png"))   # and step_00010.json: prompts, rewards, tile boxes

A tile is the sample's pixels enlarged by a whole factor with nearest-neighbour (a 32 px sample becomes 256 px,
each pixel an 8x8 block: nothing is smoothed or invented) or, when larger than ``tile_px``, reduced with
Lanczos. Under it a caption strip holds the prompt (word-wrapped, at most :data:`PROMPT_LINES` lines, cut with
``...``) and ``reward 0.784``. A title strip above the tiles names the step and what the tiles are. The JSON
beside the PNG lists every tile's box (``[x, y, width, height]`` in the PNG), prompt and reward, so a reader
(or a test) can find a tile without knowing the layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Grid", "render_grid", "to_uint8", "tile_size", "PROMPT_LINES"]

PROMPT_LINES = 3  # caption lines a prompt may take before it is cut
GAP = 4  # pixels between tiles
BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)
REWARD_TEXT = (255, 214, 102)


def to_uint8(images: Any) -> np.ndarray:
    """``[N, 3, H, W]`` (or videos ``[N, 3, F, H, W]``: their first frame) in [0, 1] or uint8 -> ``[N, H, W, 3]``
    uint8 (float rounded as ``(x.clamp(0, 1) * 255).round()``, the rollout actors' conversion)."""
    import torch

    t = images if isinstance(images, torch.Tensor) else torch.as_tensor(images)
    if t.ndim == 5:
        t = t[:, :, 0]
    t = t.detach().cpu()
    if t.dtype != torch.uint8:
        t = (t.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return t.permute(0, 2, 3, 1).contiguous().numpy()


def tile_size(height: int, width: int, tile_px: int) -> tuple[int, int, int]:
    """``(tile height, tile width, factor)``: a whole ``factor`` >= 1 of nearest enlargement, or 0 when the
    image is reduced (Lanczos) to ``tile_px`` on its longer side."""
    longer = max(height, width)
    if longer <= tile_px:
        k = max(1, tile_px // longer)
        return height * k, width * k, k
    s = tile_px / longer
    return max(1, round(height * s)), max(1, round(width * s)), 0


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, ValueError, OSError, ImportError):  # an old Pillow or one built without FreeType
        return ImageFont.load_default()


def _wrap(text: str, font: Any, width: int, draw: Any, lines: int) -> list[str]:
    """``text`` in at most ``lines`` lines of at most ``width`` pixels (greedy; an over-long word is cut)."""
    out: list[str] = []
    current = ""
    for word in text.split():
        trial = f"{current} {word}".strip()
        if draw.textlength(trial, font=font) <= width:
            current = trial
            continue
        if current:
            out.append(current)
        while draw.textlength(word, font=font) > width and len(word) > 1:  # a word wider than the tile
            cut = len(word)
            while cut > 1 and draw.textlength(word[:cut], font=font) > width:
                cut -= 1
            out.append(word[:cut])
            word = word[cut:]
        current = word
    if current:
        out.append(current)
    if len(out) > lines:
        last = out[lines - 1]
        while last and draw.textlength(last + "...", font=font) > width:
            last = last[:-1]
        out = out[: lines - 1] + [last.rstrip() + "..."]
    return out or [""]


@dataclass
class Grid:
    """A rendered grid: the picture and what each tile is."""

    image: Any  # PIL.Image (RGB)
    tiles: list[list[int]]  # [x, y, width, height] of each tile's pixels in ``image``
    prompts: list[str]
    rewards: list[float | None]
    meta: dict[str, Any] = field(default_factory=dict)

    def array(self) -> np.ndarray:
        """``[H, W, 3]`` uint8 (what TensorBoard and W&B are given)."""
        return np.asarray(self.image)

    def save(self, path: Path) -> None:
        """``path`` (PNG) and, beside it, ``path.with_suffix(".json")``: every tile's box, prompt and reward."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.image.save(path)
        rewards = [r for r in self.rewards if r is not None]
        record = {"image": path.name, "size": list(self.image.size), "prompts": self.prompts,
                  "rewards": self.rewards, "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                  "tiles": self.tiles, **self.meta}
        path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


def render_grid(images: Any, prompts: Sequence[str] | None = None, rewards: Sequence[float | None] | None = None,
                *, columns: int | None = None, tile_px: int = 256, title: str = "",
                meta: dict[str, Any] | None = None) -> Grid:
    """Tile ``images`` (see :func:`to_uint8`), each captioned with its prompt and reward (to 3 decimals).

    Args:
        images: ``N`` samples.
        prompts, rewards: one per sample, as their captions show them (``None``: no caption line of that kind; a
            ``None`` reward: ``reward -``).
        columns: tiles per row (default ``ceil(sqrt(N))``).
        tile_px: the longer side of a tile (see :func:`tile_size`).
        title: one line above the tiles.
        meta: kept in the JSON :meth:`Grid.save` writes (its keys win over the grid's own).
    """
    from PIL import Image, ImageDraw

    arr = to_uint8(images)
    n, h, w, _ = arr.shape
    th, tw, k = tile_size(h, w, tile_px)
    cols = max(1, min(columns or math.ceil(math.sqrt(n)), n))
    rows = (n + cols - 1) // cols
    font_px = max(9, min(18, tw // 15))
    font = _font(font_px)
    line_h = font_px + 3
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    prompt_list = [str(p) for p in prompts] if prompts is not None else None
    reward_list = list(rewards) if rewards is not None else None
    pad = 3
    wrapped = [_wrap(p, font, tw - 2 * pad, scratch, PROMPT_LINES) for p in prompt_list or []]
    caption_lines = (max((len(x) for x in wrapped), default=0)) + (1 if reward_list is not None else 0)
    strip = caption_lines * line_h + (2 * pad if caption_lines else 0)
    title_h = line_h + 2 * pad if title else 0
    cell_w, cell_h = tw + GAP, th + strip + GAP
    width, height = cols * cell_w + GAP, title_h + rows * cell_h + GAP
    canvas = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((GAP + pad, pad), _fit(title, font, width - 2 * (GAP + pad), draw), fill=TEXT, font=font)
    tiles = []
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = GAP + c * cell_w, title_h + GAP + r * cell_h
        if k:
            tile = Image.fromarray(np.repeat(np.repeat(arr[i], k, axis=0), k, axis=1))
        else:
            tile = Image.fromarray(arr[i]).resize((tw, th), Image.Resampling.LANCZOS)
        canvas.paste(tile, (x, y))
        tiles.append([x, y, tw, th])
        ty = y + th + pad
        for line in wrapped[i] if prompt_list is not None else []:
            draw.text((x + pad, ty), line, fill=TEXT, font=font)
            ty += line_h
        if reward_list is not None:
            value = reward_list[i]
            if prompt_list is not None:  # the reward line sits at the strip's bottom, aligned across tiles
                ty = y + th + pad + (caption_lines - 1) * line_h
            draw.text((x + pad, ty), "reward -" if value is None else f"reward {float(value):.3f}",
                      fill=REWARD_TEXT, font=font)
    return Grid(canvas, tiles, prompt_list or [""] * n,
                [None if v is None else float(v) for v in reward_list] if reward_list is not None else [None] * n,
                dict(meta or {}))


def _fit(text: str, font: Any, width: int, draw: Any) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."
