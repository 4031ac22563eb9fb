"""Rewards against independent computations, the failure policy, and the HTTP service on loopback."""

from __future__ import annotations

import io
import json
import logging
import math
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from digenrl.errors import ConfigError
from digenrl.rewards import RewardError, build_reward, make_reward
from digenrl.rewards.color import ColorReward, target_color
from digenrl.rewards.ocr import OcrReward, levenshtein, ocr_similarity, quoted_text
from digenrl.rewards.remote import RemoteReward
from digenrl.rewards.server import RewardServer


def noise_and_flat(b: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    noisy = torch.rand(b, 3, 64, 64, generator=g)
    flat = torch.full((b, 3, 64, 64), 0.5)
    return torch.cat([noisy, flat])


def pil_kb(img: torch.Tensor) -> float:
    arr = (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return len(buf.getvalue()) / 1000


def test_jpeg_rewards_match_pil_and_prefer_the_right_images() -> None:
    imgs = noise_and_flat()
    prompts = ["x"] * 4
    comp = make_reward("jpeg_compressibility").score(imgs, prompts)
    inc = make_reward("jpeg_incompressibility").score(imgs, prompts)
    want = torch.tensor([pil_kb(i) for i in imgs])
    assert torch.allclose(inc, want) and torch.allclose(comp, -want / 500)
    assert comp[2] > comp[0] and inc[0] > inc[2]
    video = imgs.reshape(2, 2, 3, 64, 64).permute(0, 2, 1, 3, 4)  # 2 videos of 2 frames
    v = make_reward("jpeg_incompressibility").score(video, ["a", "b"])
    assert torch.allclose(v, torch.stack([want[:2].mean(), want[2:].mean()]))


def test_color_reward_is_prompt_conditioned_and_smooth() -> None:
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1
    r = ColorReward()
    assert r.score(red, ["a red square"]).item() == pytest.approx(1.0)
    assert r.score(red, ["a blue square"]).item() == pytest.approx(1 - math.sqrt(2) / math.sqrt(3))
    blue = torch.zeros(1, 3, 8, 8)
    blue[:, 2] = 1
    mixes = [r.score(t * red + (1 - t) * blue, ["A RED circle"]).item() for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert all(b > a for a, b in zip(mixes, mixes[1:]))
    assert target_color("a light blue sky with red") == target_color("light blue")
    with pytest.raises(RewardError, match="names no colour"):
        r.score(red, ["a square"])
    with pytest.raises(RewardError, match="1 images but 2 prompts"):
        r.score(red, ["red", "blue"])
    with pytest.raises(RewardError, match=r"\[0, 1\]"):
        r.score(red * 2, ["red"])


def test_ocr_scoring_rules() -> None:
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert quoted_text('a sign that says "Hello World" on it') == "Hello World"
    assert ocr_similarity("xxHELLOWORLDxx", "hello world") == 1.0
    assert ocr_similarity("helo world", "hello world") == pytest.approx(1 - 1 / 10)
    assert ocr_similarity("", "abc") == 0.0
    with pytest.raises(RewardError, match="no \"quoted\" target"):
        quoted_text("no quotes here")


def test_ocr_reads_rendered_text() -> None:
    pytest.importorskip("rapidocr_onnxruntime")
    img = Image.new("RGB", (128, 32), "white")
    ImageDraw.Draw(img).text((5, 8), "HELLO 42", fill="black")
    t = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float() / 255
    blank = torch.ones_like(t)
    s = OcrReward().score(torch.cat([t, blank]), ['a sign "hello 42"', 'a sign "hello 42"'])
    assert s[0] > 0.7 and s[1] < 0.5 and s[0] > s[1]


def test_ocr_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # makes the import fail
    with pytest.raises(RewardError, match=r"digenrl\[ocr\]"):
        OcrReward().score(torch.zeros(1, 3, 8, 8), ['"a"'])


def test_weighted_sum_and_failure_policy(caplog: pytest.LogCaptureFixture) -> None:
    imgs = noise_and_flat(1)
    prompts = ["a red thing", "a gray thing"]
    combo = build_reward({"color": 2.0, "jpeg_incompressibility": 0.5})
    want = 2 * ColorReward().score(imgs, prompts) + 0.5 * make_reward("jpeg_incompressibility").score(imgs, prompts)
    assert torch.allclose(combo.score(imgs, prompts), want)
    with pytest.raises(RewardError, match="names no colour"):
        combo.score(imgs, ["nothing", "here"])
    guarded = build_reward({"color": 1.0}, on_error="penalty", penalty=-3.0)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(guarded.score(imgs, ["nothing", "here"]), torch.tensor([-3.0, -3.0]))
    assert guarded.failures == 1 and "using penalty -3" in caplog.text
    with pytest.raises(ConfigError, match="unknown reward 'imagereward'.*allowed: jpeg_compressibility"):
        build_reward({"imagereward": 1.0})
    with pytest.raises(ConfigError, match=r"reward.models.aesthetic.path: the 'aesthetic' reward needs it"):
        build_reward({"aesthetic": 1.0})  # a learned reward: its table names its weights
    with pytest.raises(ConfigError, match="needs a url"):
        build_reward({"remote": 1.0})


@pytest.mark.parametrize("fmt", ["png", "raw"])
def test_remote_reward_against_a_real_loopback_server(fmt: str) -> None:
    imgs = noise_and_flat()
    prompts = ["a"] * 4
    local = make_reward("jpeg_compressibility").score(imgs, prompts)
    with RewardServer(make_reward("jpeg_compressibility")) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        remote = RemoteReward(srv.url, image_format=fmt, timeout=10)
        assert torch.equal(remote.score(imgs, prompts), local)  # PNG and raw are both lossless on uint8
        video = imgs.reshape(2, 2, 3, 64, 64).permute(0, 2, 1, 3, 4)
        assert torch.allclose(remote.score(video, ["a", "b"]), torch.stack([local[:2].mean(), local[2:].mean()]))
        assert srv.requests == 2


def test_remote_errors_are_named() -> None:
    imgs = torch.rand(1, 3, 16, 16)
    with RewardServer(make_reward("color")) as srv:
        with pytest.raises(RewardError, match="HTTP 400.*names no colour"):
            RemoteReward(srv.url).score(imgs, ["nothing"])
        req = urllib.request.Request(srv.url, data=json.dumps({"prompts": ["red"], "images": {"format": "gif"}}).encode())
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 400 and "images.format" in info.value.read().decode()
        dead_url = srv.url
    with pytest.raises(RewardError, match="failed after 3 attempts"):
        RemoteReward(dead_url, retries=2, backoff=0.01, timeout=2).score(imgs, ["red"])


def test_server_module_runs_as_a_program() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "digenrl.rewards.server", "--reward", "color", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/score")
        red = torch.zeros(1, 3, 8, 8)
        red[:, 0] = 1
        assert RemoteReward(url, timeout=20).score(red, ["red"]).item() == pytest.approx(1.0, abs=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
