"""The shapes dataset and the ``shapes`` reward: hand-drawn images (PIL), not the dataset's own renderer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from digenrl.data.prompts import load_prompts
from digenrl.data.shapes import SHAPE_COLORS, SHAPE_PROMPTS, render_shape, shapes_batch, shapes_item
from digenrl.rewards import RewardError, make_reward
from digenrl.rewards.color import COLORS
from digenrl.rewards.shapes import parse_shape_prompt

RGB = {"red": (255, 0, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0), "white": (255, 255, 255),
       "green": (0, 204, 0), "black": (0, 0, 0)}


def drawn(shape: str, fg: str, bg: str, size: int = 32, box: tuple[int, int, int, int] = (9, 8, 24, 23)) -> torch.Tensor:
    """A PIL drawing as ``[3, size, size]`` in [0, 1]."""
    im = Image.new("RGB", (size, size), RGB[bg])
    d = ImageDraw.Draw(im)
    if shape == "circle":
        d.ellipse(box, fill=RGB[fg])
    elif shape == "square":
        d.rectangle(box, fill=RGB[fg])
    else:
        x0, y0, x1, y1 = box
        d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=RGB[fg])
    return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1)


def test_dataset_is_deterministic_and_says_what_it_draws() -> None:
    a, pa = shapes_batch(seed=3, start=10, count=6)
    b, pb = shapes_batch(seed=3, start=10, count=6)
    assert torch.equal(a, b) and pa == pb
    assert not torch.equal(a, shapes_batch(seed=4, start=10, count=6)[0])
    for img, prompt in zip(a, pa, strict=True):
        fg, shape, bg = parse_shape_prompt(prompt)
        corner = img[:, 0, 0]
        assert torch.allclose(corner, torch.tensor(bg))  # the margin is background
        # the shape colour is present: some pixel is exactly it
        assert (img - torch.tensor(fg).view(3, 1, 1)).abs().sum(0).min() < 1e-6
    assert len(SHAPE_PROMPTS) == 8 * 3 * 7 == len(set(SHAPE_PROMPTS))
    assert load_prompts("shapes") == list(SHAPE_PROMPTS)


def test_dataset_palette_is_the_color_rewards() -> None:
    for name, rgb in SHAPE_COLORS.items():
        assert COLORS[name] == rgb


def test_renderer_areas_match_geometry() -> None:
    r = 0.3
    for shape, area in (("circle", np.pi * r * r), ("square", 4 * r * r), ("triangle", 3 * np.sqrt(3) / 4 * r * r)):
        img = render_shape(shape, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), size=64, radius=r)
        assert float(img[0].mean()) == pytest.approx(area, abs=0.01), shape


def test_matching_image_scores_higher_than_mismatches() -> None:
    reward = make_reward("shapes")
    prompt = "a red circle on a blue background"
    right = drawn("circle", "red", "blue")
    wrong_fg = drawn("circle", "yellow", "blue")
    wrong_bg = drawn("circle", "red", "white")
    swapped = drawn("circle", "blue", "red")
    grey = torch.full((3, 32, 32), 0.5)
    s = reward.score(torch.stack([right, wrong_fg, wrong_bg, swapped, grey]), [prompt] * 5)
    assert float(s[0]) > 0.9  # measured 0.94: both colours exact, the form a pixelated 15 px circle's IoU
    # one wrong colour fails the whole picture: the score is the product of its parts
    assert all(float(x) < 0.05 for x in s[1:]), s


def test_reward_is_prompt_conditioned_and_position_free() -> None:
    reward = make_reward("shapes")
    img = drawn("square", "yellow", "black", box=(4, 4, 14, 14))  # off-centre, still inside the margin
    s = reward.score(torch.stack([img, img]), ["a yellow square on a black background", "a black square on a yellow background"])
    assert float(s[0]) > 0.9 and float(s[1]) < 0.05
    # videos: frames averaged
    vid = torch.stack([img, img], dim=1)[None]
    assert reward.score(vid, ["a yellow square on a black background"]).shape == (1,)


def test_dataset_items_score_near_one() -> None:
    imgs, prompts = shapes_batch(seed=0, start=0, count=32)
    s = make_reward("shapes").score(imgs, prompts)
    assert float(s.min()) > 0.95


def test_bad_prompts_and_images_are_named() -> None:
    reward = make_reward("shapes")
    with pytest.raises(RewardError, match="shapes: prompt 'a cat'"):
        reward.score(torch.zeros(1, 3, 32, 32), ["a cat"])
    with pytest.raises(RewardError, match="at least 10x10"):
        reward.score(torch.zeros(1, 3, 8, 8), ["a red circle on a blue background"])
    img, _ = shapes_item(0, 0)
    assert img.shape == (3, 32, 32)


def test_the_named_shape_beats_the_other_shapes() -> None:
    """Same colours, same box: the form term prefers the shape the prompt names (a square's circle is closest)."""
    reward = make_reward("shapes")
    imgs = torch.stack([drawn(s, "white", "black", box=(8, 8, 23, 23)) for s in ("circle", "square", "triangle")])
    for k, asked in enumerate(("circle", "square", "triangle")):
        s = reward.score(imgs, [f"a white {asked} on a black background"] * 3)
        assert int(s.argmax()) == k, (asked, s)
        assert float(s[k]) > float(s.topk(2).values[1]) + 0.02, (asked, s)  # measured gaps 0.05-0.1


def test_parts_say_which_part_is_wrong() -> None:
    """``parts``: a wrong background costs only ``background``, a wrong shape only ``form``; a wrong shape
    colour costs ``shape_colour`` and ``form`` (the figure is found by the named colour); the score is their product."""
    reward = make_reward("shapes")
    prompt = "a red circle on a blue background"
    imgs = torch.stack([drawn("circle", "red", "blue"), drawn("circle", "red", "white"),
                        drawn("circle", "yellow", "blue"), drawn("triangle", "red", "blue")])
    parts = reward.parts(imgs, [prompt] * 4)
    torch.testing.assert_close(reward.score(imgs, [prompt] * 4),
                               parts["background"] * parts["shape_colour"] * parts["form"])
    good = {k: float(v[0]) for k, v in parts.items()}
    assert min(good.values()) > 0.9, good
    for row, broken in ((1, {"background"}), (2, {"shape_colour", "form"}), (3, {"form"})):
        for name, v in parts.items():
            if name in broken:
                assert float(v[row]) < good[name] - 0.15, (row, name, parts)
            else:
                assert float(v[row]) > good[name] - 0.05, (row, name, parts)
