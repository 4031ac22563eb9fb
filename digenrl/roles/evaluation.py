"""The fixed evaluation behind the sample grids (``log.samples = "fixed"``): the same prompts and noise all run long.

::

    prompts = evaluation_prompts(pool, cfg.log.seed, cfg.log.images_per_grid)     # once per run (and at resume)
    latents = sample_evaluation(model, cfg, prompts)        # the weights of the version to show, no gradients
    scored = score_evaluation(model, cfg, latents, prompts, reward, version)   # decode and score: an Evaluation

A pure function of the weights: the prompts are drawn from the pool by ``log.seed`` alone (a stream of their own,
never a training batch's), each tile's initial noise is the sample's own (``digenrl.rl.noise``, batch
:data:`EVAL_BATCH`, which no training batch uses), and the sampler is deterministic, so the tiles of step ``k``
and step ``k + n`` differ only by what training changed. Nothing here draws from torch's global generator or
touches an optimizer, gradients or a reward's failure budget: a run trains the same numbers with grids on or off.

The sampler is the ODE of the trained weights (LoRA merged into fp32 weights, as rollouts sample, and restored bit
for bit), not the rollout's sampler: for Flow-GRPO the Euler ODE (its SDE at noise level 0, what its reference
evaluates with and a user deploys), not the SDE with fixed noise (the exploration noise would sit in every tile);
for DiffusionNFT and AWM their rollouts' ODE (``rollout.solver``), with the trained weights rather than the old
policy DiffusionNFT's rollouts sample with. ``log.eval_steps`` steps (default ``rollout.num_steps``).
The colocated loop runs both halves itself; an actor run samples on the lead trainer (it holds the trained
weights of the version, with nothing to publish: ``TrainerActor.sample_evaluation``) and decodes and scores on
the actor that scores (``GenerationMixin.score_evaluation``; the coordinator picks it): the same functions, so the
same tiles.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from digenrl.config import Config
from digenrl.models.base import decode_in_chunks
from digenrl.rl.noise import initial_latents
from digenrl.rl.ode import ode_step

__all__ = ["EVAL_BATCH", "Evaluation", "evaluation_prompts", "evaluation_sampler", "evaluation_due",
           "sample_evaluation", "score_evaluation", "evaluate"]

log = logging.getLogger(__name__)

EVAL_BATCH = -2  # the noise "batch" of the evaluation's samples (training batches are >= 0; -1 is the parity probe)


@dataclass
class Evaluation:
    """One version's fixed evaluation: ``images`` ``[N, 3, H, W]`` uint8 (a video's first frame), on the host."""

    version: int
    prompts: list[str]
    images: torch.Tensor
    rewards: list[float] | None  # None: the reward failed (the message in ``error``)
    components: dict[str, list[float]] = field(default_factory=dict)
    error: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "prompts": self.prompts, "images": self.images, "rewards": self.rewards,
                "components": self.components, "error": self.error}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Evaluation:
        return cls(int(d["version"]), list(d["prompts"]), d["images"], d["rewards"], dict(d["components"]),
                   str(d["error"]))


def evaluation_prompts(pool: Sequence[str], seed: int, count: int) -> list[str]:
    """``count`` prompts of ``pool``, drawn by ``seed`` alone: distinct while the pool has enough, else whole
    shuffled passes (every prompt equally often)."""
    rng = random.Random(f"digenrl-evaluation-{seed}")  # a string seed: its own stream, the same in every process
    pool = list(pool)
    if count <= len(pool):
        return rng.sample(pool, count)
    passes = [p for _ in range(-(-count // len(pool))) for p in rng.sample(pool, len(pool))]
    return passes[:count]


def evaluation_sampler(cfg: Config) -> tuple[str, int]:
    """``(ODE solver, steps)`` of the evaluation: Euler for an algorithm whose rollouts sample the SDE (Flow-GRPO
    and its kin), ``rollout.solver`` for one whose rollouts integrate an ODE (DiffusionNFT, AWM);
    ``log.eval_steps`` or ``rollout.num_steps``."""
    from digenrl.algorithms import algorithm_class

    coupled = algorithm_class(cfg.train.algorithm).coupled
    return ("euler" if coupled else cfg.rollout.solver), cfg.log.eval_steps or cfg.rollout.num_steps


def evaluation_due(cfg: Config, version: int) -> bool:
    """Whether version ``version`` (the weights after that many optimizer steps) gets a fixed-evaluation grid:
    0, ``log.image_every``, twice that ... and the run's last (``train.iterations``)."""
    every = cfg.log.image_every
    return bool(every) and (version % every == 0 or version == cfg.train.iterations)


def _chunk(cfg: Config, n: int) -> int:
    """Samples per forward pass: no more than a rollout token or the colocated batch holds at once."""
    ro = cfg.rollout
    return max(1, min(n, ro.prompts_per_batch * ro.group_size, cfg.schedule.fragment_groups * ro.group_size))


@torch.no_grad()
def sample_evaluation(model: Any, cfg: Config, prompts: Sequence[str]) -> torch.Tensor:
    """The clean latents of ``prompts``' fixed samples under ``model``'s trained weights (on the model's device)."""
    from digenrl.models.lora import sampling

    solver, steps = evaluation_sampler(cfg)
    sigmas = model.sigmas(steps)
    n, size = len(prompts), _chunk(cfg, len(prompts))
    out = []
    with sampling(model):
        for a in range(0, n, size):
            b = min(n, a + size)
            cond = model.encode_prompts(list(prompts[a:b]))
            x = initial_latents(model, cfg.log.seed, EVAL_BATCH, range(a, b))  # on the model's device
            grid, prev = sigmas.float().to(x.device), None
            for i in range(steps):
                v = model.velocity(x, grid[i].expand(x.shape[0]), cond)
                x, prev = ode_step(solver, x, v, sigmas, i, prev)
            out.append(x)
    return torch.cat(out)


@torch.no_grad()
def score_evaluation(model: Any, cfg: Config, latents: torch.Tensor, prompts: Sequence[str], reward: Any,
                     version: int) -> Evaluation:
    """Decode ``latents`` (with ``model``'s VAE) and score them with ``reward`` (a ``GuardedReward``).

    A failing reward is reported in the result (``rewards = None``), never raised: a grid is not worth a run.
    """
    from digenrl.data.images import reward_inputs
    from digenrl.rewards.base import RewardError

    images = decode_in_chunks(model, latents, cfg.rollout.decode_batch)
    rewards: list[float] | None = None
    components: dict[str, list[float]] = {}
    error = ""
    if reward is not None:
        failures = reward.failures
        try:
            texts, sources = reward_inputs(list(prompts), images, reward.uses_sources)
            scores = reward.score(images, texts, sources=sources).float().flatten()
        except RewardError as exc:
            error = str(exc)
        else:
            if reward.failures > failures:  # a penalty, not a score
                error = reward.last_error
            else:
                rewards = [float(s) for s in scores]
                components = {k: [float(s) for s in torch.as_tensor(v).flatten()]
                              for k, v in getattr(reward.inner, "last_components", {}).items()}
        if error:
            log.warning("fixed evaluation of version %d: the reward failed (%s); its grid shows no rewards", version,
                        error)
    if images.ndim == 5:
        images = images[:, :, 0]
    pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    return Evaluation(version, list(prompts), pixels, rewards, components, error)


def evaluate(model: Any, cfg: Config, prompts: Sequence[str], reward: Any, version: int) -> Evaluation:
    """Both halves in one process (the colocated loop)."""
    return score_evaluation(model, cfg, sample_evaluation(model, cfg, prompts), prompts, reward, version)
