"""Run a step range of the SDE sampler on a batch and record the transitions to train.

The unit is a *fragment*: a batch of latents that all sit at the same step index. :func:`rollout_steps`
advances it over ``[start, stop)`` with the given model and returns the new latents plus a
:class:`TransitionBatch` with one row per trained (sample, step): ``(x_i, x_{i+1}, sigma_i,
sigma_{i+1}, l_old)``. A fragment can therefore advance steps 0-3 on one actor and 4-9 on another; the
step index and sigmas travel with the data, never in a scheduler's counter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from digenrl.rl.sde import SdeKind, sde_step
from digenrl.rl.steps import StepPlan

__all__ = ["VelocityFn", "TransitionBatch", "RolloutResult", "rollout_steps"]


class VelocityFn(Protocol):
    """``v(x, sigma[B], cond) -> v``: a model's guided velocity (``GeneratorModel.velocity``)."""

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor: ...


@dataclass(frozen=True)
class TransitionBatch:
    """Stored transitions, one row per trained (sample, step).

    ``sample`` and ``step`` are indices and stay on the host (they pick rows, conditionings and
    advantages, which torch allows on any device); the other tensors live where the model computes
    (:meth:`to` places them, once, where a role receives them).

    Attributes:
        sample: ``[R]`` long, the sample's row in its batch (indexes the conditioning and advantages).
        step: ``[R]`` long, the step index ``i``.
        x: ``[R, ...]`` fp32, ``x_i`` exactly as fed to the model.
        x_next: ``[R, ...]`` fp32, ``x_{i+1}`` exactly as fed to the next step.
        sigma: ``[R]`` fp32, ``sigma_i``.
        sigma_next: ``[R]`` fp32, ``sigma_{i+1}``.
        log_prob: ``[R]`` fp32, the behaviour log-prob ``l_old``.
        noise_level: ``[R]`` fp32, the ``a`` used for the row.
        kind: the SDE kind used at rollout.
        policy_version: the weights version that sampled these rows.
    """

    sample: torch.Tensor
    step: torch.Tensor
    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    log_prob: torch.Tensor
    noise_level: torch.Tensor
    kind: SdeKind = "sde"
    policy_version: int = 0

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def stored(self) -> dict[str, torch.Tensor]:
        """The rows as a fragment stores them for the trainer (``Algorithm.token_rows``'s ``trans``)."""
        return {k: getattr(self, k) for k in ("sample", "step", *_VALUES)}

    def to(self, device: torch.device | str) -> TransitionBatch:
        """The rows with their values (not their host indices) on ``device``."""
        return replace(self, **{k: getattr(self, k).to(device) for k in _VALUES})

    def rows(self, index: torch.Tensor | slice | list[int]) -> TransitionBatch:
        """A subset of rows."""
        return replace(
            self,
            sample=self.sample[index],
            step=self.step[index],
            x=self.x[index],
            x_next=self.x_next[index],
            sigma=self.sigma[index],
            sigma_next=self.sigma_next[index],
            log_prob=self.log_prob[index],
            noise_level=self.noise_level[index],
        )

    @staticmethod
    def cat(parts: list[TransitionBatch], sample_offsets: list[int] | None = None) -> TransitionBatch:
        """Concatenate batches (e.g. step ranges or fragments); ``sample_offsets`` shift sample indices.

        Raises:
            ValueError: on an empty list or mixed kinds / policy versions.
        """
        if not parts:
            raise ValueError("cannot concatenate zero transition batches")
        kinds = {p.kind for p in parts}
        versions = {p.policy_version for p in parts}
        if len(kinds) > 1 or len(versions) > 1:
            raise ValueError(f"cannot mix sde kinds {kinds} or policy versions {versions} in one batch")
        offs = sample_offsets or [0] * len(parts)

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts])

        return replace(
            parts[0],
            sample=torch.cat([p.sample + o for p, o in zip(parts, offs, strict=True)]),
            step=cat("step"),
            x=cat("x"),
            x_next=cat("x_next"),
            sigma=cat("sigma"),
            sigma_next=cat("sigma_next"),
            log_prob=cat("log_prob"),
            noise_level=cat("noise_level"),
        )


_VALUES = ("x", "x_next", "sigma", "sigma_next", "log_prob", "noise_level")


