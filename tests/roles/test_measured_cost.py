"""`bench bubbles --real`: the simulator calibration (per-kind linear fits of measured tokens) and a short real run."""

from __future__ import annotations

import json

import pytest

from digenrl.errors import ConfigError
from digenrl.recipes.bench_real import run_real_bubbles
from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.sim.measured import MeasuredCost


def _tok(kind: TokenKind, samples: int = 0, steps: int = 0, rows: int = 0) -> Token:
    return Token(0, kind, "d", 0, num_samples=samples, step_start=0, step_end=steps, transitions=rows)


def test_fit_recovers_overhead_and_per_unit_costs() -> None:
    data = [(_tok(TokenKind.ROLLOUT, s, k), 0.02 + 0.001 * s * k) for s, k in ((8, 2), (16, 2), (8, 6), (32, 1))]
    data += [(_tok(TokenKind.TRAIN, rows=r), 0.005 + 0.002 * r) for r in (40, 80, 160)]
    data += [(_tok(TokenKind.REWARD, 8), 0.064), (_tok(TokenKind.REWARD, 8), 0.066)]  # one size: per-unit mean
    cost = MeasuredCost.fit(data)
    assert cost.fits["rollout"] == pytest.approx((0.02, 0.001))
    assert cost.fits["train"] == pytest.approx((0.005, 0.002))
    assert cost.fits["reward"] == pytest.approx((0.0, 0.065 / 8))
    dev = Device("d", Role.ROLLOUT, speed=2.0)
    assert cost.seconds(_tok(TokenKind.ROLLOUT, 10, 3), dev) == pytest.approx((0.02 + 0.03) / 2)
    assert cost.seconds(_tok(TokenKind.PUBLISH), dev) > 0


def test_scaled_cost_is_every_fit_times_the_factor() -> None:
    cost = MeasuredCost({"rollout": (0.02, 0.001), "train": (0.0, 0.004)}).scaled(1.5)
    assert cost.fits["rollout"] == pytest.approx((0.03, 0.0015)) and cost.fits["train"] == pytest.approx((0.0, 0.006))


def test_colocated_phase_costs_make_the_simulator_reproduce_the_colocated_loop() -> None:
    """The colocated loop's phase timings, charged per unit of what the simulator counts, give back its rate."""
    from digenrl.config import load_config
    from digenrl.recipes.bench_real import DEFAULT_CONFIG, _colocated, _simulated
    from digenrl.telemetry.stats import summarize

    cfg = load_config(DEFAULT_CONFIG, ["rollout.prompts_per_batch=4", "train.iterations=3", "log.image_every=0",
                                       "log.checkpoint_every=0", "schedule.name=colocated"])
    measured, cost, workload = _colocated(cfg, 3)
    predicted = summarize(_simulated("colocated", [Device("hybrid-0", Role.HYBRID)], workload, cost)).steady
    assert predicted.samples_per_s == pytest.approx(measured["samples_per_s"], rel=0.02)


@pytest.mark.parametrize(("kwargs", "field"), [({"schedules": ["nope"]}, "nope"), ({"num_batches": 1}, "num_batches"),
                                                ({"repeats": 0}, "repeats")])
def test_run_real_bubbles_rejects_bad_arguments_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        run_real_bubbles(**kwargs)


def test_median_run_is_robust_to_one_disturbed_run() -> None:
    from digenrl.recipes.bench_real import _median

    assert _median([{"s": 60.0}, {"s": 12.0}, {"s": 58.0}], lambda r: r["s"]) == {"s": 58.0}
    assert _median([{"s": 60.0}, {"s": 12.0}], lambda r: r["s"]) == {"s": 12.0}  # even count: the lower one


