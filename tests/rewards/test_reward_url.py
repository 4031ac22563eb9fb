"""The shipped configs' reward URL and ``python -m digenrl.rewards.server`` agree (issue 11 item 1):
the server program on a loopback port scores the configs' URL form, the bare base URL too, and a
wrong path or a dead server is an error naming the reward, the URL and the URL to use."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch

from digenrl.config import RewardConfig
from digenrl.rewards import RewardError, build_reward
from digenrl.rewards.remote import RemoteReward

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REMOTE_CONFIGS = ["flux.toml", "wan21.toml", "hunyuanvideo.toml"]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "digenrl.rewards.server", "--reward", "color", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()  # the program's first line is its URL
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def red(n: int = 2) -> torch.Tensor:
    x = torch.zeros(n, 3, 8, 8)
    x[:, 0] = 1
    return x


def on_port_of(url: str, server: str) -> str:
    """``url`` with its host and port replaced by the server's (the path, the form under test, kept)."""
    return urlunsplit(urlsplit(url)._replace(netloc=urlsplit(server).netloc))


@pytest.mark.parametrize("name", REMOTE_CONFIGS)
def test_the_shipped_config_url_scores_on_the_real_server(name: str, server_url: str) -> None:
    table = tomllib.loads((CONFIGS / name).read_text())["reward"]
    assert urlsplit(table["url"]).path == urlsplit(server_url).path == "/score"
    table["url"] = on_port_of(table["url"], server_url)  # a free port instead of 8000 (a shared machine)
    r = RewardConfig(**table)
    reward = build_reward({"remote": 1.0}, url=r.url, timeout=r.timeout, retries=0, on_error="raise")
    assert reward.score(red(), ["red", "red"]).tolist() == pytest.approx([1.0, 1.0], abs=1e-6)


def test_the_bare_base_url_scores_too(server_url: str) -> None:
    base = urlunsplit(urlsplit(server_url)._replace(path=""))
    for url in (base, base + "/", server_url + "/"):
        assert RemoteReward(url, retries=0, timeout=20).score(red(1), ["red"]).item() == pytest.approx(1.0, abs=1e-6)


def test_a_wrong_path_names_the_reward_the_url_and_the_url_to_use(server_url: str) -> None:
    wrong = urlunsplit(urlsplit(server_url)._replace(path="/v1/reward"))
    with pytest.raises(RewardError) as info:
        RemoteReward(wrong, retries=0, timeout=20).score(red(1), ["red"])
    msg = str(info.value)
    assert "reward 'remote'" in msg and wrong in msg and "HTTP 404" in msg and "reward.url" in msg
    assert f"scores on {server_url}" in msg


def test_a_dead_server_names_the_url_and_how_to_start_one() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RewardError) as info:
        RemoteReward(url, retries=1, backoff=0.01, timeout=5).score(red(1), ["red"])
    msg = str(info.value)
    assert f"reward 'remote' at {url}" in msg and "failed after 2 attempts" in msg and "refused" in msg.lower()
    assert f"python -m digenrl.rewards.server --reward NAME --port {port}" in msg
    assert f"serves {url}/score" in msg


class _Broken:
    """A reward that fails with an exception no reward is documented to raise."""

    name = "broken"

    def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise KeyError("no such colour")


def test_a_reward_that_raises_anything_answers_500_naming_it_not_a_dropped_connection() -> None:
    # A dropped connection reads, to the client, as a dead server ("is the reward server running?").
    from digenrl.rewards.server import RewardServer

    with RewardServer(_Broken()) as server:
        with pytest.raises(RewardError) as info:
            RemoteReward(server.url, retries=0, timeout=20).score(red(1), ["red"])
    msg = str(info.value)
    assert "HTTP 500: KeyError: 'no such colour'" in msg and "is the reward server running" not in msg
