"""A second copy of the trained weights that follows them slowly: DiffusionNFT's old policy, AWM's EMA policy.

``theta_old <- d theta_old + (1 - d) theta`` after each optimizer step, ``d`` from the algorithm's schedule of
the steps taken. With LoRA the copy is a second set of adapter tensors; with full fine-tuning a second copy of
the transformer's weights (``digenrl plan`` counts it). Forwards under it swap it into the live parameters for
the block and copy the trained values back bit for bit, so gradients and the optimizer never see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from digenrl.models.lora import load_trainable_state_dict, trainable_state_dict

__all__ = ["PolicyCopy"]


class PolicyCopy:
    """The slow copy of ``model``'s trainable weights.

    Args:
        model: the trained generator (LoRA or full fine-tuning set up).
        decay: ``d(steps)``, the share of the copy kept after ``steps`` optimizer steps.
    """

    def __init__(self, model: Any, decay: Callable[[int], float]) -> None:
        self.model = model
        self.decay = decay
        self.state: dict[str, torch.Tensor] = trainable_state_dict(model)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the model computes with the copy's weights."""
        current = trainable_state_dict(self.model)
        load_trainable_state_dict(self.model, self.state)
        try:
            yield
        finally:
            load_trainable_state_dict(self.model, current)

    @torch.no_grad()
    def follow(self, steps: int) -> float:
        """Move the copy toward the trained weights after ``steps`` optimizer steps; returns the ``d`` used."""
        d = self.decay(steps)
        live = trainable_state_dict(self.model, copy_tensors=False)
        for k, old in self.state.items():
            old.mul_(d).add_(live[k].to(old.dtype), alpha=1.0 - d)
        return d

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the copy (a checkpoint's), checked against the model's trainable tensors.

        Raises:
            ValueError: keys or shapes differ (the message names them).
        """
        current = trainable_state_dict(self.model)
        load_trainable_state_dict(self.model, state)  # checks keys and shapes, places shards
        self.state = trainable_state_dict(self.model)
        load_trainable_state_dict(self.model, current)
