"""A reward that always fails stops the run (issue 11 item 2), under the colocated loop and async1 over
real processes, with the last checkpoint intact and resumable; an occasional failure is only penalised."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from digenrl.config import Config, load_config
from digenrl.recipes.checkpoint import find_checkpoint, load_state
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.rewards import make_reward
from digenrl.rewards.failures import RewardFailing
from digenrl.rewards.server import RewardServer
from digenrl.roles.coordinator import RunStopped

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
SMALL = ("rollout.prompts_per_batch=4", "rollout.num_steps=4", "schedule.fragment_groups=2", "log.image_every=0")


def _load(*overrides: str) -> Config:
    return load_config(CONFIG, [*SMALL, *overrides])


def _remote(url: str) -> tuple[str, ...]:
    return ("reward.weights={remote = 1.0}", f'reward.url="{url}"', 'reward.on_error="penalty"', "reward.retries=0",
            "reward.timeout=20")


def _closed_port_url() -> str:
    with socket.socket() as s:  # a loopback port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/score"


def test_colocated_loop_stops_on_a_reward_that_refuses(tmp_path: Path) -> None:
    url = _closed_port_url()
    cfg = _load("schedule.name=colocated", "train.iterations=3", *_remote(url))
    with pytest.raises(RewardFailing) as info:
        train(cfg, out_dir=tmp_path)
    msg = str(info.value)
    assert f"reward 'remote' at {url} failed on 32 of 32 samples of batch 0" in msg
    assert "Last failure: reward 'remote' at" in msg and "refused" in msg.lower()
    assert not (tmp_path / "trainable.safetensors").exists()  # it stopped before training on penalties


async def test_async1_stops_when_the_reward_dies_and_resumes_from_the_intact_checkpoint(tmp_path: Path) -> None:
    server = RewardServer(make_reward("color")).start()
    common = ("schedule.name=async1", "train.iterations=6", "log.checkpoint_every=1")

    def on_step(m: dict) -> None:
        if m["step"] == 0:  # step 0 is checkpointed; from now on the reward's port refuses
            server.close()

    try:
        with pytest.raises(RunStopped) as info:
            await arun_disaggregated(_load(*common, *_remote(server.url)), tmp_path, on_step=on_step)
    finally:
        server.close()
    msg = str(info.value)
    assert f"reward 'remote' at {server.url} failed on" in msg and "Last failure: reward 'remote' at" in msg
    assert "refused" in msg.lower() and "resume with --resume" in msg and str(tmp_path) in msg
    ckpt = find_checkpoint(tmp_path)
    version = load_state(ckpt)["version"]
    assert 1 <= version < 6
    with RewardServer(make_reward("color")) as again:  # the reward is back (on another port)
        history = await arun_disaggregated(_load(*common, *_remote(again.url)), tmp_path, resume=tmp_path)
    assert [m["step"] for m in history] == list(range(6))
    assert all(m["reward_failures"] == 0 for m in history[version:])


async def test_an_occasional_failure_is_penalised_and_the_run_goes_on(tmp_path: Path) -> None:
    # One prompt of eight names no colour: the colour reward fails on its fragment (2 groups of 8 of
    # each batch's 64 samples) every batch, a quarter of the samples, under the default budget of a half.
    prompts = [f"a {c} square" for c in ("red", "green", "blue", "yellow", "white", "black", "purple")]
    cfg = _load("schedule.name=async1", "train.iterations=3", "rollout.prompts_per_batch=8", "transport.actors=inproc",
                f"data.prompts={[*prompts, 'a plain square']!r}".replace("'", '"'), 'reward.on_error="penalty"',
                "reward.weights={color = 1.0}")
    history = await arun_disaggregated(cfg, tmp_path)
    assert [m["step"] for m in history] == [0, 1, 2]
    assert [m["reward_failures"] for m in history] == [16, 16, 16]
