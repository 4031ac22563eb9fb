"""Edit rewards: ``edit_consistency`` against an independent computation, and how the input images reach rewards."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from digenrl.data.images import reward_inputs, source_pixels
from digenrl.data.prompts import edit_prompt
from digenrl.rewards import build_reward
from digenrl.rewards.base import RewardError
from digenrl.rewards.edit import EditConsistencyReward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "edit"
RED, GREEN = str(EXAMPLES / "red_square.png"), str(EXAMPLES / "green_circle.png")


def _reference(out: np.ndarray, src: np.ndarray, target: tuple[float, float, float]) -> float:
    """Per pixel, in float64 loops: (1 - mean |o - s| / sqrt 3) * (1 - mean |o - c| / sqrt 3)."""
    _, h, w = out.shape
    cons = inst = 0.0
    for y in range(h):
        for x in range(w):
            o = out[:, y, x].astype(np.float64)
            cons += math.sqrt(sum((o[c] - src[c, y, x]) ** 2 for c in range(3)))
            inst += math.sqrt(sum((o[c] - target[c]) ** 2 for c in range(3)))
    return (1 - cons / (h * w) / math.sqrt(3)) * (1 - inst / (h * w) / math.sqrt(3))


def test_edit_consistency_numbers() -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 8, 8, generator=g)
    sources = torch.rand(3, 2, 3, 8, 8, generator=g)  # the first input image is the one compared
    prompts = ["make it blue", "turn the square red", "a white background"]
    targets = [(0.0, 0.0, 1.0), (1.0, 0.0, 0.0), (1.0, 1.0, 1.0)]
    got = EditConsistencyReward().score(images, prompts, sources=sources)
    want = [_reference(images[i].numpy(), sources[i, 0].numpy(), targets[i]) for i in range(3)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    # the output equal to its input: consistency 1, and the score is the instruction term alone
    r = EditConsistencyReward()
    same = r.score(sources[:, 0], prompts, sources=sources)
    assert torch.equal(r.last_terms["consistency"], torch.ones(3)) and torch.equal(same, r.last_terms["instruction"])
    # a pure-blue output for "make it blue" with a black input: instruction 1, consistency 1 - 1/sqrt(3)
    blue = torch.zeros(1, 3, 4, 4)
    blue[:, 2] = 1.0
    s = EditConsistencyReward().score(blue, ["make it blue"], sources=torch.zeros(1, 1, 3, 4, 4))
    assert s.item() == pytest.approx(1 - 1 / math.sqrt(3), abs=1e-6)


def test_edit_consistency_needs_sources_of_the_outputs_shape() -> None:
    r = EditConsistencyReward()
    with pytest.raises(RewardError, match="input images"):
        r.score(torch.rand(2, 3, 8, 8), ["blue", "red"])
    with pytest.raises(RewardError, match=r"\[B=2, K, 3, 8, 8\]"):
        r.score(torch.rand(2, 3, 8, 8), ["blue", "red"], sources=torch.rand(2, 1, 3, 4, 4))


def test_source_pixels_resize_as_the_pipelines() -> None:
    prompts = [edit_prompt("make it blue", [RED]), edit_prompt("make it red", [GREEN])]
    px = source_pixels(prompts, 16, 24)
    assert px is not None and px.shape == (2, 1, 3, 16, 24)
    for i, path in enumerate((RED, GREEN)):
        want = np.asarray(Image.open(path).convert("RGB").resize((24, 16), Image.Resampling.LANCZOS), np.float32) / 255
        torch.testing.assert_close(px[i, 0], torch.from_numpy(want).permute(2, 0, 1), rtol=0, atol=0)
    assert source_pixels(["a plain prompt"], 16, 16) is None


def test_rewards_get_the_instruction_text_and_edit_rewards_the_input_image() -> None:
    """A plain reward reads the instruction (not the JSON record, whose image path says "red_square"); the edit reward
    gets each sample's input image at the output's size."""
    prompts = [edit_prompt("make the square blue", [RED])] * 2
    images = torch.zeros(2, 3, 32, 32)
    images[:, 2] = 1.0  # pure blue
    reward = build_reward({"color": 1.0, "edit_consistency": 1.0})
    assert reward.uses_sources and not build_reward({"color": 1.0}).uses_sources
    texts, sources = reward_inputs(prompts, images, reward.uses_sources)
    assert texts == ["make the square blue"] * 2 and sources is not None and sources.shape == (2, 1, 3, 32, 32)
    total = reward.score(images, texts, sources=sources)
    comps = reward.inner.last_components
    assert torch.equal(comps["color"], torch.ones(2))  # blue, as the instruction says (the record would say red)
    want = EditConsistencyReward().score(images, texts, sources=sources)
    torch.testing.assert_close(comps["edit_consistency"], want, rtol=0, atol=0)
    torch.testing.assert_close(total, 1.0 + want)
    # without input images the edit reward fails (and the failure policy applies)
    with pytest.raises(RewardError, match="carry none"):
        reward.score(images, texts)
    penalised = build_reward({"edit_consistency": 1.0}, on_error="penalty", penalty=-1.0)
    assert torch.equal(penalised.score(images, texts), torch.full((2,), -1.0)) and penalised.failures == 1