@dataclass(frozen=True)
class RolloutResult:
    """Latents after ``stop``, the transitions recorded in ``[start, stop)`` and the last step's data prediction
    ``x - sigma v`` (a multistep solver that takes over from there needs it: :mod:`digenrl.rl.flash`)."""

    x: torch.Tensor
    transitions: TransitionBatch
    start: int
    stop: int
    x0: torch.Tensor | None = None


@torch.no_grad()
def rollout_steps(
    velocity: VelocityFn,
    x: torch.Tensor,
    cond: dict[str, torch.Tensor],
    sigmas: torch.Tensor,
    plan: StepPlan,
    start: int,
    stop: int,
    *,
    noise_level: float,
    kind: SdeKind = "sde",
    generator: torch.Generator | None = None,
    noise: Callable[[int], torch.Tensor] | None = None,
    policy_version: int = 0,
) -> RolloutResult:
    """Advance ``x`` (all at step ``start``) through steps ``[start, stop)``.

    Args:
        velocity: the policy's guided velocity function.
        x: latents ``[B, ...]`` at ``sigmas[start]``.
        cond: the batch's conditioning (batch-first tensors).
        sigmas: the ``N + 1`` noise levels of the run.
        plan: which steps are stochastic / trained, per sample.
        start: first step index to run.
        stop: one past the last step index to run.
        noise_level: ``a`` for stochastic steps.
        kind: SDE kind.
        generator: RNG for the transition noise (when ``noise`` is None).
        noise: ``noise(i)`` gives step ``i``'s standard normal noise ``[B, ...]`` (per-sample streams,
            :mod:`digenrl.rl.noise`); it takes precedence over ``generator``.
        policy_version: the weights version, recorded with the transitions.

    Returns:
        The :class:`RolloutResult`.

    Raises:
        ValueError: if the step range or shapes do not fit the plan.
    """
    n = sigmas.shape[0] - 1
    if not 0 <= start <= stop <= n:
        raise ValueError(f"step range [{start}, {stop}) outside 0..{n}")
    if plan.stochastic.shape != (x.shape[0], n):
        raise ValueError(f"plan is for {tuple(plan.stochastic.shape)}, batch is {x.shape[0]} x {n} steps")
    x = x.float()
    b = x.shape[0]
    # The step plan is host data (it decides, never computes): its noise levels and the sigmas are
    # placed with the latents once; the checks read the host copy, so the device is never waited on.
    levels = plan.stochastic.float() * noise_level
    sigmas, levels_here = sigmas.float().to(x.device), levels.to(x.device)
    rows: list[TransitionBatch] = []
    x0 = None
    for i in range(start, stop):
        sig = sigmas[i].expand(b)
        sig_next = sigmas[i + 1].expand(b)
        a_row = levels_here[:, i]
        v = velocity(x, sig, cond)
        if i == stop - 1:
            x0 = x - sigmas[i] * v.float()
        out = sde_step(x, v, sig, sig_next, levels[:, i], None if noise is None else noise(i), kind=kind,
                       generator=generator)
        idx = plan.trained[:, i].nonzero().flatten()
        if idx.numel():
            if out.log_prob is None or not bool((levels[idx, i] > 0).all()):
                raise ValueError(f"step {i} is trained but deterministic (noise_level must be > 0)")
            rows.append(
                TransitionBatch(
                    sample=idx,
                    step=torch.full_like(idx, i),
                    x=x[idx],
                    x_next=out.x_next[idx],
                    sigma=sig[idx].clone(),
                    sigma_next=sig_next[idx].clone(),
                    log_prob=out.log_prob[idx],
                    noise_level=a_row[idx],
                    kind=kind,
                    policy_version=policy_version,
                )
            )
        x = out.x_next
    if not rows:
        rows.append(_empty(x, kind, policy_version))
    return RolloutResult(x=x, transitions=TransitionBatch.cat(rows), start=start, stop=stop, x0=x0)


def _empty(x: torch.Tensor, kind: SdeKind, version: int) -> TransitionBatch:
    z = torch.zeros(0)
    e = torch.zeros(0, dtype=torch.long)
    lat = torch.zeros(0, *x.shape[1:])
    return TransitionBatch(e, e, lat, lat, z, z, z, z, kind=kind, policy_version=version).to(x.device)
