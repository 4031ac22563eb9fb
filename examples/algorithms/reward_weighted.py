"""A training algorithm written outside digenrl: reward-weighted flow matching on the rollout's clean samples.

Run it on the tiny default, colocated or with actors (no install, the file is named by its path):

    digenrl run configs/tiny-qwenimage.toml --set 'train.algorithm="examples/algorithms/reward_weighted.py:RewardWeighted"'
    digenrl run configs/tiny-qwenimage.toml --set schedule.name=async1 \\
        --set 'train.algorithm="examples/algorithms/reward_weighted.py:RewardWeighted"'

The rollout integrates the ODE (``rollout.solver``) and ships each sample's clean latent ``y``. Each sample
gets ``T`` rows (``digenrl.policy.trained_steps``: what the schedules count), row ``t`` at a noise level of the
rollout's grid with fresh noise, both drawn from the sample's own seed, so a resumed run, a re-issued fragment
and every trainer train the same rows. A row's loss is the flow-matching error weighted by the sample's
positive advantage, ``max(A, 0) |v_theta(x_t) - (eps - y)|^2``: the model is pulled toward the samples that
beat their group and never pushed away from the others (filtered behaviour cloning), plus ``KL_BETA |v_theta -
v_ref|^2`` toward the reference (the adapters off): without it the model drifts on its own samples and collapses
within ~30 iterations of the tiny default, with or without a reward signal. Under ``async1`` the rows come from
the previous weights, which this loss ignores.
"""

from __future__ import annotations

from typing import Any

import torch

from digenrl.algorithms import Algorithm, Backward
from digenrl.algorithms.flow_grpo import reference_velocity
from digenrl.models import index_cond
from digenrl.policy import trained_steps
from digenrl.rl.forward import ForwardRows
from digenrl.rl.noise import level_indices, training_noise


class RewardWeighted(Algorithm):
    name = "reward_weighted"
    coupled = False  # the rollout ships clean samples (an ODE), not SDE transitions
    drops_zero_std = True  # a group of equal rewards has no positive advantage: nothing to learn from it
    KL_BETA = 0.1  # weight of the pull toward the reference (edit here: a user algorithm's keys are its own)

    @classmethod
    def kl_weight(cls, cfg: Any) -> float:
        return cls.KL_BETA  # the planner prices the reference's forward (and full fine-tuning's frozen copy)

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        self.rows_per_sample = trained_steps(cfg)

    def token_rows(self, trans: dict[str, torch.Tensor], rows: tuple[int, int], keep: torch.Tensor, batch: int,
                   sample_ids: list[int], version: int) -> ForwardRows | None:
        per, seed, n = self.rows_per_sample, self.cfg.log.seed, self.cfg.rollout.num_steps
        picked = [(r // per, r % per) for r in range(*rows) if bool(keep[r // per])]  # row i * T + t
        if not picked:
            return None
        y = trans["y"]
        levels = {i: level_indices(seed, batch, sample_ids[i], n, per, "permutation") for i, _ in picked}
        local = torch.tensor([i for i, _ in picked])
        step = torch.tensor([levels[i][t] for i, t in picked])
        eps = torch.stack([training_noise(seed, batch, sample_ids[i], t, y.shape[1:]) for i, t in picked])
        return ForwardRows(sample=local, step=step, y=y[local].detach().float(), eps=eps.to(y.device),
                           sigma=self.sigmas.float()[step].to(y.device),
                           sample_id=torch.tensor(sample_ids)[local], probe=trans["probe"][local].float(),
                           batch=batch, policy_version=version)

    def backward(self, batch: ForwardRows, cond: dict[str, torch.Tensor], adv: torch.Tensor, plan: Backward, *,
                 version: int) -> list[dict[str, Any]]:
        # digenrl's drivers cut the rows into passes (rows_per_pass, FSDP slices, experts); each runs one_pass
        return plan.run(self.model.velocity, batch, cond, adv, None, ref_velocity=reference_velocity(self.model),
                        backward=self.one_pass)

    def one_pass(self, velocity: Any, rows: ForwardRows, cond: dict[str, torch.Tensor], advantages: torch.Tensor,
                 _cfg: Any, *, normalizer: float, ref_velocity: Any, **_: Any) -> dict[str, Any]:
        if len(rows) == 0:
            return {"rows": 0.0}
        rows_cond = index_cond(cond, rows.sample)
        v = velocity(rows.x, rows.sigma, rows_cond).float()
        error = ((v - (rows.eps - rows.y)) ** 2).flatten(1).mean(dim=1)
        kl = ((v - ref_velocity(rows.x, rows.sigma, rows_cond).float()) ** 2).flatten(1).mean(dim=1)
        policy = advantages[rows.sample].float().clamp_min(0) * error
        ((policy + self.KL_BETA * kl).sum() / normalizer).backward()
        return {"policy_loss": policy.detach().sum(), "kl": kl.detach().sum(), "rows": float(len(rows))}
