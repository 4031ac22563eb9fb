"""DiffusionNFT (NVlabs/DiffusionNFT, ICLR'26): negative-aware fine-tuning on the forward process.

The rollout samples with the *old* policy (the trainer publishes it, and uses it under TAG); each row's loss
(:func:`digenrl.rl.forward.nft_loss`) needs the old policy's velocity at the row (no gradient), the trained
one, and the reference's when ``nft.kl_beta > 0``. After every optimizer step the old policy follows the
trained weights with the reference's decay schedule (``nft.decay``). Under ``async1`` a sample drawn by
``theta_old^(k-1)`` is trained against ``theta_old^k``: the anchor moved by one step, uncorrected (small while
the decay keeps the old policy close; bench/learning.py measures it beside colocated).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from digenrl.algorithms.forward import ForwardProcess
from digenrl.models import index_cond
from digenrl.rl.forward import ForwardRows, NftLoss, nft_loss, old_policy_decay
from digenrl.rl.loss import Sums

__all__ = ["Nft"]


class Nft(ForwardProcess):
    name = "nft"
    level_mode = "permutation"
    copy_name = "old"

    @classmethod
    def kl_weight(cls, cfg: Any) -> float:
        return float(cfg.nft.kl_beta)

    @classmethod
    def nograd_forwards(cls, cfg: Any, stale: bool) -> int:
        return 1 + int(cls.kl_weight(cfg) > 0)  # the old policy's velocity, always; the reference's

    def __init__(self, cfg: Any, model: Any, trains: bool = True) -> None:
        super().__init__(cfg, model, trains)
        n = cfg.nft
        self.loss_cfg = NftLoss(beta=n.beta, kl_beta=n.kl_beta, adv_clip=cfg.train.adv_clip)
        self.kl_beta = n.kl_beta

    def decay(self, steps: int) -> float:
        return old_policy_decay(steps, self.cfg.nft.decay)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        if self.copy is None:  # a rollout actor: the published weights are the old policy already
            yield
            return
        with self.copy.active():
            yield

    def sampling_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        if self.copy is None:
            return super().sampling_state(copy)
        return {k: v.clone() if copy else v for k, v in self.copy.state.items()}

    def rows_backward(self, velocity: Any, batch: ForwardRows, cond: dict[str, torch.Tensor], advantages: torch.Tensor,
                      cfg: Any, *, normalizer: float, ref_velocity: Any, parity: bool, on_policy: bool) -> Sums:
        if len(batch) == 0:
            return {"rows": 0.0}
        rows_cond, x = index_cond(cond, batch.sample), batch.x
        v_old = self.copy_velocity(velocity, x, batch.sigma, rows_cond)
        v_ref = ref_velocity(x, batch.sigma, rows_cond) if ref_velocity is not None else None
        v = velocity(x, batch.sigma, rows_cond)
        terms = nft_loss(v, v_old, v_ref, x, batch.y, batch.sigma, advantages[batch.sample], cfg)
        (terms.loss.sum() / normalizer).backward()
        return terms.sums
