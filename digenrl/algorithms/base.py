"""The seam every training algorithm sits behind: what its rollout records, its rows, its loss, its extra state.

Schedules, the coordinator, transports and the simulator see samples, rows and tokens (a sample has
:func:`digenrl.policy.trained_steps` rows; row ``i * T + t`` is local sample ``i``'s ``t``-th), never an
algorithm's name. An :class:`Algorithm` is built once per process that trains or samples, beside its model:

* the rollout asks :attr:`coupled`: SDE transitions with their behaviour log-probs (Flow-GRPO), or a
  deterministic ODE (:attr:`solver`) that ships only the clean sample (DiffusionNFT, AWM);
* the trainer turns a fragment's stored tensors into a token's rows (:meth:`token_rows`), runs their
  forward/backward passes (:meth:`backward`), and after each optimizer step moves its extra weights
  (:meth:`after_step`); :meth:`sampling` is the context whose weights the rollout samples with (what the
  trainer publishes: :meth:`sampling_state`), and :meth:`extra_state` what a checkpoint must carry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from digenrl.config import Config
from digenrl.errors import ConfigError
from digenrl.models.experts import window_range
from digenrl.models.lora import trainable_state_dict
from digenrl.rl.loss import Sums
from digenrl.rl.steps import StepPlan, plan_steps
from digenrl.rl.tsp import packed_backward, per_step_backward, sliced_backward

__all__ = ["Algorithm", "Backward"]


class Backward:
    """How a token's rows are cut into forward/backward passes (:mod:`digenrl.rl.tsp`).

    Attributes:
        mode: ``"packed"`` (TSP passes of ``rows_per_pass``), ``"per_step"`` (one pass per grid step, the
            references' loop) or ``"sliced"`` (this FSDP rank's share, as many passes as every rank).
        rows_per_pass: rows per pass (None: all in one).
        rank, world: the FSDP rank and group size (``"sliced"``).
        experts: a mixture-of-experts model's row split.
        normalizer: the passes' loss is ``sum(rows) / normalizer``.
    """

    def __init__(self, mode: str = "packed", rows_per_pass: int | None = None, rank: int = 0, world: int = 1,
                 experts: Any = None, normalizer: float = 1.0) -> None:
        self.mode, self.rows_per_pass, self.rank, self.world = mode, rows_per_pass, rank, world
        self.experts, self.normalizer = experts, normalizer

    def run(self, velocity: Any, batch: Any, cond: dict[str, torch.Tensor], adv: torch.Tensor, loss_cfg: Any,
            **kw: Any) -> list[Sums]:
        """The passes over ``batch`` by the TSP driver of :attr:`mode` (``kw``: the drivers' ``ref_velocity``,
        ``parity``, ``backward``)."""
        common = dict(normalizer=self.normalizer, experts=self.experts, **kw)
        if self.mode == "sliced":
            return sliced_backward(velocity, batch, cond, adv, loss_cfg, rank=self.rank, world=self.world,
                                   rows_per_pass=self.rows_per_pass, **common)
        if self.mode == "per_step":
            return per_step_backward(velocity, batch, cond, adv, loss_cfg, **common)
        return packed_backward(velocity, batch, cond, adv, loss_cfg, rows_per_pass=self.rows_per_pass, **common)


class Algorithm:
    """One training algorithm's behaviour (subclasses in this package; :func:`digenrl.algorithms.algorithm_for`).

    Args:
        cfg: the run config.
        model: the generator this process holds (trained or frozen).
        trains: this process trains (it holds the algorithm's extra weights, e.g. an old policy).
    """

    name = ""
    coupled = True  # the rollout ships SDE transitions (True) or only clean samples (False)
    drops_zero_std = True  # a group whose rewards are all equal is left out of training

    def __init__(self, cfg: Config, model: Any, trains: bool = True) -> None:
        self.cfg, self.model, self.trains = cfg, model, trains
        self.sigmas = model.sigmas(cfg.rollout.num_steps)

    # -- what the planner prices (class-level: from the config alone) ---------------------------
    slow_copies = 0  # copies of the trained weights each trainer keeps beside them (an old / EMA policy)

    @classmethod
    def kl_weight(cls, cfg: Config) -> float:
        """The weight of the KL to the reference (its forward runs, and full fine-tuning keeps a frozen copy, when > 0)."""
        return 0.0

    @classmethod
    def nograd_forwards(cls, cfg: Config, stale: bool) -> int:
        """Velocity forwards without gradient beside each trained row's forward and backward; ``stale``: the
        schedule trains one-step-stale samples."""
        return int(cls.kl_weight(cfg) > 0)

    @classmethod
    def rollout_window(cls, cfg: Config) -> Any | None:
        """A sliding window whose rollout forwards move with the policy version (``digenrl.sim.window``), which the
        planner prices; None (default): every step of the grid runs a forward."""
        return None

    @property
    def solver(self) -> str:
        """The rollout's ODE solver (``rollout.solver``) of an uncoupled algorithm."""
        return self.cfg.rollout.solver

    # -- what a coupled rollout samples ----------------------------------------------------------
    def step_plan(self, groups: list[int], sample_ids: list[int], seed: int, version: int) -> StepPlan:
        """Which steps of samples drawn with policy ``version`` are SDE steps and which are trained (default:
        ``rollout.steps``); a pure function of its arguments, so every actor that runs or re-runs them agrees."""
        ro = self.cfg.rollout
        return plan_steps(ro.num_steps, groups, sample_ids, mode=ro.steps,  # type: ignore[arg-type]
                          window=ro.window, window_range=window_range(self.model, ro), fraction=ro.fraction, seed=seed)

    def ode_tail(self, version: int) -> tuple[int, torch.Tensor] | None:
        """Where the rollout of policy ``version`` leaves the run's grid: ``(step, grid)``, from ``step`` on the
        deterministic solver of :func:`digenrl.rl.flash.run_tail` on ``grid``; None (default): it never does."""
        return None

    # -- the weights the rollout samples with --------------------------------------------------
    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Within the block this process's model has the weights rollouts sample with (default: the trained ones)."""
        yield

    def sampling_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Those weights' tensors (what the trainer publishes); ``copy=False``: views where they are live tensors."""
        return trainable_state_dict(self.model, copy_tensors=copy)

    # -- training ---------------------------------------------------------------------------------
    def token_rows(self, trans: dict[str, torch.Tensor], rows: tuple[int, int], keep: torch.Tensor, batch: int,
                   sample_ids: list[int], version: int) -> Any | None:
        """The rows ``[s, e)`` of one fragment that ``keep`` (per local sample) keeps, on the host; None if none.

        Args:
            trans: the fragment's stored tensors (``FragmentData.transitions()``).
            rows: ``(s, e)``.
            keep: ``[n]`` bool per local sample.
            batch: the logical batch (it seeds the forward-process rows).
            sample_ids: the fragment's batch-level sample ids, in local order.
            version: the policy version that sampled the fragment.
        """
        raise NotImplementedError

    @staticmethod
    def cat_rows(parts: list[Any], offsets: list[int]) -> Any:
        """Concatenate :meth:`token_rows` results, shifting sample indices by ``offsets``."""
        return type(parts[0]).cat(parts, offsets)

    def backward(self, batch: Any, cond: dict[str, torch.Tensor], adv: torch.Tensor, plan: Backward, *,
                 version: int) -> list[Sums]:
        """Forward/backward over ``batch`` (on the model's device); gradients accumulate. ``version`` is the
        trainer's: rows sampled by it are on-policy. Returns per-pass diagnostic sums."""
        raise NotImplementedError

    def parity_recompute(self, batch: Any, cond: dict[str, torch.Tensor], max_rows: int) -> Sums:
        """Rollout/trainer parity of some of ``batch``'s rows under the weights loaded now, which must be those
        that sampled them (``digenrl.rl.loss.parity_sums``)."""
        raise NotImplementedError

    def after_step(self, steps: int) -> dict[str, float]:
        """After an optimizer step (``steps`` taken in all): move the extra weights; returns what to log."""
        return {}

    # -- checkpoints ------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Extra weights a checkpoint carries, by file stem (``old`` -> ``old.safetensors``)."""
        return {}

    def load_extra_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore :meth:`extra_state` (``ValueError`` when their tensors do not match the trained ones)."""

    def load_extra_files(self, directory: Path) -> None:
        """Restore :meth:`extra_state` from a checkpoint directory (``<stem>.safetensors`` each).

        Raises:
            ConfigError: such a file missing, unreadable, or not matching the trainable weights (naming it).
        """
        from safetensors.torch import load_file

        states = {}
        for stem in self.extra_state():
            path = directory / f"{stem}.safetensors"
            try:
                states[stem] = load_file(str(path))
            except Exception as exc:  # a missing file (FileNotFoundError) or safetensors' own error types
                raise ConfigError(f"{path}: {self.name} resumes its {stem} policy from this file, which cannot be "
                                  f"read ({exc})") from exc
        try:
            self.load_extra_state(states)
        except ValueError as exc:
            raise ConfigError(f"{directory}: {exc}") from exc
