"""The steady window's samples/s credits the work done inside it, never work done before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.schedule.base import Device, Role, Workload
from digenrl.telemetry.spans import Span, Timeline
from digenrl.telemetry.stats import summarize

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_batch_generated_before_the_window_is_not_its_work() -> None:
    """Two devices, two batches of 10 samples, each 1 s of rollout (r) then 1 s of training (t).

    r generates batch 0 in [0, 1) and batch 1 in [1, 2) while t trains batch 0 ([1, 2), step ends at 2);
    t trains batch 1 in [2, 3). The steady window [2, 3] holds t's 1 s, half of batch 1's 2 device-seconds,
    while r idles: 5 samples in 1 s (bubble 50%), not the 10 samples/s whole-batch counting gave, which is
    what both devices working all second would make.
    """
    spans = [Span("r", "rollout", 0, 0, 0, 0.0, 1.0, 10), Span("t", "train", 0, 0, 0, 1.0, 2.0),
             Span("t", "optim", 0, -1, 0, 2.0, 2.0), Span("r", "rollout", 1, 0, 0, 1.0, 2.0, 10),
             Span("t", "train", 1, 0, 0, 2.0, 3.0), Span("t", "optim", 1, -1, 1, 3.0, 3.0)]
    devices = [Device("r", Role.ROLLOUT), Device("t", Role.TRAINER)]
    res = Timeline("hand", devices, Workload(2, 1, 10, 1, 1), spans, 3.0, len(spans), {0: 2.0, 1: 3.0})
    stats = summarize(res)
    assert (stats.steady.start, stats.steady.end) == (2.0, 3.0)
    assert stats.steady.samples_per_s == pytest.approx(5.0)
    assert stats.steady.bubble_overall == pytest.approx(0.5)
    assert stats.full.samples_per_s == pytest.approx(20 / 3)  # [0, wall]: every trained sample


def test_a_simulated_pipeline_never_beats_its_devices() -> None:
    """async1 on the tiny config (3 steps, 256 samples a batch), 1 rollout + 1 trainer, measured costs.

    By hand: a sample costs 3 x 0.3 ms of rollout + 0.9 ms of reward + 0.9 ms of training (one trained
    step) = 2.7 ms of device time, so two devices make at most 2 / 2.7 ms = 740.7 samples/s, and a
    window in which they idle a share b makes (1 - b) x 740.7. The whole-batch count read 758.8 over 8
    batches: batch 1 had twice the steady lead of work done before batch 0's step ended.
    """
    from digenrl.config import load_config
    from digenrl.policy import trained_steps
    from digenrl.schedule import make_schedule
    from digenrl.sim.engine import simulate
    from digenrl.sim.measured import MeasuredCost

    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    assert cfg.rollout.num_steps == 3 and trained_steps(cfg) == 1
    # optim and publish at the cost floor (0.1 ms): 0.1 ms a batch, 0.4 us a sample
    cost = MeasuredCost({"rollout": (0.0, 3e-4), "reward": (0.0, 9e-4), "train": (0.0, 9e-4),
                         "optim": (0.0, 0.0), "publish": (0.0, 0.0)})
    ro = cfg.rollout
    workload = Workload(8, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    devices = [Device("r", Role.ROLLOUT), Device("t", Role.TRAINER)]
    sched = make_schedule("async1", devices, workload, cost, **cfg.schedule_options)
    steady = summarize(simulate(sched, devices, workload, cost)).steady
    per_sample = 3 * 3e-4 + 9e-4 + 9e-4 + 1e-4 / workload.samples_per_batch
    assert steady.samples_per_s <= 2 / per_sample
    assert steady.samples_per_s == pytest.approx((1 - steady.bubble_overall) * 2 / per_sample, rel=1e-9)
