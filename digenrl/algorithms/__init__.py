"""Training algorithms behind one seam (:class:`~digenrl.algorithms.base.Algorithm`): ``train.algorithm``.

``flow_grpo`` (coupled: SDE transitions and behaviour log-probs), ``nft`` (DiffusionNFT) and ``awm`` (Advantage
Weighted Matching), the forward-process methods whose rollout ships clean samples, ``grpo_guard`` (Flow-GRPO's
transitions, a normalised ratio). A new algorithm is one module here and one entry in :data:`ALGORITHMS`, or a
user's own file (``train.algorithm = "path/to/file.py:ClassName"``, :mod:`digenrl.algorithms.user`); no schedule,
transport or coordinator code names it.
"""

from __future__ import annotations

from typing import Any

from digenrl.algorithms.awm import Awm
from digenrl.algorithms.base import Algorithm, Backward
from digenrl.algorithms.flow_grpo import FlowGrpo
from digenrl.algorithms.grpo_guard import GrpoGuard
from digenrl.algorithms.mixgrpo import MixGrpo
from digenrl.algorithms.nft import Nft
from digenrl.algorithms.user import user_algorithm_class

__all__ = ["ALGORITHMS", "Algorithm", "Backward", "algorithm_class", "algorithm_for"]

ALGORITHMS: dict[str, type[Algorithm]] = {"flow_grpo": FlowGrpo, "nft": Nft, "awm": Awm, "grpo_guard": GrpoGuard,
                                         "mixgrpo": MixGrpo}


def algorithm_class(name: str) -> type[Algorithm]:
    """The class ``train.algorithm = name`` names: a built-in of :data:`ALGORITHMS`, or a user's
    ``path/to/file.py:ClassName`` this process was allowed to import (:mod:`digenrl.algorithms.user`)."""
    return ALGORITHMS[name] if name in ALGORITHMS else user_algorithm_class(name)


def algorithm_for(cfg: Any, model: Any, trains: bool = True) -> Algorithm:
    """The algorithm ``cfg.train.algorithm`` names, bound to this process's ``model``."""
    return algorithm_class(cfg.train.algorithm)(cfg, model, trains)
