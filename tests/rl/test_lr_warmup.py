"""``train.lr_warmup``: the colocated loop's first optimizer steps are scaled down by the ramp.

AdamW's first update is ``-lr * (wd * p + g / (|g| + eps))`` per weight: linear in the rate and
independent of the gradient's scale, so a warm-up of 4 must move every weight exactly a quarter as far
at step 0 as no warm-up does (the actor trainer's step is checked against this loop in
tests/roles/test_roles.py, whose config warms up too).
"""

from __future__ import annotations

import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.errors import ConfigError
from digenrl.rl.lr import lr_at

CONF = {
    "model": {"name": "qwenimage", "preset": "tiny"},
    "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 4},
    "train": {"iterations": 2, "lr": 1e-2, "clip_range": 1e-2, "adv_std": "group"},
    "log": {"seed": 3},
    "schedule": {"name": "colocated"},
    "placement": {"threads": 1},
}


def _first_step(warmup: int) -> tuple[list[torch.Tensor], float]:
    from digenrl.recipes.colocated import iteration, setup

    cfg = config_from_dict({**CONF, "train": {**CONF["train"], "lr_warmup": warmup}})
    torch.manual_seed(cfg.log.seed)
    run = setup(cfg)
    before = [p.detach().clone() for p in run.params]
    iteration(run, 0)
    return [p.detach() - b for p, b in zip(run.params, before, strict=True)], run.optimizer.param_groups[0]["lr"]


def test_warmup_scales_the_first_step_by_its_ramp() -> None:
    plain, lr_plain = _first_step(0)
    warm, lr_warm = _first_step(4)
    assert (lr_plain, lr_warm) == (1e-2, pytest.approx(1e-2 / 4))
    moved = [d for d in plain if d.abs().max() > 0]
    assert moved, "the first step moved nothing"
    for d_warm, d_plain in zip(warm, plain, strict=True):
        # atol: fp32 rounding of (p + d) - p; the steps themselves are ~lr / 4 = 2.5e-3
        torch.testing.assert_close(d_warm, d_plain / 4, rtol=1e-4, atol=1e-7)


def test_the_ramp_reaches_lr_and_stays() -> None:
    assert [lr_at(1.0, 4, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(3e-3, 0, 0) == 3e-3
    with pytest.raises(ConfigError, match="train.lr_warmup: must be >= 0"):
        config_from_dict({**CONF, "train": {**CONF["train"], "lr_warmup": -1}})
