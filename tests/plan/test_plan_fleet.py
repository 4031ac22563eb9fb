"""`digenrl plan --fleet`: the split search, user scenarios, and that every placement fits memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.plan._split_search import placed_config
from digenrl.plan.fleet import config_profile, plan_fleet
from digenrl.plan.memory import check_memory, traces_for
from digenrl.sim.user import fleet_pools, load_scenario
from digenrl_cli.main import app

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_fleet_strings_parse_and_bad_ones_are_named() -> None:
    pools = fleet_pools("8xH800+16xl40s")
    assert [(p.device, p.count) for p in pools] == [("H800", 8), ("L40S", 16)]
    with pytest.raises(ConfigError, match="--fleet '8H800'"):
        fleet_pools("8H800")
    with pytest.raises(ConfigError, match="unknown device 'B300'"):
        fleet_pools("8xB300")


def test_user_scenario_runs_in_bench_bubbles(tmp_path: Path) -> None:
    from digenrl.sim.bench import run_bubbles

    file = tmp_path / "mine.toml"
    file.write_text('model = "flux"\nprompts = 8\ngroup_size = 4\nnum_steps = 8\ntrained_steps = 3\n'
                    'rollout_pool = "L40S"\n[[pools]]\ndevice = "H800"\ncount = 2\nroles = ["trainer"]\n'
                    '[[pools]]\ndevice = "L40S"\ncount = 4\nroles = ["rollout"]\n')
    user = load_scenario(file)
    assert user.scenario.pools == (("H800", 2), ("L40S", 4)) and user.pools[1].roles == ("rollout",)
    report = run_bubbles([str(file)], ["async1"], 4)
    (row,) = report.rows
    assert row["split"]["rollout"] == 4 and row["split"]["trainer"] == 2 and row["samples_per_s"] > 0
    file.write_text(file.read_text().replace("count = 4", "count = 4\nspeed = 2"))
    with pytest.raises(ConfigError, match=r"pools\[1\]\.speed: unknown key"):
        load_scenario(file)


def _assert_fits(cfg, cand) -> None:
    check_memory(placed_config(cfg, cand.rollout, cand.trainer, cand.tag_steps, cand.fragment_groups, cand.rows_per_pass,
                               cand.train_pack, cand.schedule))  # (colocated-tsp: every device samples and trains)


@pytest.mark.slow  # ~90 s on 2 cores (the colocated-tsp candidate adds an exact memory check)
def test_planner_never_returns_a_placement_that_does_not_fit() -> None:
    # Qwen-Image: an RTX 4090 (24 GB) cannot hold even its weights (41 GB); the H800s hold both roles
    cfg = load_config(CONFIGS / "qwenimage.toml")
    result = plan_fleet(cfg, fleet_pools("6xH800+2xRTX4090"), top=10, batches=4)
    assert any("RTX4090" in u for u in result.unused)
    for cand in result.candidates:
        assert "RTX4090" not in cand.rollout and "RTX4090" not in cand.trainer
        _assert_fits(cfg, cand)
        assert all(m["gb"] <= m["capacity_gb"] - 2 for m in cand.memory.values())


def test_two_device_case_has_the_known_best_split() -> None:
    """1 H800 + 1 L40S, FLUX LoRA: which device generates and which trains.

    Every assignment is simulated here directly (its own devices and cost model on the config's profile,
    outside the planner, over the planner's final run of 8 batches); the planner's choice must be the best of
    them. By hand: a batch's training work (3 trained steps x 4 passes) outweighs its rollout work (16 steps,
    one pass), and the H800 has 2.7x the L40S's FLOP/s, so the H800 trains and the L40S generates.
    """
    from digenrl.policy import trained_steps
    from digenrl.schedule import make_schedule
    from digenrl.schedule.base import Device, Role, Workload
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.cost import CostModel
    from digenrl.sim.devices import device_spec
    from digenrl.sim.engine import simulate
    from digenrl.telemetry.stats import summarize

    cfg = load_config(CONFIGS / "flux.toml", ["rollout.prompts_per_batch=4"])
    result = plan_fleet(cfg, fleet_pools("1xH800+1xL40S"), top=10, batches=4, final_batches=8)
    best = result.best
    _assert_fits(cfg, best)

    ro = cfg.rollout
    workload = Workload(8, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    prof = config_profile(cfg, traces_for(cfg, linear=True))  # flux.toml: 512^2, LoRA r32
    assert (prof.name, prof.shape.latent_height, prof.full_finetune) == ("FLUX.1-12B", 64, False)
    measured = {}
    for roll_type, train_type in (("L40S", "H800"), ("H800", "L40S")):
        specs = {"r": device_spec(roll_type), "t": device_spec(train_type)}
        roles = {"r": Role.ROLLOUT, "t": Role.TRAINER}
        devices = [Device(n, roles[n], specs[n].peak_bf16_flops / device_spec("H800").peak_bf16_flops) for n in specs]
        cost = CostModel(prof, specs, calibrated_params(), roles)
        sched = make_schedule("async1", devices, workload, cost, tag_steps=best.tag_steps,
                              fragment_groups=best.fragment_groups, train_pack=best.train_pack)
        measured[(roll_type, train_type)] = summarize(simulate(sched, devices, workload, cost)).steady.samples_per_s
    assert measured[("L40S", "H800")] > measured[("H800", "L40S")]
    assert best.rollout == {"L40S": 1} and best.trainer == {"H800": 1}
    assert best.samples_per_s == pytest.approx(measured[("L40S", "H800")], rel=1e-9)


def test_split_search_stops_at_a_split_that_does_not_fit() -> None:
    """Full fine-tuning of Qwen-Image (20B) on 8 H800: FSDP trainers need 6 devices for weights, grads and
    Adam states, and a 40-step rollout is the bottleneck, so the best split sits right next to splits that
    do not fit. The search must step over them (it once asked for them forever) and not place 0 rollout
    devices: FSDP trainers do not generate."""
    cfg = load_config(CONFIGS / "qwenimage.toml", ["model.finetune=full", "train.shard=fsdp", "rollout.num_steps=40"])
    result = plan_fleet(cfg, fleet_pools("8xH800"), top=3, batches=4, final_batches=6)
    assert result.best.rollout == {"H800": 2} and result.best.trainer == {"H800": 6}
    for cand in result.candidates:
        _assert_fits(cfg, cand)
    with pytest.raises(ConfigError, match="memory: the trainer role"):
        check_memory(placed_config(cfg, {"H800": 3}, {"H800": 5}, 1, 1, 1))
    # priced as the coordinator runs FSDP trainers: they do not generate (TAG off), so no helper tokens
    from digenrl.policy import trained_steps
    from digenrl.schedule import make_schedule
    from digenrl.schedule.base import Device, Role, Workload
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.cost import CostModel
    from digenrl.sim.devices import device_spec
    from digenrl.sim.engine import simulate
    from digenrl.telemetry.stats import summarize

    ro, best = cfg.rollout, result.best
    workload = Workload(6, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    roles = {f"h800-{i}": Role.ROLLOUT if i < 2 else Role.TRAINER for i in range(8)}
    devices = [Device(n, r) for n, r in roles.items()]
    prof = config_profile(cfg, traces_for(cfg, linear=True))  # full fine-tune: the whole transformer trains
    assert prof.full_finetune and prof.shape.text_tokens == 512
    cost = CostModel(prof, {n: device_spec("H800") for n in roles}, calibrated_params(), roles)
    sched = make_schedule("async1", devices, workload, cost, tag=False, tag_steps=best.tag_steps,
                          fragment_groups=best.fragment_groups)
    res = simulate(sched, devices, workload, cost)
    assert not any(s.helper for s in res.spans)
    assert best.samples_per_s == pytest.approx(summarize(res).steady.samples_per_s, rel=1e-9)


def test_plan_fleet_writes_a_runnable_config(tmp_path: Path) -> None:
    out = tmp_path / "planned.toml"
    res = CliRunner().invoke(app, ["plan", str(CONFIGS / "flux.toml"), "--fleet", "4xH800", "--batches", "4",
                                   "--write", str(out)])
    assert res.exit_code == 0, res.output
    assert "samples/s" in res.output and "simulations" in res.output
    # what priced the prediction, in the output and the written config's header
    assert ("costs: fitted veRL-Omni utilisations (rollout MFU 0.379, train 0.162) on the FLUX.1-12B profile"
            in res.output)
    assert "# costs: fitted veRL-Omni utilisations" in out.read_text()
    written = load_config(out)
    assert written.placement.rollout + written.placement.trainer == 4 and written.placement.gpu == "H800"
    if written.schedule.name == "colocated-tsp":  # no split predicted faster: every device samples and trains
        assert written.placement.rollout == 0
    else:
        assert written.schedule.tag_steps >= 1
    assert written.train.rows_per_pass >= 1
    check_memory(written)
    # the rest of the config is kept as it was
    source = load_config(CONFIGS / "flux.toml")
    assert replace(written.rollout) == source.rollout and written.reward == source.reward


def test_bench_bubbles_runs_the_planned_split(tmp_path: Path) -> None:
    """`bench bubbles --plan`: the planned schedule's row runs the planner's split and token sizes, so its
    samples/s is the planner's own prediction. The file's fixed split makes the H800s generate; the planner
    gives generation to the slower L40S and training to the H800s, and that row is faster."""
    from digenrl.plan.fleet import plan_scenario
    from digenrl.sim.bench import run_bubbles

    file = tmp_path / "mixed.toml"
    file.write_text('model = "flux"\nprompts = 4\ngroup_size = 4\nnum_steps = 8\ntrained_steps = 3\n'
                    'rollout_pool = "H800"\n[[pools]]\ndevice = "H800"\ncount = 2\n'
                    '[[pools]]\ndevice = "L40S"\ncount = 2\n')
    user = load_scenario(file)
    split, result = plan_scenario(user.scenario, user.pools, final_batches=6)
    assert split.rollout == (("L40S", 2),) and split.schedule == "async1"
    (fixed,) = run_bubbles([str(file)], ["async1"], 6, decomposition=False).rows
    (planned,) = run_bubbles([str(file)], ["async1"], 6, decomposition=False,
                             planned={user.scenario.name: split}).rows
    assert not fixed["planned"] and planned["planned"]
    assert fixed["bubble_by_pool"]["H800"] == pytest.approx(fixed["bubble_ratio"]["rollout"])  # H800s generate
    assert planned["bubble_by_pool"]["L40S"] == pytest.approx(planned["bubble_ratio"]["rollout"])  # L40S do
    assert planned["samples_per_s"] == pytest.approx(result.best.samples_per_s, rel=1e-9)
    assert planned["bubble_by_pool"] == pytest.approx(result.best.bubble_by_pool, rel=1e-9)  # what plan prints
    assert planned["samples_per_s"] > fixed["samples_per_s"]


def test_measured_costs_plan_the_machine_they_were_measured_on(tmp_path: Path) -> None:
    import json

    from digenrl.policy import trained_steps
    from digenrl.sim.measured import AllReduce, MeasuredCost

    per_unit = {"rollout": 3e-4, "reward": 9e-4, "train": 9e-4}
    report = tmp_path / "bubbles.json"
    fits = {k: (0.0, v) for k, v in per_unit.items()} | {"optim": (0.0, 0.0), "publish": (0.0, 0.0)}
    report.write_text(json.dumps({"calibration": MeasuredCost(fits, 0.0, AllReduce(0.0, 1.0, 0.0)).to_calibration()}))
    cost = MeasuredCost.from_report(report)
    cfg = load_config(CONFIGS / "tiny-qwenimage.toml")
    result = plan_fleet(cfg, fleet_pools("2xmeasured"), batches=4, final_batches=8, measured=cost)
    best = result.best
    assert result.cost_source.startswith(f"measured: {report} (") and result.profile is None
    assert result.to_json()["cost_source"] == result.cost_source
    # two devices can at best spend all their seconds on work: samples/s <= 2 / (seconds of work per sample)
    per_sample = (per_unit["rollout"] * cfg.rollout.num_steps + per_unit["reward"]
                  + per_unit["train"] * trained_steps(cfg))
    assert 0.8 * 2 / per_sample <= best.samples_per_s <= 2 / per_sample * 1.001
    with pytest.raises(ConfigError, match="one device type"):
        plan_fleet(cfg, fleet_pools("1xmeasured+1xH800"), batches=4, measured=cost)
    with pytest.raises(ConfigError, match=r"nope\.json: no such file; .*bench bubbles --real"):
        MeasuredCost.from_report(tmp_path / "nope.json")
    report.write_text('{"rows": []}')
    with pytest.raises(ConfigError, match="not a `digenrl bench bubbles --real` report"):
        MeasuredCost.from_report(report)
