"""An edit reward served over HTTP gets the samples' input images (``reward.remote_sources``): a real
loopback :class:`RewardServer` serving ``edit_consistency`` scores what the local reward scores, refuses a
request without sources naming the config key, and names the malformed ``sources`` field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from digenrl.config import RewardConfig, config_from_dict
from digenrl.errors import ConfigError
from digenrl.rewards import RewardError, build_reward
from digenrl.rewards._wire import decode_sources, encode_images, encode_sources
from digenrl.rewards.edit import EditConsistencyReward
from digenrl.rewards.registry import make_reward
from digenrl.rewards.remote import RemoteReward
from digenrl.rewards.server import RewardServer

PROMPTS = ["make it blue", "turn the square red", "a white background"]


@pytest.fixture(scope="module")
def edit_server() -> Iterator[RewardServer]:
    with RewardServer(EditConsistencyReward(), host="127.0.0.1", port=0) as server:
        yield server


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[3, 3, 8, 8]`` and their two input images each ``[3, 2, 3, 8, 8]``."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(3, 3, 8, 8, generator=g), torch.rand(3, 2, 3, 8, 8, generator=g)


def quantised(x: torch.Tensor) -> torch.Tensor:
    """What the server decodes: 8-bit RGB (rounded to nearest) back in [0, 1]."""
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).float() / 255


def post(url: str, request: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


@pytest.mark.parametrize("fmt", ["raw", "png"])
def test_a_served_edit_reward_scores_as_the_local_one_on_the_quantised_batch(edit_server: RewardServer,
                                                                             fmt: str) -> None:
    images, sources = batch()
    want = EditConsistencyReward().score(quantised(images), PROMPTS, sources=quantised(sources))
    remote = RemoteReward(edit_server.url, image_format=fmt, retries=0, timeout=20, send_sources=True)
    assert remote.uses_sources
    assert torch.equal(remote.score(images, PROMPTS, sources=sources), want)  # both 8-bit codecs are lossless


def test_reward_remote_sources_reaches_the_client_through_the_config(edit_server: RewardServer) -> None:
    images, sources = batch()
    opts = RewardConfig(weights={"remote": 1.0}, url=edit_server.url, image_format="raw", retries=0,
                        remote_sources=True).build_options("cpu")
    reward = build_reward({"remote": 1.0}, **opts)
    assert reward.uses_sources  # so the recipes load the input images (data/images.py reward_inputs)
    want = EditConsistencyReward().score(quantised(images), PROMPTS, sources=quantised(sources))
    assert torch.equal(reward.score(images, PROMPTS, sources=sources), want)
    assert not build_reward({"remote": 1.0}, url=edit_server.url).uses_sources  # the default sends none


def test_without_sources_the_server_answers_400_naming_reward_remote_sources(edit_server: RewardServer) -> None:
    images, _ = batch()
    plain = RemoteReward(edit_server.url, retries=0, timeout=20)
    assert not plain.uses_sources
    with pytest.raises(RewardError) as info:
        plain.score(images, PROMPTS)
    msg = str(info.value)
    assert "HTTP 400" in msg and "reward.remote_sources = true" in msg and "'edit_consistency'" in msg


def test_the_start_up_probe_names_reward_remote_sources_for_an_edit_server(edit_server: RewardServer) -> None:
    """digenrl validate / run probe reward.url before anything starts: a client that would send no input images
    to a reward that needs them is refused there, not at the first scored batch."""
    with pytest.raises(RewardError, match=r"input images; set reward.remote_sources = true"):
        RemoteReward(edit_server.url, retries=0, timeout=20).probe()
    RemoteReward(edit_server.url, retries=0, timeout=20, send_sources=True).probe()  # serves: an empty batch's 400
    with RewardServer(make_reward("color"), host="127.0.0.1", port=0) as server:
        RemoteReward(server.url, retries=0, timeout=20).probe()  # a reward without sources needs none


def test_send_sources_without_sources_is_refused_before_any_request(edit_server: RewardServer) -> None:
    images, sources = batch()
    remote = RemoteReward(edit_server.url, retries=0, timeout=20, send_sources=True)
    before = edit_server.requests
    with pytest.raises(RewardError, match=r"reward.remote_sources.*sources=None"):
        remote.score(images, PROMPTS)
    with pytest.raises(RewardError, match=r"sources: expected .*\[B=3, K, 3, H, W\], got \(2, 2, 3, 8, 8\)"):
        remote.score(images, PROMPTS, sources=sources[:2])
    assert edit_server.requests == before


def _request(per_sample: Any = 2, n_sources: int = 6, **sources_fields: Any) -> dict[str, Any]:
    images, sources = batch()
    obj = encode_images(sources.reshape(6, 3, 8, 8)[:n_sources], "raw")
    return {"prompts": PROMPTS, "images": encode_images(images, "raw"),
            "sources": {**obj, "per_sample": per_sample, **sources_fields}}


@pytest.mark.parametrize(("request_", "names"), [
    (_request(per_sample=0), "sources.per_sample"),
    (_request(per_sample="2"), "sources.per_sample"),
    (_request(per_sample=True), "sources.per_sample"),
    (_request(per_sample=3), "sources: 6 images, expected 3 prompts x per_sample=3 = 9"),
    (_request(n_sources=5, per_sample=2), "sources: 5 images, expected 3 prompts x per_sample=2 = 6"),
    (_request(format="gif"), "sources.format"),
    (_request(frames=2), "sources.frames"),
    ({"prompts": PROMPTS, "images": _request()["images"], "sources": [1, 2]}, "sources: expected an object"),
], ids=["per_sample_0", "per_sample_str", "per_sample_bool", "count_vs_per_sample", "count_vs_prompts", "format",
        "frames", "not_an_object"])
def test_malformed_sources_get_400_naming_the_field(edit_server: RewardServer, request_: dict[str, Any],
                                                    names: str) -> None:
    code, error = post(edit_server.url, request_)
    assert code == 400 and names in error, error


def test_a_reward_without_sources_ignores_them() -> None:
    images, sources = batch()
    prompts = ["red", "blue", "green"]
    with RewardServer(make_reward("color"), host="127.0.0.1", port=0) as server:
        plain = RemoteReward(server.url, image_format="raw", retries=0, timeout=20).score(images, prompts)
        sent = RemoteReward(server.url, image_format="raw", retries=0, timeout=20, send_sources=True)
        assert torch.equal(sent.score(images, prompts, sources=sources), plain)
        bad = _request(per_sample=0)  # never decoded: the color reward takes no sources
        assert post(server.url, {**bad, "prompts": prompts})[0] == 200


@pytest.mark.parametrize("fmt", ["raw", "png"])
def test_sources_round_trip_sample_major(fmt: str) -> None:
    _, sources = batch()
    obj = encode_sources(sources, 3, fmt)
    assert obj["per_sample"] == 2 and obj["frames"] == 1
    assert torch.equal(decode_sources(obj, 3), quantised(sources))  # sample 0's K images first, in order


@pytest.mark.parametrize("bad", ["yes", 1])
def test_a_wrong_type_of_reward_remote_sources_is_refused_naming_the_key(bad: object) -> None:
    assert config_from_dict({}).reward.remote_sources is False
    assert config_from_dict({"reward": {"remote_sources": True}}).reward.remote_sources is True
    with pytest.raises(ConfigError, match=r"reward\.remote_sources"):
        config_from_dict({"reward": {"remote_sources": bad}})
    with pytest.raises(ConfigError, match=r"reward\.remote_sources: must be true or false"):
        RewardConfig(remote_sources=bad)  # type: ignore[arg-type]