@pytest.mark.slow
def test_real_bench_measures_colocated_the_pair_ceiling_and_async1(tmp_path) -> None:
    small = ["rollout.prompts_per_batch=4", "schedule.fragment_groups=2", "schedule.train_pack=16"]
    report = run_real_bubbles(["colocated", "async1", "async1+reward"], num_batches=3, out=tmp_path, overrides=small)
    rows = {r["scenario"]: r for r in report["rows"]}
    assert list(rows) == ["real-colocated", "real-colocated-1thread", "real-2x1thread", "real-3x1thread",
                          "real-async1", "real-async1+reward", "real-async1@0r2t", "real-async1-fine"]
    # the actor runs fitted a factor per running-kind mix on top of the counted ones
    mix = report["calibration"]["contention"]["mix"]
    assert mix and all(len(k.split("+")) >= 2 and f > 0 for k, f in mix.items())
    # a row with 3 actor processes: the trio measured beside the pair, both slowdowns in the calibration
    one, trio = rows["real-colocated-1thread"]["samples_per_s"], rows["real-3x1thread"]
    assert len(trio["samples_per_s_processes"]) == 3
    assert trio["slowdown"] == pytest.approx(one / (trio["samples_per_s"] / 3))
    assert report["calibration"]["contention"]["slowdown"] == {
        "2": pytest.approx(rows["real-2x1thread"]["slowdown"]), "3": pytest.approx(trio["slowdown"])}
    pair = rows["real-2x1thread"]
    assert len(pair["samples_per_s_processes"]) == 2 and pair["samples_per_s"] == sum(pair["samples_per_s_processes"])
    # against the ceiling of the same round (one round here)
    async1 = rows["real-async1"]
    assert async1["vs_ceiling"] == pytest.approx(async1["samples_per_s"] / pair["samples_per_s"])
    assert all(r["samples_per_s"] > 0 for r in rows.values())
    assert rows["real-colocated"]["speedup_vs_colocated"] == 1.0
    assert set(rows["real-async1"]["bubble_per_actor"]) == {"rollout-0", "trainer-0"}
    assert rows["real-async1"]["sim_error"] is not None and rows["real-async1"]["max_staleness"] == 1
    assert rows["real-async1"]["sim_error_token_fit"] is not None
    assert abs(rows["real-colocated"]["sim_error"]) < 0.05  # its own phase timings: near zero by construction
    assert report["calibration"]["source"].startswith("this run's 1-thread colocated phases")
    assert json.loads((tmp_path / "bubbles.json").read_text())["rows"][2]["scenario"] == "real-2x1thread"
    assert (tmp_path / "gantt-real.png").is_file()


