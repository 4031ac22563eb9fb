"""MixGRPO in the simulator: a rollout token pays for the forwards its version's window runs (Flash's tail is
shorter the earlier the window), so the rollout's cost moves over the run; `digenrl bench bubbles` prints both
MixGRPO scenarios."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from digenrl.schedule.base import Device, Role, Token, TokenKind
from digenrl.sim.bench import simulate_pair
from digenrl.sim.calibration import calibrated_params
from digenrl.sim.cost import CostModel
from digenrl.sim.devices import device_spec
from digenrl.sim.profiles import profile
from digenrl.sim.scenarios import scenario
from digenrl.sim.window import SlidingWindow
from digenrl_cli.main import app

FLASH = SlidingWindow(25, 4, 1, 0.4)


def _seconds(window: SlidingWindow | None, version: int, start: int = 0, stop: int = 25) -> float:
    prof = replace(profile("flux"), window=window)
    cost = CostModel(prof, {"d": device_spec("H800")}, calibrated_params(), {"d": Role.ROLLOUT})
    return cost.seconds(Token(0, TokenKind.ROLLOUT, "d", version, num_samples=12, step_start=start, step_end=stop,
                              policy_version=version), Device("d", Role.ROLLOUT))


def test_a_rollout_token_pays_for_its_versions_forwards() -> None:
    full = _seconds(None, 0)
    assert _seconds(SlidingWindow(25, 4, 1), 7) == full  # MixGRPO: ODE or SDE, every step is a forward
    assert [FLASH.forwards(v) for v in (0, 10, 19)] == [11, 17, 24]
    for v in (0, 10, 19):
        assert _seconds(FLASH, v) == pytest.approx(full * FLASH.forwards(v) / 25)
    assert _seconds(FLASH, 0, 11, 25) == 0.0  # past the tail's last step nothing runs
    assert _seconds(FLASH, 0, 8, 14) == pytest.approx(full * 3 / 25)


def test_the_simulated_flash_rollout_costs_more_as_the_window_moves() -> None:
    sc = scenario("flux-mixflash-32")
    res = simulate_pair(sc, "colocated", 20)
    busy = [sum(s.end - s.start for s in res.spans if s.kind == "rollout" and s.batch == b) for b in range(20)]
    assert busy == sorted(busy) and busy[19] / busy[0] == pytest.approx(24 / 11, rel=0.03)  # + text encoding
    plain = simulate_pair(scenario("flux-mixgrpo-32"), "colocated", 20)
    assert plain.wall > res.wall


def test_bench_bubbles_prints_the_mixgrpo_rows() -> None:
    res = CliRunner().invoke(app, ["bench", "bubbles", "--scenario", "flux-mixflash-32", "--scenario", "flux-mixgrpo-32",
                                   "--schedule", "colocated", "--schedule", "async1", "--no-decomposition"])
    assert res.exit_code == 0, res.output
    assert "flux-mixf" in res.output and "11..24 rollout forwards" in " ".join(res.output.split())
