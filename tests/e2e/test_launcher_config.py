"""`[cluster]` and the per-role Ray resources: validated at load time, turned into placement bundles, and the
`digenrl run --launcher/--ray-address` flags. None of this needs Ray installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.config import check_runnable, load_config
from digenrl.errors import ConfigError
from digenrl.recipes.disaggregated import actor_plan
from digenrl.recipes.ray_launcher import _import_ray, plan_bundles
from digenrl.schedule.base import Role

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.launcher=slurm"], r"cluster.launcher: 'slurm' is not allowed; allowed: 'local', 'ray'"),
    (["cluster.strategy=TIGHT"], r"cluster.strategy: 'TIGHT' is not allowed; allowed: 'PACK', 'SPREAD'"),
    (["placement.rollout_resources={accelerator_type='L40S'}"],
     r"placement.rollout_resources asks Ray for resources; it needs cluster.launcher = 'ray'"),
    (["cluster.launcher=ray", "placement.trainer_resources={accelerator_type=3}"],
     r"placement.trainer_resources.accelerator_type: must be an accelerator type name such as 'H100'"),
    (["cluster.launcher=ray", "placement.trainer_resources={accelerator_type='H 100'}"],
     r"placement.trainer_resources.accelerator_type: must be an accelerator type name"),
    (["cluster.launcher=ray", "placement.rollout_resources={pool=-1}"],
     r"placement.rollout_resources.pool: must be > 0, got -1.0"),
    (["cluster.launcher=ray", "placement.rollout_resources={pool='big'}"],
     r"placement.rollout_resources.pool: must be a number \(a resource amount\); only accelerator_type takes a name"),
    (["cluster.launcher=ray", "placement.rollout_resources={GPU=1}"],
     r"placement.rollout_resources.GPU: must be num_cpus, num_gpus, accelerator_type or a custom resource name"),
    (["cluster.launcher=ray", "schedule.name=colocated"], r"schedule.name = 'colocated' runs one process"),
    (["cluster.launcher=ray", "transport.actors=inproc"], r"it needs transport.actors = 'zmq'"),
    (["cluster.launcher=ray", "placement.workers=2", "transport.address=tcp://127.0.0.1:0"],
     r"placement.workers = 2: the Ray launcher starts one worker per actor itself"),
])
def test_bad_cluster_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_a_bundle_per_actor_with_its_role_resources() -> None:
    cfg = load_config(TINY, ["cluster.launcher=ray", "placement.rollout=2", "placement.reward=1",
                             "placement.rollout_resources={accelerator_type='L40S', num_cpus=4}",
                             "placement.trainer_resources={accelerator_type='H100', nvlink_pool=1}"])
    bundles = plan_bundles(cfg, [(n, role, cls) for n, role, cls, _ in actor_plan(cfg)])
    assert [(b.actor, b.role) for b in bundles] == [("trainer-0", Role.TRAINER), ("rollout-0", Role.ROLLOUT),
                                                   ("rollout-1", Role.ROLLOUT), ("reward-0", Role.REWARD)]
    assert bundles[0].resources == {"CPU": 1.0, "accelerator_type:H100": 0.001, "nvlink_pool": 1.0}
    assert bundles[1].resources == bundles[2].resources == bundles[3].resources == {
        "CPU": 4.0, "accelerator_type:L40S": 0.001}
    # GPU-bound roles: one GPU per bundle (model.device cuda), whatever this machine has; with
    # placement.actors_per_gpu = 2 (the tiny config's) half a GPU each, which Ray packs onto one device.
    gpu = load_config(TINY, ["cluster.launcher=ray", "model.device=cuda", "placement.actors_per_gpu=1"])
    assert [b.resources for b in plan_bundles(gpu, [(n, r, c) for n, r, c, _ in actor_plan(gpu)])] == [
        {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    shared = load_config(TINY, ["cluster.launcher=ray", "model.device=cuda"])
    assert [b.resources for b in plan_bundles(shared, [(n, r, c) for n, r, c, _ in actor_plan(shared)])] == [
        {"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]


def test_usage_stats_are_off_unless_the_user_set_them_and_a_missing_ray_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the [ray] extra were not installed
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    with pytest.raises(ConfigError, match=r"cluster.launcher = 'ray' needs Ray, which is not installed; install it "
                                          r"with `pip install 'digenrl\[ray\]'`"):
        _import_ray()
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    with pytest.raises(ConfigError):
        _import_ray()
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1"


def test_run_flags_set_the_cluster_table() -> None:
    from digenrl_cli.main import app

    # --ray-address alone means the Ray launcher; the config check then refuses the colocated loop.
    res = CliRunner().invoke(app, ["run", str(TINY), "--ray-address", "127.0.0.1:6379",
                                   "--set", "schedule.name=colocated"])
    assert res.exit_code == 2 and "cluster.launcher = 'ray' places actor processes" in res.output
    res = CliRunner().invoke(app, ["run", str(TINY), "--launcher", "kubernetes"])
    assert res.exit_code == 2 and "cluster.launcher: 'kubernetes' is not allowed" in res.output


def test_a_placed_run_needs_no_gpu_in_the_driver() -> None:
    """The coordinator runs in the driver; with --launcher ray the GPUs are the Ray nodes' (CPU-only head node)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the driver of a CPU-only host")
    with pytest.raises(ConfigError, match="model.device = 'cuda', but this machine has no CUDA device"):
        check_runnable(load_config(TINY, ["model.device=cuda"]))
    check_runnable(load_config(TINY, ["model.device=cuda", "cluster.launcher=ray"]))
