"""The learning rate of each optimizer step: a linear warm-up, then constant.

Adam's first steps are its largest relative to the signal (the second-moment estimate is young), and on
a pretrained model an undirected step costs reward (the shuffled-advantage control of
``bench/learning.py`` lost all of its -0.02 in its first 10 iterations). ``train.lr_warmup`` ramps the
rate over that many optimizer steps. It is a function of the step count alone, which both training paths
know (the colocated iteration, the trainer's weight version), so a resumed run continues the ramp where
the uninterrupted one would be. Measured there over 3 seeds with 10 warm-up steps, it did not remove
that loss (-0.002 / -0.014 / -0.018 vs -0.006 / -0.011 / -0.018 without), hence off by default.
"""

from __future__ import annotations

import torch

__all__ = ["lr_at", "set_lr"]


def lr_at(lr: float, warmup: int, step: int) -> float:
    """The rate of optimizer step ``step`` (0-based): ``lr * (step + 1) / warmup`` up to ``lr``."""
    if warmup <= 0:
        return lr
    return lr * min(1.0, (step + 1) / warmup)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, warmup: int, step: int) -> None:
    """Set every parameter group of ``optimizer`` to :func:`lr_at` before step ``step``."""
    rate = lr_at(lr, warmup, step)
    for group in optimizer.param_groups:
        group["lr"] = rate
