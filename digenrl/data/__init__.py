"""Data a run consumes: the prompt sets and each logical batch's prompts (:mod:`.prompts`).

Nothing is imported here, so ``digenrl.config`` can read the prompt sets without importing models.
"""
