"""Recipes: whole runs, readable top to bottom.

* :mod:`.colocated`: the single-process reference loop (``train(config) -> history``).
* :mod:`.disaggregated`: the actor run: spawn the roles, wire them, let the coordinator drive the
  schedule (``run_disaggregated(config)``).
* :mod:`.checkpoint`: atomic checkpoints and finding one to resume from.
* :mod:`.bench_real`: ``digenrl bench bubbles --real``, the tiny model trained for real under
  several schedules beside the simulator's prediction.
"""
