"""Recipes: whole training loops built from the RL core, readable top to bottom.

* :mod:`digenrl.recipes.colocated`: the single-process reference loop (``train(config) -> history``).
* :mod:`digenrl.data.prompts`: the built-in prompt sets.

Nothing is imported here, so ``digenrl.config`` can read the prompt sets without importing models.
"""
