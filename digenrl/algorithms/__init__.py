"""Training algorithms behind one seam (:class:`~digenrl.algorithms.base.Algorithm`): ``train.algorithm``.

``flow_grpo`` (coupled: SDE transitions and behaviour log-probs), ``nft`` (DiffusionNFT) and ``awm`` (Advantage
Weighted Matching), the forward-process methods whose rollout ships clean samples. A new algorithm is one module
here and one entry in :data:`ALGORITHMS`; no schedule, transport or coordinator code names it.
"""

from __future__ import annotations

from typing import Any

from digenrl.algorithms.awm import Awm
from digenrl.algorithms.base import Algorithm, Backward
from digenrl.algorithms.flow_grpo import FlowGrpo
from digenrl.algorithms.nft import Nft

__all__ = ["ALGORITHMS", "Algorithm", "Backward", "algorithm_for"]

ALGORITHMS: dict[str, type[Algorithm]] = {"flow_grpo": FlowGrpo, "nft": Nft, "awm": Awm}


def algorithm_for(cfg: Any, model: Any, trains: bool = True) -> Algorithm:
    """The algorithm ``cfg.train.algorithm`` names, bound to this process's ``model``."""
    return ALGORITHMS[cfg.train.algorithm](cfg, model, trains)
