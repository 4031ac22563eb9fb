"""The prompts of a run: small built-in sets (one per weight-free reward, so a run needs no dataset
download), a user's list or file, and which prompts each logical batch gets.

A prompt is a ``str`` everywhere (the coordinator's batches, tokens, checkpoints, the wire). An
image-conditioned prompt (an edit model's instruction and its input images) is the JSON record of a
JSONL prompt file line, its image paths made absolute: ``{"prompt": "make the square blue", "images":
["/data/in/0.png"]}`` (:func:`edit_prompt`). :func:`split_prompt` gives its text and paths back; the text
is what rewards read, the paths what :mod:`digenrl.data.images` reads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from digenrl.data.shapes import SHAPE_PROMPTS
from digenrl.errors import ConfigError

__all__ = ["PROMPT_SETS", "load_prompts", "batch_prompts", "edit_prompt", "split_prompt", "prompt_text"]


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


def edit_prompt(text: str, images: Sequence[str]) -> str:
    """The prompt string of an instruction with input images (the record :func:`split_prompt` reads)."""
    return json.dumps({"prompt": text, "images": [str(i) for i in images]}, ensure_ascii=False)


def split_prompt(prompt: str) -> tuple[str, list[str]]:
    """``(text, image paths)`` of a prompt: ``(prompt, [])`` for a plain one."""
    if prompt.startswith("{"):  # as the edit models read them (models/qwenimage_edit.py prompt_inputs)
        try:
            rec = json.loads(prompt)
        except json.JSONDecodeError:
            return prompt, []
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("images"), list):
            return rec["prompt"], [str(i) for i in rec["images"]]
    return prompt, []


def prompt_text(prompt: str) -> str:
    """The text of a prompt (an image-conditioned one without its image paths)."""
    return split_prompt(prompt)[0]


def _jsonl_prompts(path: Path) -> list[str]:
    """The prompts of a JSONL prompt file: one ``{"prompt": str, "images": [path, ...]}`` object a line.

    Image paths are relative to the file's directory (or absolute); every line has the same number of
    images, because an image-conditioned model's conditioning has one length per run.

    Raises:
        ConfigError: a line that is no such object, a missing image, or a different image count.
    """
    out: list[str] = []
    counts: set[int] = set()
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data.prompt_file: {str(path)!r} line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
        images = rec.get("images", []) if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not isinstance(images, list) \
                or not all(isinstance(i, str) for i in images):
            raise ConfigError(f'{where}: expected {{"prompt": "...", "images": ["path", ...]}}, got {line.strip()[:80]!r}')
        paths = [(path.parent / i).resolve() for i in images]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(f"{where}: image {missing[0]!r} does not exist")
        counts.add(len(paths))
        if len(counts) > 1:
            raise ConfigError(f"{where}: {len(paths)} images, but earlier lines have {min(counts - {len(paths)})}; "
                              "every prompt of a run carries the same number (the conditioning has one length)")
        out.append(edit_prompt(rec["prompt"], [str(p) for p in paths]) if paths else rec["prompt"])
    return out


def load_prompts(prompt_set: str = "color", prompts: list[str] | None = None, prompt_file: str = "") -> list[str]:
    """The run's prompts: an explicit list, else a file, else a built-in set.

    A ``.jsonl`` file holds one ``{"prompt": ..., "images": [...]}`` object a line (image-conditioned
    prompts, :func:`_jsonl_prompts`); any other file one prompt a line.

    Raises:
        ConfigError: unknown set, missing or empty file, a malformed JSONL line or a missing image.
    """
    if prompts:
        return list(prompts)
    if prompt_file:
        p = Path(prompt_file)
        if not p.is_file():
            raise ConfigError(f"data.prompt_file: {prompt_file!r} does not exist")
        lines = (_jsonl_prompts(p) if p.suffix == ".jsonl" else
                 [ln.strip() for ln in p.read_text().splitlines() if ln.strip()])
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