@pytest.mark.slow  # ~30 s: a real bench run
def test_real_bench_writes_the_plan_costs_it_measured(tmp_path) -> None:
    """costs version 3 in bubbles.json: each figure against what the runs' own traces (or the model) say."""
    import statistics

    import torch

    from digenrl.config import load_config
    from digenrl.policy import build_model
    from digenrl.recipes.bench_real import DEFAULT_CONFIG

    small = ["rollout.prompts_per_batch=4", "schedule.fragment_groups=2", "schedule.train_pack=16"]
    report = run_real_bubbles(["async1"], num_batches=3, out=tmp_path, overrides=small)
    # the config's schedule at its other split (0 rollout / 2 trainers: they generate with TAG) too
    assert [r["scenario"] for r in report["rows"]] == ["real-async1", "real-async1@0r2t", "real-async1-fine"]
    assert report["rows"][1]["split"] == {"rollout": 0, "trainer": 2, "hybrid": 0}
    # each actor's bubble is over the row's own steady window: per role it is the row's bubble ratio
    row = report["rows"][0]
    assert row["bubble_per_actor"]["rollout-0"] == pytest.approx(row["bubble_ratio"]["rollout"], abs=1e-9)
    assert row["bubble_per_actor"]["trainer-0"] == pytest.approx(row["bubble_ratio"]["trainer"], abs=1e-9)
    cal = report["calibration"]
    cost = MeasuredCost.from_calibration(cal)  # what `plan --costs` reads: complete
    spans: dict[str, list[float]] = {}
    one_trainer: list[float] = []  # optim spans of the runs with one trainer (the pair's include its all-reduce)
    for run in ("real-async1", "real-async1@0r2t", "real-async1-fine"):
        events = json.loads((tmp_path / run / "trace.json").read_text())["traceEvents"]
        for e in events:
            if e.get("ph") == "X":
                spans.setdefault(e["cat"], []).append(e["dur"] / 1e6)
                if e["cat"] == "optim" and "@" not in run:
                    one_trainer.append(e["dur"] / 1e6)
    # one trainer: its optimizer step and publication are the median of the runs' optim / publish spans
    assert cost.fits["optim"][0] == pytest.approx(statistics.median(one_trainer), rel=1e-3)
    assert cost.fits["publish"][0] == pytest.approx(statistics.median(spans["publish"]), rel=1e-3)
    # the all-reduce moved the trainable set's gradients (fp32 LoRA here)
    _, params = build_model(load_config(DEFAULT_CONFIG, small))
    assert cal["allreduce"]["bytes"] == sum(p.numel() * p.element_size() for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert 0 < cal["allreduce"]["seconds_2"] == pytest.approx(cost.allreduce.seconds(2))
    # the per-token overhead: positive, and below a median compute token (it is the gap, not the work)
    assert 0 < cal["dispatch_s"] < statistics.median(spans["rollout"] + spans["train"])
    # the fine run had smaller tokens, so the fits see two sizes; the error the planner uses is the rows' worst
    assert cal["plan_error"] == pytest.approx(max(abs(r["sim_error_plan_costs"]) for r in report["rows"]))
    # the planner's tolerance: the plan costs' error on the ratio of the two splits, either way round
    for key, error in (("sim_error_plan_costs", "placement_error"), ("sim_error_held_out", "placement_error_held_out")):
        e1, e2 = (r[key] for r in report["rows"][:2])
        assert cal[error] == pytest.approx(max(abs((1 + e1) / (1 + e2) - 1), abs((1 + e2) / (1 + e1) - 1)))
    assert MeasuredCost.report_error(tmp_path / "bubbles.json") == cal["placement_error"]
    assert json.loads((tmp_path / "bubbles.json").read_text())["calibration"]["costs_version"] == 3


def _bench_rollout_tokens(fine: bool) -> list[Token]:
    """The rollout tokens the simulator issues for the bench's async1 run of the tiny config (``fine``: its
    fine-token calibration run), with the bench's own overrides."""
    from digenrl.config import load_config
    from digenrl.policy import trained_steps
    from digenrl.recipes.bench_real import DEFAULT_CONFIG, fine_overrides, sim_options
    from digenrl.schedule import make_schedule
    from digenrl.schedule.base import Workload
    from digenrl.sim.engine import simulate

    issued: list[Token] = []

    class Recording(MeasuredCost):
        def seconds(self, token: Token, device: Device) -> float:
            if token.kind is TokenKind.ROLLOUT and token.id >= 0:  # not the schedule's own speed probes
                issued.append(token)
            return super().seconds(token, device)

    cfg = load_config(DEFAULT_CONFIG)
    if fine:
        cfg = load_config(DEFAULT_CONFIG, fine_overrides(cfg))
    ro = cfg.rollout
    workload = Workload(4, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    cost = Recording({"rollout": (0.0, 3e-4), "reward": (0.0, 9e-4), "train": (0.0, 9e-4)})
    devices = [Device("rollout-0", Role.ROLLOUT), Device("trainer-0", Role.TRAINER)]
    simulate(make_schedule("async1", devices, workload, cost, **sim_options(cfg)), devices, workload, cost)
    return issued


def test_fit_recovers_the_per_step_term_from_the_bench_token_shapes() -> None:
    """Tokens priced 4 ms + 3 ms per step + 20 us per sample-step: the bench's default and fine runs
    together give the fit back those three; the default run alone (whole trajectories of one fragment
    size: steps and sample-steps in proportion) cannot tell the per-step term apart and says so."""
    fixed, step, per = 0.004, 0.003, 2e-5

    def priced(tokens: list[Token]) -> list[tuple[Token, float]]:
        return [(t, fixed + step * (t.step_end - t.step_start) + per * t.num_samples * (t.step_end - t.step_start))
                for t in tokens]

    default, fine = _bench_rollout_tokens(False), _bench_rollout_tokens(True)
    both = MeasuredCost.fit(priced(default + fine))
    assert both.fits["rollout"] == pytest.approx((fixed, per), rel=1e-6) and both.step_s == pytest.approx(step, rel=1e-6)
    assert both.notes == ()
    dev = Device("d", Role.ROLLOUT)
    assert both.seconds(_tok(TokenKind.ROLLOUT, 5, 2), dev) == pytest.approx(fixed + 2 * step + 10 * per)
    alone = MeasuredCost.fit(priced(default))
    assert alone.step_s == 0.0 and "per-step term is not identified" in alone.notes[0]
    (units,) = {t.num_samples * (t.step_end - t.step_start) for t in default}  # one size: per-unit mean
    assert alone.fits["rollout"] == pytest.approx((0.0, (fixed + 3 * step + per * units) / units))


def test_fit_keeps_every_term_non_negative() -> None:
    """Noise that pulls the unconstrained per-step term below zero: the fit drops it (least squares of
    the rest), as non-negative least squares does."""
    # seconds = 0.01 + 1e-3 x sample-steps, the 1-step tokens a little slow, the 3-step ones a little fast
    shapes = [(32, 1, +0.002), (32, 3, -0.002), (128, 3, 0.0), (64, 1, +0.002)]
    data = [(_tok(TokenKind.ROLLOUT, n, k), 0.01 + 1e-3 * n * k + e) for n, k, e in shapes]
    cost = MeasuredCost.fit(data)
    assert cost.step_s == 0.0
    # by hand: least squares of seconds on (1, sample-steps) over the four tokens
    xs, ys = [n * k for n, k, _ in shapes], [s for _, s in data]
    mx, my = sum(xs) / 4, sum(ys) / 4
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert cost.fits["rollout"] == pytest.approx((my - slope * mx, slope))


def test_held_out_costs_never_see_the_row_they_predict() -> None:
    """Each actor row's held-out costs are the plan costs of the other rows' tokens: a row whose own tokens
    ran 3x slow does not move its own held-out fit (it does move the others'), and the fine row, the only
    one whose tokens vary in size, gets none."""
    from digenrl.recipes.bench_real import _held_out_costs
    from digenrl.sim.measured import AllReduce

    def row(slow: float, samples: int) -> list[tuple[Token, float]]:
        return [(_tok(TokenKind.ROLLOUT, samples, k), slow * (0.002 + 1e-4 * samples * k)) for k in (1, 2, 3)] + [
            (_tok(TokenKind.REWARD, samples), slow * 1e-3 * samples),
            (_tok(TokenKind.TRAIN, rows=samples), slow * (0.01 + 2e-3 * samples)),
            (_tok(TokenKind.OPTIM), slow * 0.006), (_tok(TokenKind.PUBLISH), slow * 0.008)]

    # one run per row, no contention measured: the tokens' seconds are taken as they are
    alone = {"tag": [(row(1.0, 64), [])], "async1": [(row(3.0, 64), [])], "async1-fine": [(row(1.0, 16), [])]}
    overheads = {"tag": [0.001], "async1": [0.003], "async1-fine": [0.002]}
    net = AllReduce(1e6, 1e9, 1e-4)
    held = _held_out_costs(alone, overheads, net, None)
    assert set(held) == {"tag", "async1"}
    # async1's held-out fit is the two unslowed rows': the prices they were made from, exactly
    fits = held["async1"].fits
    assert fits["rollout"] == pytest.approx((0.002, 1e-4), abs=1e-12) and held["async1"].step_s == pytest.approx(0.0)
    assert fits["train"] == pytest.approx((0.01, 2e-3), abs=1e-12) and fits["reward"] == pytest.approx((0.0, 1e-3), abs=1e-12)
    assert fits["optim"][0] == pytest.approx(0.006) and fits["publish"][0] == pytest.approx(0.008)
    assert held["async1"].dispatch_s == pytest.approx(0.0015)
    # the slow row is in tag's held-out fit, so tag is priced higher than async1 is
    assert held["tag"].fits["train"][1] > held["async1"].fits["train"][1] * 1.5
    assert _held_out_costs({"tag": alone["tag"], "async1": alone["async1"]}, overheads, net, None) == {}


def test_a_row_without_an_error_leaves_the_largest_error_to_the_others() -> None:
    """A row that completed no steady sample has no relative error (None): the report's plan_error and
    held_out_error are the largest of the others' (the report used to stop there with a TypeError)."""
    from digenrl.recipes.bench_real import largest_error, placement_error

    rows = [{"sim_error_plan_costs": -0.08, "placement_row": True}, {"sim_error_plan_costs": None, "placement_row": True},
            {"sim_error_plan_costs": 0.03, "placement_row": True}, {"scenario": "real-colocated"}]
    assert largest_error(rows, "sim_error_plan_costs") == 0.08
    assert largest_error(rows, "sim_error_held_out") is None
    assert placement_error(rows) == pytest.approx(abs(1.03 / 0.92 - 1))
