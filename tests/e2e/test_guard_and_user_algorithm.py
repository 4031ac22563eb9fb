"""GRPO-Guard and a user's algorithm file (examples/algorithms/reward_weighted.py) under every schedule.

The tiny Qwen-Image (random preset), 2 iterations, inproc actors unless a test needs processes. The user's file
is imported only where this process allowed it (its own config, digenrl/algorithms/user.py): a config that
arrives in a message, as an actor's does, never makes a process import a file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from digenrl.algorithms import algorithm_class
from digenrl.algorithms.user import allow_user_algorithm
from digenrl.config import Config, config_from_dict
from digenrl.errors import ConfigError
from digenrl.plan.rows import nograd_forwards, row_cost, slow_copies
from digenrl.policy import trained_steps
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.usercode import USER_CODE_ENV
from tests.e2e._tiny import every_schedule, tiny_config as _cfg

ROOT = Path(__file__).resolve().parents[2]
USER = f"{ROOT / 'examples' / 'algorithms' / 'reward_weighted.py'}:RewardWeighted"




async def _run(cfg: Config) -> list[dict]:
    if cfg.schedule.name == "colocated":
        return train(cfg, write_files=False)
    return await arun_disaggregated(cfg, None, write_files=False)


@pytest.mark.parametrize("schedule", every_schedule())
async def test_grpo_guard_trains_every_transition_under_every_schedule(schedule: str) -> None:
    history = await _run(_cfg("grpo_guard", schedule))
    rows = 2 * 2 * trained_steps(_cfg("grpo_guard", schedule))
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["rows_trained"] == rows and math.isfinite(m["policy_loss"]) and m["grad_norm"] > 0
        assert m["max_staleness"] <= (1 if schedule == "async1" else 0)
    on_policy = history if schedule != "async1" else history[:1]
    # the rollout's step means rebuilt from the seeded noise: an on-policy ratio is 1 to float rounding
    assert all(m["parity_rows"] > 0 and m["ratio_dev"] < 1e-6 for m in on_policy)


@pytest.mark.slow
async def test_grpo_guard_actors_train_what_the_colocated_loop_trains() -> None:
    """The trainer redraws each transition's noise from its sample's seed, whichever actor sampled it."""
    tables = {"rollout": {"prompts_per_batch": 3}, "train": {"iterations": 3}}
    colocated = await _run(_cfg("grpo_guard", "colocated", **tables))
    actors = await _run(_cfg("grpo_guard", "disaggregated", **tables))
    keys = ("reward_mean", "policy_loss", "grad_norm", "ratio_dev", "adv_abs_mean")
    for a, b in zip(colocated, actors, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4, abs=1e-7)
    # (on-policy the policy loss sums to ~0: the ratio is 1 and the advantages have zero mean; the gradient does not)
    assert colocated[0]["grad_norm"] > 0.0


@pytest.mark.parametrize("schedule", every_schedule())
async def test_a_user_algorithm_file_runs_under_every_schedule(schedule: str) -> None:
    allow_user_algorithm(USER)  # this test process's own config names it
    cfg = _cfg(USER, schedule)
    history = await _run(cfg)
    assert [m["step"] for m in history] == [0, 1]
    assert all(0 < m["rows_kept"] <= 2 * 2 * trained_steps(cfg) and m["grad_norm"] > 0 for m in history)
    assert all(m["max_staleness"] <= (1 if schedule == "async1" else 0) for m in history)


def test_the_planner_prices_both_from_the_algorithm_class() -> None:
    allow_user_algorithm(USER)
    guard, user = _cfg("grpo_guard", "async1"), _cfg(USER, "async1")
    assert (nograd_forwards(guard), slow_copies(guard)) == (0, 0)  # Flow-GRPO's cost: the ratio is arithmetic
    assert row_cost(guard) == row_cost(_cfg("flow_grpo", "async1"))
    assert (nograd_forwards(user), slow_copies(user)) == (1, 0)  # its pull to the reference: one no-grad forward
    assert row_cost(user) != row_cost(guard)  # clean samples cross, not transitions


def _in_a_fresh_process(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})


def test_a_process_imports_a_user_algorithm_only_where_its_own_start_allowed_it() -> None:
    """An actor's config arrives in a message (config_from_dict): the file is imported only if the process's
    launcher granted it (the environment a driver sets) or it loaded that config itself (load_config)."""
    code = ("from digenrl.config import config_from_dict, load_config\n"
            "from digenrl.algorithms import algorithm_class\n"
            "import sys\n"
            f"spec = {USER!r}\n"
            "cfg = config_from_dict({'train': {'algorithm': spec}})\n"
            "if sys.argv[-1] == 'load': load_config('configs/tiny-qwenimage.toml', [f'train.algorithm=\"{spec}\"'])\n"
            "print(algorithm_class(cfg.train.algorithm).__name__)\n")
    refused = _in_a_fresh_process(code, {})
    assert refused.returncode != 0
    assert "train.algorithm: this process was not started with" in refused.stderr
    assert "digenrl_user_algorithm" not in refused.stderr  # refused before the file was imported
    granted = _in_a_fresh_process(code, {USER_CODE_ENV: json.dumps([USER])})
    assert granted.returncode == 0 and granted.stdout.strip() == "RewardWeighted", granted.stderr
    other = _in_a_fresh_process(code, {USER_CODE_ENV: json.dumps([f"{USER.rpartition(':')[0]}:Other"])})
    assert other.returncode != 0  # a grant names one class of one file


def test_a_bad_user_algorithm_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.algorithm: 'mine:py' must be one of"):
        config_from_dict({"train": {"algorithm": "mine:py"}}).train  # noqa: B018
    not_algorithm = tmp_path / "not_algorithm.py"
    not_algorithm.write_text("class Mine:\n    pass\n")
    allow_user_algorithm(f"{not_algorithm}:Mine")
    with pytest.raises(ConfigError, match="train.algorithm: .*not a subclass of digenrl.algorithms.Algorithm"):
        algorithm_class(f"{not_algorithm}:Mine")
    allow_user_algorithm(f"{not_algorithm}:Missing")
    with pytest.raises(ConfigError, match="has no attribute 'Missing' \\(its classes: Mine\\)"):
        algorithm_class(f"{not_algorithm}:Missing")
