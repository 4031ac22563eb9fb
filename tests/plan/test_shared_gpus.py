"""placement.actors_per_gpu: which actors share a GPU, what the memory plan says of them, and the run's peaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.plan.memory import RESERVE_BYTES, check_memory, memory_plan, planned_vs_measured

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_actors_are_dealt_round_robin_so_trainers_get_gpus_of_their_own() -> None:
    place = load_config(CONFIGS / "tiny-qwenimage.toml", ["placement.trainer=2", "placement.reward=1"]).placement
    assert place.actors_per_gpu == 2 and place.gpus == 2  # 4 actors, 2 a GPU
    assert place.roles_by_gpu() == [["trainer", "rollout"], ["trainer", "reward"]]  # NCCL: one rank a device
    assert [place.gpu_of(k) for k in range(4)] == [0, 1, 0, 1]


def test_a_host_with_too_few_gpus_is_refused_naming_the_key_that_shares_them() -> None:
    place = load_config(CONFIGS / "qwenimage.toml").placement  # 4 rollout + 4 trainer actors, a GPU each
    place.check_gpus(8)
    with pytest.raises(ConfigError, match=r"8 actor processes at placement.actors_per_gpu = 1 need 8 GPUs; this "
                                          r"host has 4: set placement.actors_per_gpu = 2"):
        place.check_gpus(4)


def test_a_shared_gpu_holds_what_its_actors_hold_and_is_refused_with_the_numbers_when_they_do_not_fit() -> None:
    cfg = load_config(CONFIGS / "qwenimage.toml", ["placement.actors_per_gpu=2", "placement.gpu=H200"])
    plan = check_memory(cfg)  # trainer + rollout of Qwen-Image LoRA: 126 GB of a 141 GB H200
    trainer, rollout = plan.roles["trainer"], plan.roles["rollout"]
    assert [g.roles for g in plan.shared] == [["trainer", "rollout"]] * 4
    for g in plan.shared:
        assert g.bytes == trainer.bytes_per_device + rollout.bytes_per_device
        assert g.headroom == g.capacity - 2 * RESERVE_BYTES - g.bytes > 0
    alone = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["placement.gpu=H200"]))
    assert alone.shared == [] and alone.roles["trainer"].to_json() == trainer.to_json()  # sharing changes no role
    with pytest.raises(ConfigError, match=r"placement.actors_per_gpu = 2 puts trainer \+ rollout on one H100 \(GPU 0\): "
                                          r"125.7 GB \(trainer 69.2, rollout 56.5\) .* but it has 80.0 GB"):
        check_memory(load_config(CONFIGS / "qwenimage.toml", ["placement.actors_per_gpu=2"]))


def test_measured_peaks_sit_beside_the_plan_of_their_role() -> None:
    plan = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["placement.gpu=H200"]))
    planned = plan.roles["trainer"].bytes_per_device
    peaks = {"trainer-0": {"device": "cuda:0", "allocated": planned // 2, "reserved": planned},
             "rollout-3": {"device": "cuda:3", "allocated": 10, "reserved": 20},
             "reward-0": {"device": "cpu", "rss": 10**9}}  # a host process: not comparable, left out
    rows = planned_vs_measured(plan, peaks)
    assert [(r["actor"], r["role"]) for r in rows] == [("trainer-0", "trainer"), ("rollout-3", "rollout")]
    assert rows[0]["ratio"] == pytest.approx(0.5, rel=1e-9)
    assert rows[1]["planned"] == plan.roles["rollout"].bytes_per_device
