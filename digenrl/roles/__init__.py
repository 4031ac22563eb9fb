"""The RL roles: actors of a disaggregated Flow-GRPO run, built on the generic runtime (:mod:`digenrl.actors`).

* :mod:`.coordinator`: :class:`~.coordinator.Coordinator` drives a schedule object
  (:mod:`digenrl.schedule`) with real actors and keeps the books of each logical batch.
* :mod:`.rollout`: :class:`~.rollout.RolloutActor`, and the token endpoints shared by every actor
  that generates or scores (``GenerationMixin``); :mod:`.fragments`: fragment state and the engine
  that generates and scores it.
* :mod:`.trainer`: :class:`~.trainer.TrainerActor` (TSP-packed training, optimizer steps, publication).
* :mod:`.reward`: :class:`~.reward.RewardActor` (decode and score on a device of its own).
* :mod:`.weights`: versioned, bucketed weight publication; :mod:`.compress`: compressed transfer to a far rollout
  pool (weight deltas with error feedback, fragments packed for the way back).
* :mod:`.evaluation`: the fixed evaluation behind the sample grids (sampled on a trainer, scored where rewards are).
* :mod:`.stop`: the orderly stop on SIGINT and SIGTERM (the coordinator's and the colocated loop's).

Role actors hold no schedule logic: they run the tokens they are handed and report measured spans.
Nothing is imported here, so a process that hosts one role imports only that role's modules.
"""

__all__ = ["ROLE_CLASSES"]

# What `digenrl worker` agrees to host by default (digenrl.actors.allowlist): paths, not classes,
# so that this import stays free.
ROLE_CLASSES = (
    "digenrl.roles.trainer:TrainerActor",
    "digenrl.roles.rollout:RolloutActor",
    "digenrl.roles.reward:RewardActor",
)
