"""The prompts of a run: small built-in sets (one per weight-free reward, so a run needs no dataset
download), a user's list or file, and which prompts each logical batch gets."""

from __future__ import annotations

import random
from pathlib import Path

from digenrl.data.shapes import SHAPE_PROMPTS
from digenrl.errors import ConfigError

__all__ = ["PROMPT_SETS", "load_prompts", "batch_prompts"]

_COLOR_WORDS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "black")
_SHAPES = ("square", "circle")

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    # 8 colours, shapes alternating: the colour reward reads the colour word. With 8 prompts per batch
    # every iteration sees every prompt, so the mean reward is comparable across iterations.
    "color": tuple(f"a {c} {_SHAPES[k % 2]}" for k, c in enumerate(_COLOR_WORDS)),
    "simple": (
        "a cat", "a dog", "a house", "a tree", "a mountain lake", "a city at night", "a bowl of fruit",
        "a red car", "a sailing boat", "a forest path", "a portrait of an old man", "a field of flowers",
    ),
    # "a red circle on a blue background": the shapes dataset's 168 prompts, for the ``shapes`` reward.
    "shapes": SHAPE_PROMPTS,
    "ocr": tuple(f'a sign that says "{w}"' for w in ("HELLO", "OPEN", "STOP", "EXIT", "SALE", "CAFE", "42", "RL")),
}


def load_prompts(prompt_set: str = "color", prompts: list[str] | None = None, prompt_file: str = "") -> list[str]:
    """The run's prompts: an explicit list, else a file (one per line), else a built-in set.

    Raises:
        ConfigError: unknown set, missing or empty file.
    """
    if prompts:
        return list(prompts)
    if prompt_file:
        p = Path(prompt_file)
        if not p.is_file():
            raise ConfigError(f"data.prompt_file: {prompt_file!r} does not exist")
        lines = [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]
        if not lines:
            raise ConfigError(f"data.prompt_file: {prompt_file!r} has no prompts")
        return lines
    if prompt_set not in PROMPT_SETS:
        raise ConfigError(f"data.prompt_set: unknown set {prompt_set!r}; allowed: {', '.join(PROMPT_SETS)}")
    return list(PROMPT_SETS[prompt_set])


def batch_prompts(prompts: list[str], seed: int, batch: int, count: int) -> list[str]:
    """The prompts of logical batch ``batch``: a pure function, so resuming needs only the batch index.

    The colocated loop and the actors' coordinator both use it, so their batches hold the same prompts.
    """
    rng = random.Random(seed * 1_000_003 + batch)
    if count <= len(prompts):
        return rng.sample(prompts, count)
    # More prompts than the pool: whole shuffled passes, so every prompt appears equally often.
    passes = [p for _ in range(-(-count // len(prompts))) for p in rng.sample(prompts, len(prompts))]
    return passes[:count]
