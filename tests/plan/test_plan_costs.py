"""`plan --costs` with measured costs v2: optimizer step, trainer-group all-reduce, per-token overhead and
publication priced; the shipped placement kept within the simulator's measured error; old files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.plan.fleet import plan_fleet
from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.schedule.cost import ring_allreduce_seconds
from digenrl.sim.measured import COSTS_VERSION, AllReduce, MeasuredCost
from digenrl.sim.user import fleet_pools

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PER_UNIT = {"rollout": 3e-4, "reward": 9e-4, "train": 9e-4}


def _costs(optim: float = 0.005, publish: float = 0.003, dispatch: float = 0.001,
           allreduce: AllReduce | None = None) -> MeasuredCost:
    fits = {k: (0.002, v) for k, v in PER_UNIT.items()} | {"optim": (optim, 0.0), "publish": (publish, 0.0)}
    return MeasuredCost(fits, dispatch, allreduce or AllReduce(1e5, 2e8, 5e-5))


def test_optim_token_pays_one_step_plus_the_ring_allreduce_of_its_group() -> None:
    ar = AllReduce(4e6, 1e8, 1e-4)
    cost = _costs(optim=0.01, allreduce=ar)
    dev = Device("t0", Role.TRAINER)
    alone = Token(0, TokenKind.OPTIM, "t0", 0)
    pair = Token(1, TokenKind.OPTIM, "t0", 0, group=("t0", "t1"))
    assert cost.seconds(alone, dev) == pytest.approx(0.01)
    # 2 ranks: each sends half the bytes twice (reduce-scatter + all-gather) and pays 2 latencies
    assert cost.seconds(pair, dev) == pytest.approx(0.01 + 4e6 / 1e8 + 2 * 1e-4)
    assert ar.seconds(2) == pytest.approx(ring_allreduce_seconds(4e6, 2, 1e8, 1e-4))
    # the per-token overhead lands on compute tokens only
    roll = Token(2, TokenKind.ROLLOUT, "t0", 0, num_samples=8, step_start=0, step_end=2)
    assert cost.seconds(roll, dev) == pytest.approx(0.002 + 3e-4 * 16 + 0.001)
    assert cost.seconds(Token(3, TokenKind.PUBLISH, "t0", 0), dev) == pytest.approx(0.003)


def test_allreduce_from_two_timings_reproduces_them() -> None:
    ar = AllReduce.from_timings(2e6, small_s=2e-4, full_s=0.0102)
    assert ar.latency_s == pytest.approx(1e-4)
    assert ar.seconds(2) == pytest.approx(0.0102)


def test_costs_round_trip_through_a_report_and_old_reports_are_refused(tmp_path: Path) -> None:
    cost = _costs()
    report = tmp_path / "bubbles.json"
    report.write_text(json.dumps({"calibration": {**cost.to_calibration(), "plan_error": 0.04}}))
    back = MeasuredCost.from_report(report)
    assert back == cost
    assert MeasuredCost.report_error(report) == pytest.approx(0.04)
    # a report that ran the config at its other splits: the error on their ratio is the planner's tolerance
    report.write_text(json.dumps({"calibration": {**cost.to_calibration(), "plan_error": 0.04,
                                                  "placement_error": 0.015}}))
    assert MeasuredCost.report_error(report) == pytest.approx(0.015)
    # a version-1 report: per-kind fits only (what `bench bubbles --real` wrote before)
    report.write_text(json.dumps({"calibration": {"measured_costs": {
        k: {"overhead_s": 0.0, "per_unit_s": v} for k, v in PER_UNIT.items()}}}))
    with pytest.raises(ConfigError, match=r"costs_version: None, need 3: .*optimizer step.*rerun `digenrl bench"):
        MeasuredCost.from_report(report)
    broken = cost.to_calibration()
    del broken["allreduce"]
    report.write_text(json.dumps({"calibration": broken}))
    with pytest.raises(ConfigError, match="allreduce"):
        MeasuredCost.from_report(report)
    broken = cost.to_calibration()
    del broken["measured_costs"]["optim"]
    report.write_text(json.dumps({"calibration": broken}))
    with pytest.raises(ConfigError, match=r"lacks \['optim'\]"):
        MeasuredCost.from_report(report)
    assert COSTS_VERSION == 3
    # a version-2 report: no per-step term (it would price a step of few samples as a fraction of a full one)
    v2 = cost.to_calibration() | {"costs_version": 2}
    del v2["measured_costs"]["rollout"]["per_step_s"]
    report.write_text(json.dumps({"calibration": v2}))
    with pytest.raises(ConfigError, match=r"costs_version: 2, need 3: .*per-step cost.*rerun `digenrl bench bubbles "
                                          r"--real --out DIR`"):
        MeasuredCost.from_report(report)


def test_large_allreduce_keeps_the_planner_off_a_second_trainer() -> None:
    """2 devices; a gradient all-reduce that costs more than a whole batch's work on one device.

    By hand: rollout 0 / 2 trainers runs one 2-member all-reduce per batch, which occupies both devices,
    so it cannot beat samples / all-reduce seconds; 1 rollout + 1 trainer never all-reduces and is no
    slower than one device doing everything in turn, samples / (work per batch). The all-reduce is set
    to 3x that work, so the hand-computed best is 1 / 1.
    """
    from digenrl.policy import trained_steps

    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    ro = cfg.rollout
    samples = ro.prompts_per_batch * ro.group_size
    work = samples * (PER_UNIT["rollout"] * ro.num_steps + PER_UNIT["reward"] + PER_UNIT["train"] * trained_steps(cfg))
    slow = AllReduce.from_timings(1e5, small_s=0.0, full_s=3 * work)
    plan = plan_fleet(cfg, fleet_pools("2xmeasured"), batches=4, final_batches=8, measured=_costs(allreduce=slow),
                      per_split=True)
    assert plan.best.trainer == {"measured": 1} and plan.best.rollout == {"measured": 1}
    two = [c for c in plan.split_best if c.trainer == {"measured": 2}]
    assert two and two[0].samples_per_s <= samples / (3 * work) * 1.001
    assert plan.best.samples_per_s > samples / (3 * work)  # 1 / 1 beats the 2-trainer bound
    # cheap all-reduce: the 2-trainer split's bound is lifted (the planner may then pick either)
    cheap = plan_fleet(cfg, fleet_pools("2xmeasured"), batches=4, final_batches=8, measured=_costs(), per_split=True)
    assert max(c.samples_per_s for c in cheap.split_best if c.trainer == {"measured": 2}) > samples / (3 * work)


def test_shipped_placement_stays_first_within_the_measured_error() -> None:
    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    pools = fleet_pools("2xmeasured")
    exact = plan_fleet(cfg, pools, batches=4, final_batches=8, measured=_costs(), tolerance=0.0)
    shipped = [c for c in exact.candidates if c.shipped]
    assert len(shipped) == 1
    s = shipped[0]
    assert (sum(s.rollout.values()), sum(s.trainer.values()), s.tag_steps, s.fragment_groups) == (
        cfg.placement.rollout, cfg.placement.trainer, cfg.schedule.tag_steps, cfg.schedule.fragment_groups)
    # tolerance 0: the fastest predicted first, whichever it is
    assert exact.best.samples_per_s == max(c.samples_per_s for c in exact.candidates)
    # a tolerance above every candidate's predicted gain: the shipped placement first, and the output says so
    wide = plan_fleet(cfg, pools, batches=4, final_batches=8, measured=_costs(), tolerance=10.0)
    assert wide.best.shipped
    if not exact.best.shipped:
        assert any("kept the shipped placement" in n and "within the simulator's measured error" in n
                   for n in wide.notes)


def test_a_large_per_step_cost_makes_the_plan_take_the_largest_fragments() -> None:
    """Rollout tokens that cost 50 ms per denoising step whatever their samples (+ 10 us per sample-step);
    scoring and training almost free.

    By hand: a fragment is ``8 x fragment_groups`` samples and a rollout token one fragment, so a batch
    of 256 samples at 3 steps costs 3 x (0.05 x 32 / fragment_groups + 1e-5 x 256) device-seconds of
    rollout, and with both devices generating (nothing else to do) samples/s = 2 x 256 / that:
    1664 at 16 groups, 842 at 8, 424 at 4. The planner must take the largest fragments the grid offers.
    """
    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    fits = {"rollout": (0.0, 1e-5), "reward": (0.0, 1e-6), "train": (0.0, 1e-6), "optim": (0.0, 0.0),
            "publish": (0.0, 0.0)}
    cost = MeasuredCost(fits, 0.0, AllReduce(0.0, 1.0, 0.0), step_s=0.05)
    plan = plan_fleet(cfg, fleet_pools("2xmeasured"), batches=4, final_batches=8, measured=cost, top=20)

    def by_hand(groups: int) -> float:
        return 2 * 256 / (3 * (0.05 * 32 / groups + 1e-5 * 256))

    assert plan.best.fragment_groups == cfg.schedule.fragment_groups == 16  # the largest on the grid
    assert plan.best.samples_per_s == pytest.approx(by_hand(16), rel=0.01)
    two = [c for c in plan.candidates if c.trainer == {"measured": 2} and c.schedule != "colocated-tsp"]  # TAG only
    assert {c.fragment_groups for c in two} >= {4, 8}
    for c in two:
        assert c.samples_per_s == pytest.approx(by_hand(c.fragment_groups), rel=0.01)
