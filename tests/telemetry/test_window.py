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


def test_the_drain_after_the_last_rollout_is_not_the_steady_window() -> None:
    """Three batches of 10 samples, each 1 s of rollout on r then 1 s of training on t, pipelined.

    r generates batch k in [k, k+1); t trains it in [k+1, k+2), its step ending at k+2. In [2, 3] both
    devices work (r on batch 2, t on batch 1: half of each batch's 2 device-seconds): 10 samples/s, no
    bubble, what the pipeline makes for as long as it runs. In [3, 4] r has no batch 3 to generate: the
    run's end, which the steady window leaves out ([2, 4] would read 7.5 samples/s and a 25% bubble).
    """
    spans = []
    for k in range(3):
        spans += [Span("r", "rollout", k, k, 0, k, k + 1.0, 10), Span("t", "train", k, k, 0, k + 1.0, k + 2.0),
                  Span("t", "optim", k, -1, k, k + 2.0, k + 2.0)]
    devices = [Device("r", Role.ROLLOUT), Device("t", Role.TRAINER)]
    res = Timeline("hand", devices, Workload(3, 1, 10, 1, 1), spans, 4.0, len(spans), {0: 2.0, 1: 3.0, 2: 4.0})
    stats = summarize(res)
    assert (stats.steady.start, stats.steady.end) == (2.0, 3.0)
    assert stats.steady.samples_per_s == pytest.approx(10.0)
    assert stats.steady.bubble_overall == pytest.approx(0.0)
    assert stats.full.samples_per_s == pytest.approx(30 / 4)


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
