"""Ulysses sequence parallelism in the cost model: all-to-all seconds against the hand formula, padding, where it
pays, an SP group's tokens priced by the cost model, and the long-video scenario."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from digenrl.schedule.base import Device, Fragment, Role, Token, TokenKind
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import CostModel
from digenrl.sim.devices import device_spec
from digenrl.sim.flops import SampleShape
from digenrl.sim.profiles import profile
from digenrl.sim.sequence import PASS_OVERHEAD_S, ulysses_cost

H100 = device_spec("H100")
WAN_LONG = replace(profile("wan", "14B"), shape=SampleShape.from_pixels(81, 480, 832, 512))  # 21 x 30 x 52 tokens
WAN_FRAME = replace(profile("wan", "14B"), shape=SampleShape.from_pixels(1, 480, 832, 512))  # 30 x 52 = 1560


def test_all_to_all_seconds_follow_the_hand_formula() -> None:
    cost = ulysses_cost(WAN_LONG, 4, H100.intra_node_bytes_per_s, 10e-6)
    assert cost.geometry.tokens == 21 * 30 * 52 == 32760 and cost.geometry.layers == 40
    # 40 self-attentions x 4 all-to-alls; each rank sends 3/4 of its [2 rows, 8190 tokens, 40 x 128] bf16 shard
    per = 2 * 8190 * 5120 * 2 * 3 / 4 / 450e9 + 10e-6
    assert cost.all_to_all_seconds(rows=2, passes=1) == pytest.approx(160 * per, rel=1e-12)
    # a trained row's 4 forward-equivalents (forward, recompute, backward = 2): 16 all-to-alls a layer
    assert cost.all_to_all_seconds(rows=2, passes=4) == pytest.approx(640 * per, rel=1e-12)
    assert cost.overhead_seconds(1) == pytest.approx(2 * PASS_OVERHEAD_S)
    assert ulysses_cost(WAN_LONG, 1, 450e9, 10e-6).seconds(3.0, 2) == 3.0


def test_padding_of_heads_and_sequence() -> None:
    small = replace(profile("wan", "1.3B"), shape=SampleShape.from_pixels(1, 480, 832, 512))  # 12 heads, 1560 tokens
    cost = ulysses_cost(small, 8, 450e9, 10e-6)
    assert (cost.padded_heads, cost.padded_tokens) == (16, 1560)
    g = cost.geometry
    want = ((g.forward_flops - g.attention_flops) + g.attention_flops * 16 / 12) / (8 * g.forward_flops)
    assert cost.compute_factor == pytest.approx(want)
    odd = ulysses_cost(WAN_LONG, 7, 450e9, 10e-6)  # 40 heads -> 42; 32760 tokens divide by 7
    assert odd.padded_heads == 42 and odd.padded_tokens == 32760
    assert ulysses_cost(WAN_LONG, 16, 450e9, 0).padded_tokens == math.ceil(32760 / 16) * 16


def _one_forward(prof) -> float:  # noqa: ANN001 - a profile
    return 2 * prof.forward_flops / (H100.peak_bf16_flops * calibrated_params().mfu_rollout)  # 2 CFG rows


def test_sp_pays_on_long_video_and_not_on_one_frame() -> None:
    lat = calibrated_params().collective_latency_s
    long = {k: ulysses_cost(WAN_LONG, k, H100.intra_node_bytes_per_s, lat).speedup(_one_forward(WAN_LONG), 2)
            for k in (2, 4, 8)}
    short = {k: ulysses_cost(WAN_FRAME, k, H100.intra_node_bytes_per_s, lat).speedup(_one_forward(WAN_FRAME), 2)
             for k in (2, 4, 8)}
    assert long[2] > 1.9 and long[4] > 3.6 and long[8] > 6.5  # each device >= 80% busy
    # one 480x832 frame: the group's devices sit idle a quarter to four fifths of the time, and 8 are no faster than 4
    assert short[2] / 2 < 0.75 and short[4] / 4 < 0.45 and short[8] / 8 < 0.2 and short[8] < short[4] < 2.0


def test_cost_model_prices_an_sp_group() -> None:
    params = calibrated_params()
    names = {"g": Role.ROLLOUT, "t": Role.TRAINER}
    plain = CostModel(WAN_LONG, {n: H100 for n in names}, params, names)
    grouped = CostModel(WAN_LONG, {n: H100 for n in names}, params, names, sp={"g": 2, "t": 2})
    frag = Fragment(0, 0, 0, 1, 0, 2, 8)  # 2 samples of one prompt
    token = Token(1, TokenKind.ROLLOUT, "g", 0, 0, num_samples=2, step_start=1, step_end=4, fragments=(frag,))
    one, two = plain.seconds(token, Device("g", Role.ROLLOUT)), grouped.seconds(token, Device("g", Role.ROLLOUT))
    u = grouped.ulysses("g")
    compute = one - 3 * params.pass_latency_s
    assert two == pytest.approx(compute * u.compute_factor + u.all_to_all_seconds(4, 3) + u.overhead_seconds(3)
                                + 3 * params.pass_latency_s, rel=1e-9)
    assert 1.9 < one / two < 2.0
    # the gradient all-reduce runs over both ranks of a single SP trainer
    assert plain.allreduce_seconds(("t",)) == 0.0 and grouped.allreduce_seconds(("t",)) > 0.0


def test_long_video_scenario_runs_beside_the_peers_at_their_sp() -> None:
    from digenrl.sim.bench import run_bubbles

    report = run_bubbles(["wan-long-16"], ["async1", "unirl", "colocated-flowgrpo"], 3, decomposition=False)
    rows = {r["schedule"]: r for r in report.rows}
    assert rows["async1"]["sequence_parallel"] == [1, 2] and rows["colocated-flowgrpo"]["sequence_parallel"] == [1, 1]
    assert rows["async1"]["split"]["trainer"] >= 1 and all(r["samples_per_s"] > 0 for r in rows.values())
    assert rows["colocated-flowgrpo"]["split"]["hybrid"] == 16
    assert any("wan-long-16: sequence parallelism per run" in n and "UniRL" in n for n in report.notes)
