"""DiffusionNFT and AWM end to end: every schedule, the on-policy runs equal the colocated loop, resume, faults.

The tiny Qwen-Image (random preset) with inproc actors unless a test needs processes; a forward-process sample
has ``trained_steps`` rows (its noise levels), all trained (equal-reward groups too).
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import psutil
import pytest

from digenrl.config import load_config
from digenrl.recipes.checkpoint import find_checkpoint
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.policy import trained_steps
from tests.e2e._tiny import every_schedule, run_schedule as _run, tiny_config as _cfg

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"




@pytest.mark.parametrize("algorithm", ["nft", "awm"])
@pytest.mark.parametrize("schedule", every_schedule())
async def test_every_schedule_trains_every_row_of_every_sample(algorithm: str, schedule: str) -> None:
    cfg = _cfg(algorithm, schedule, train={"check_parity": True})  # async1: parity of stale rows too
    history = await _run(cfg)
    rows = 2 * 2 * trained_steps(cfg)  # prompts x group x noise levels
    assert trained_steps(cfg) == (3 if algorithm == "nft" else 6)  # floor(0.99 x 4); awm.levels
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["rows_trained"] == m["rows_kept"] == rows
        assert math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
        assert m["parity_rows"] > 0 and m["parity_logp_diff_max"] < 1e-4  # the trainer recomputes the rollout's probe
    key = "algorithm/old_decay" if algorithm == "nft" else "algorithm/ema_decay"
    assert [m[key] for m in history] == pytest.approx([0.001, 0.002])  # the slow copy follows after each step


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
@pytest.mark.parametrize("schedule", ["disaggregated", pytest.param("tag", marks=pytest.mark.slow)])
async def test_an_on_policy_actor_run_trains_what_the_colocated_loop_trains(algorithm: str, schedule: str) -> None:
    """Same samples (seeded per sample), same rows (levels and noise seeded per sample), same old policy: the
    actors' metrics equal the colocated loop's up to the order of float sums."""
    tables = {"rollout": {"prompts_per_batch": 4}, "train": {"iterations": 3}}
    colocated = await _run(_cfg(algorithm, "colocated", **tables))
    actors = await _run(_cfg(algorithm, schedule, **tables))
    keys = ("reward_mean", "reward_std", "policy_loss", "kl", "grad_norm", "adv_abs_mean")
    for a, b in zip(colocated, actors, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4, abs=1e-7)
    assert colocated[2]["reward_mean"] != colocated[0]["reward_mean"]


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
async def test_the_algorithm_sees_equal_reward_groups_and_flow_grpo_drops_them(algorithm: str) -> None:
    """A constant reward: every group has zero std; forward-process methods still train (their KL / trust region),
    Flow-GRPO has nothing to learn from."""
    const = {"reward": {"weights": {"jpeg_compressibility": 0.0}}}
    fwd = await _run(_cfg(algorithm, "disaggregated", **const))
    assert all(m["zero_std_ratio"] == 1.0 and m["rows_kept"] == m["rows_trained"] > 0 for m in fwd)
    grpo = await _run(_cfg("flow_grpo", "disaggregated", **const))
    assert all(m["rows_kept"] == 0 and m["grad_norm"] == 0 for m in grpo)


@pytest.mark.parametrize("schedule", ["colocated", "disaggregated", "async1"])
async def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path, schedule: str) -> None:
    """The old policy travels in the checkpoint (old.safetensors): a resumed NFT run equals an uninterrupted one."""
    ckpt = {"log": {"image_every": 0, "checkpoint_every": 1, "live": False}}
    whole = await _run(_cfg("nft", schedule, train={"iterations": 3}, **ckpt), tmp_path / "whole")
    await _run(_cfg("nft", schedule, train={"iterations": 2}, **ckpt), tmp_path / "cut")
    assert (find_checkpoint(tmp_path / "cut") / "old.safetensors").is_file()
    resumed = await _run(_cfg("nft", schedule, train={"iterations": 3}, **ckpt), tmp_path / "cut",
                         resume=tmp_path / "cut")
    keys = ("reward_mean", "policy_loss", "kl", "grad_norm", "algorithm/old_deviate", "max_staleness")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in whole]
    assert whole[2]["algorithm/old_deviate"] > 0


@pytest.mark.parametrize("schedule", ["colocated", "disaggregated"])
async def test_a_resume_without_the_old_policy_file_names_it(tmp_path: Path, schedule: str) -> None:
    ckpt = {"log": {"image_every": 0, "checkpoint_every": 1, "live": False}}
    await _run(_cfg("nft", schedule, train={"iterations": 1}, **ckpt), tmp_path)
    (find_checkpoint(tmp_path) / "old.safetensors").unlink()
    with pytest.raises(Exception, match=r"old.safetensors: nft resumes its old policy from this file"):
        await _run(_cfg("nft", schedule, **ckpt), tmp_path, resume=tmp_path)


@pytest.mark.slow  # (the lane is the Flow-GRPO one, tested in test_disaggregated; here: it carries the old policy)
async def test_weights_over_the_gloo_lane_equal_zmq() -> None:
    """The trainer publishes the old policy over either lane; the samples (and so every metric) agree."""
    procs = {"actors": "zmq"}  # the gloo lane joins actor processes
    zmq = await _run(_cfg("nft", "disaggregated", train={"iterations": 3}, transport=procs))
    gloo = await _run(_cfg("nft", "disaggregated", train={"iterations": 3}, transport={**procs, "weights": "gloo"}))
    keys = ("reward_mean", "policy_loss", "grad_norm", "parity_logp_diff_max")
    for a, b in zip(zmq, gloo, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-6, abs=1e-9)


def _pid_of(title: str) -> int | None:
    for p in psutil.Process().children(recursive=True):
        try:
            if any(title in part for part in p.cmdline()):
                return p.pid
        except psutil.NoSuchProcess:
            continue
    return None


async def test_a_killed_rollout_actor_loses_nothing(tmp_path: Path) -> None:
    """kill -9 of the rollout process mid-run (zmq actors): its token is re-issued, every step trains every row."""
    cfg = load_config(CONFIG, ["train.algorithm=nft", "schedule.name=tag", "rollout.prompts_per_batch=8",
                               "schedule.fragment_groups=4", "schedule.train_pack=32", "train.iterations=3",
                               "log.image_every=0", "log.checkpoint_every=0"])
    killed: list[int] = []

    def on_dispatch(device: str, token: dict) -> None:
        if not killed and device == "rollout-0" and token["kind"] == "rollout" and token["batch"] >= 1:
            pid = _pid_of("digenrl-rollout-0")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    history = await arun_disaggregated(cfg, tmp_path, on_dispatch=on_dispatch)
    assert killed
    assert [m["step"] for m in history] == [0, 1, 2]
    assert all(m["rows_trained"] == 8 * 8 * trained_steps(cfg) for m in history)


def test_keys_of_another_algorithm_are_refused_by_name(tmp_path: Path) -> None:
    from digenrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.noise_level: means nothing to train.algorithm = 'nft'"):
        load_config(CONFIG, ["train.algorithm=nft", "rollout.noise_level=0.5"])
    with pytest.raises(ConfigError, match=r"\[nft\]: means nothing to train.algorithm = 'flow_grpo'"):
        load_config(CONFIG, ["nft.beta=0.5"])
    with pytest.raises(ConfigError, match=r"\[awm\]: means nothing to train.algorithm = 'nft'"):
        load_config(CONFIG, ["train.algorithm=nft", "awm.levels=3"])
    own = tmp_path / "nft.toml"  # a file that chooses nft may not carry the SDE's keys
    own.write_text('[train]\nalgorithm = "nft"\n[rollout]\nsde = "sde"\n')
    with pytest.raises(ConfigError, match=r"rollout.sde: means nothing to train.algorithm = 'nft'"):
        load_config(own)
    cfg = load_config(CONFIG, ["train.algorithm=awm", "awm.kl_beta=0.01"])  # a Flow-GRPO file switched: runs
    assert cfg.awm.kl_beta == 0.01 and cfg.train.algorithm == "awm"
    with pytest.raises(ConfigError, match=r"train.algorithm: 'grpo' is not allowed; allowed: 'flow_grpo', 'nft', 'awm'"):
        load_config(CONFIG, ["train.algorithm=grpo"])
