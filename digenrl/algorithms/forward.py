"""What DiffusionNFT and AWM share: a rollout that ships clean samples, rows the trainer draws, a slow copy.

The rollout integrates the ODE (``rollout.solver``) and ships each sample's clean latent ``y`` (stored as the
fragment's ``{"sample", "y"}``: one record per sample). A sample has ``T`` rows (:func:`digenrl.policy.trained_steps`);
its row ``t`` is the noise level ``sigmas[i_t]`` of the rollout's own grid with fresh noise ``eps_t``, both drawn
from the sample's seed (:mod:`digenrl.rl.noise`): any trainer, a resumed run and a re-issued fragment train the
same rows. The rows go through the same TSP drivers as Flow-GRPO's transitions (per-row sigma, repeated
conditioning, ``rows_per_pass``, FSDP slices, expert groups), with the subclass's pass (:meth:`rows_backward`).
Groups with equal rewards are trained too (advantage 0), as both references do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from digenrl.algorithms._copy import PolicyCopy
from digenrl.algorithms.base import Algorithm, Backward
from digenrl.algorithms.flow_grpo import reference_velocity
from digenrl.policy import trained_steps
from digenrl.models import index_cond
from digenrl.rl.forward import ForwardRows, velocity_probe
from digenrl.rl.loss import Sums, parity_sums
from digenrl.rl.noise import initial_latents, level_indices, probe_direction, training_noise

__all__ = ["ForwardProcess"]


class ForwardProcess(Algorithm):
    """Base of the forward-process algorithms (:class:`~digenrl.algorithms.nft.Nft`, :class:`~digenrl.algorithms.awm.Awm`)."""

    coupled = False
    drops_zero_std = False
    level_mode = "permutation"  # how a sample's levels are drawn (rl.noise.level_indices)
    copy_name = "old"  # the slow copy's checkpoint file stem
    kl_beta = 0.0  # weight of the KL to the reference (its forward runs only when > 0)
    slow_copies = 1

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        self.rows_per_sample = trained_steps(cfg)
        self.copy = PolicyCopy(model, self.decay) if trains else None

    def decay(self, steps: int) -> float:
        """The slow copy's decay after ``steps`` optimizer steps."""
        raise NotImplementedError

    def strata(self) -> list[tuple[int, int]]:
        return []

    def sample_levels(self, batch: int, sample_id: int) -> list[int]:
        """The grid indices of one sample's rows, in row order."""
        return level_indices(self.cfg.log.seed, batch, sample_id, self.cfg.rollout.num_steps, self.rows_per_sample,
                             self.level_mode, self.strata())

    def token_rows(self, trans: dict[str, torch.Tensor], rows: tuple[int, int], keep: torch.Tensor, batch: int,
                   sample_ids: list[int], version: int) -> ForwardRows | None:
        k_per, seed = self.rows_per_sample, self.cfg.log.seed
        picked = [(r // k_per, r % k_per) for r in range(*rows) if bool(keep[r // k_per])]
        if not picked:
            return None
        y = trans["y"]
        levels = {i: self.sample_levels(batch, sample_ids[i]) for i in {i for i, _ in picked}}
        step = torch.tensor([levels[i][k] for i, k in picked], dtype=torch.long)
        local = torch.tensor([i for i, _ in picked], dtype=torch.long)
        eps = torch.stack([training_noise(seed, batch, sample_ids[i], k, y.shape[1:]) for i, k in picked])
        return ForwardRows(sample=local, step=step, y=y[local].detach().float(), eps=eps,
                           sigma=self.sigmas.float()[step], sample_id=torch.tensor(sample_ids, dtype=torch.long)[local],
                           probe=trans["probe"][local].float(), batch=batch, policy_version=version)

    def backward(self, batch: ForwardRows, cond: dict[str, torch.Tensor], adv: torch.Tensor, plan: Backward, *,
                 version: int) -> list[Sums]:
        ref = reference_velocity(self.model) if self.kl_beta > 0 else None
        run = functools.partial(self.rows_backward, on_policy=batch.policy_version == version)
        sums = plan.run(self.model.velocity, batch, cond, adv, self.loss_cfg, ref_velocity=ref, parity=False,
                        backward=run)
        if batch.policy_version == version:  # the weights that sampled the rows are at hand: parity (every rank)
            with self.sampling():
                parity = self.parity_recompute(batch, cond, self.parity_samples)
            sums.append(parity if plan.rank == 0 else {})
        return sums

    parity_samples = 16  # samples of an on-policy token whose first step the trainer recomputes

    def parity_recompute(self, batch: ForwardRows, cond: dict[str, torch.Tensor], max_samples: int) -> Sums:
        """Parity of up to ``max_samples`` of the rows' samples under the weights loaded now (those that sampled
        them): their first ODE step's velocity probe, recomputed from their seeded initial noise, against the
        rollout's (:func:`~digenrl.rl.forward.velocity_probe`, read as a log-prob by ``parity_sums``)."""
        if len(batch) == 0:
            return {"parity_rows": 0.0}
        first = {int(s): r for r, s in reversed(list(enumerate(batch.sample_id.tolist())))}  # a row per sample
        rows = torch.tensor(sorted(first.values())[:max_samples], dtype=torch.long)
        sub = batch.rows(rows)
        model = self.model
        with torch.no_grad():
            x = initial_latents(model, self.cfg.log.seed, batch.batch, sub.sample_id.tolist()).to(batch.sigma.device)
            v = model.velocity(x, self.sigmas.float().to(x.device)[0].expand(len(sub)), index_cond(cond, sub.sample))
            return parity_sums(velocity_probe(v, probe_direction(self.cfg.log.seed, v.shape[1:])), sub.probe)

    def rows_backward(self, velocity: Any, batch: ForwardRows, cond: dict[str, torch.Tensor], advantages: torch.Tensor,
                      cfg: Any, *, normalizer: float, ref_velocity: Any, parity: bool, on_policy: bool) -> Sums:
        """One pass: the subclass's forwards and loss over ``batch``, ``backward()`` of ``sum / normalizer``."""
        raise NotImplementedError

    def copy_velocity(self, velocity: Any, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The slow copy's velocity (no gradient)."""
        assert self.copy is not None, "only a training process holds the slow copy"
        with torch.no_grad(), self.copy.active():
            return velocity(x, sigma, cond)

    def after_step(self, steps: int) -> dict[str, float]:
        return {f"{self.copy_name}_decay": self.copy.follow(steps)} if self.copy is not None else {}

    def extra_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.copy_name: self.copy.state} if self.copy is not None else {}

    def load_extra_state(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.copy is not None and self.copy_name in states:
            self.copy.load(states[self.copy_name])
