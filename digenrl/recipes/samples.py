"""A run's sample grids, the same for the colocated loop and the actors: ``DIR/samples/step_NNNNN.png`` + ``.json``,
and the same picture to TensorBoard and W&B (tag ``samples``) at that step.

``log.samples = "fixed"`` (default): step ``N`` is the fixed evaluation of version ``N``, the weights after ``N``
optimizer steps (:mod:`digenrl.roles.evaluation`), at ``N`` = 0, ``log.image_every``, twice that ... and the last,
with its mean reward as ``eval/reward_mean``. ``"rollout"``: step ``N`` is batch ``N``'s own training samples
(its first ``log.images_per_grid``, one row per prompt group), sampled by the rollout's SDE with that batch's
policy version, at ``N`` = 0, ``log.image_every`` ... and the last batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from digenrl.config import Config
from digenrl.data.prompts import prompt_text
from digenrl.roles.evaluation import Evaluation, evaluation_sampler
from digenrl.telemetry.grid import Grid, render_grid
from digenrl.telemetry.metrics import MetricsLog

__all__ = ["write_evaluation", "write_rollout_samples", "grid_path", "rollout_due"]


def grid_path(out: Path, step: int) -> Path:
    return out / "samples" / f"step_{step:05d}.png"


def rollout_due(cfg: Config, batch: int) -> bool:
    """``log.samples = "rollout"``: whether batch ``batch``'s samples make a grid."""
    every = cfg.log.image_every
    return bool(every) and (batch % every == 0 or batch == cfg.train.iterations - 1)


def _mean(values: Sequence[float | None] | None) -> float | None:
    got = [float(v) for v in values or [] if v is not None]
    return sum(got) / len(got) if got else None


def write_evaluation(out: Path, metrics: MetricsLog, cfg: Config, ev: Evaluation) -> Grid:
    """Version ``ev.version``'s fixed-evaluation grid (and its TensorBoard / W&B image and ``eval/reward_mean``)."""
    solver, steps = evaluation_sampler(cfg)
    mean = _mean(ev.rewards)
    n = len(ev.prompts)
    title = (f"step {ev.version} | fixed evaluation: {n} prompts, fixed noise, {solver} ODE {steps} steps, trained "
             f"weights | mean reward {'-' if mean is None else f'{mean:.3f}'}")
    meta = {"step": ev.version, "kind": "fixed", "version": ev.version, "solver": solver, "steps": steps,
            "seed": cfg.log.seed, "components": ev.components, "error": ev.error}
    grid = render_grid(ev.images, [prompt_text(p) for p in ev.prompts], ev.rewards, columns=math.ceil(math.sqrt(n)),
                       tile_px=cfg.log.tile_px, title=title, meta={**meta, "prompts": ev.prompts})
    grid.save(grid_path(out, ev.version))
    metrics.image("samples", grid.array(), ev.version, title, {"eval/reward_mean": mean} if mean is not None else {})
    return grid


def write_rollout_samples(out: Path, metrics: MetricsLog, cfg: Config, batch: int, images: Any,
                          prompts: Sequence[str], rewards: Sequence[float]) -> Grid:
    """Batch ``batch``'s first ``log.images_per_grid`` training samples, each with its prompt and reward."""
    n = min(cfg.log.images_per_grid, int(images.shape[0]))
    mean = _mean(rewards[:n])
    title = (f"step {batch} | training samples of batch {batch} (rollout SDE, not a fixed set) | mean reward "
             f"{'-' if mean is None else f'{mean:.3f}'}")
    grid = render_grid(images[:n], [prompt_text(p) for p in prompts[:n]], list(rewards[:n]),
                       columns=min(cfg.rollout.group_size, n), tile_px=cfg.log.tile_px, title=title,
                       meta={"step": batch, "kind": "rollout", "prompts": list(prompts[:n])})
    grid.save(grid_path(out, batch))
    metrics.image("samples", grid.array(), batch, title)
    return grid
