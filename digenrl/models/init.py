"""Start a random preset from a small pretrained checkpoint (``model.init``), checked against its recipe.

``bench/pretrain_tiny.py`` trains the tiny Qwen-Image preset on the shapes dataset and writes
``model.safetensors`` (the ``transformer.``, ``vae.`` and ``text_encoder.`` weights of the pipeline) with
``recipe.json`` beside it (how it was made, and its sha256). :func:`load_init` loads every weight of those
components strictly, so a checkpoint of another architecture fails by name instead of half-loading, and
refuses a file whose sha256 differs from its recipe's (a checkpoint replaced without its recipe).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError

__all__ = ["resolve_init_path", "load_init"]

_PROJECT = Path(__file__).resolve().parents[2]  # the checkout: shipped checkpoints live under it
_COMPONENTS = ("transformer", "vae", "text_encoder")


def resolve_init_path(path: str) -> Path:
    """``path`` as given if it exists (absolute or from the working directory), else from the project root.

    Raises:
        ConfigError: neither exists.
    """
    p = Path(path).expanduser()
    for cand in (p, _PROJECT / p):
        if cand.is_file():
            return cand
    raise ConfigError(f"model.init: checkpoint {path!r} does not exist (looked in the working directory and "
                      f"{str(_PROJECT)!r}); make one with: python bench/pretrain_tiny.py")


def load_init(model: Any, path: str) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model.pipe``; returns its recipe (empty without one).

    Raises:
        ConfigError: missing file, sha256 differing from ``recipe.json``, or weights that do not match
            the model's components (names the first missing/unexpected keys and shape mismatches).
    """
    import torch
    from safetensors.torch import load_file

    file = resolve_init_path(path)
    recipe: dict[str, Any] = {}
    rfile = file.parent / "recipe.json"
    if rfile.is_file():
        recipe = json.loads(rfile.read_text())
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if recipe.get("sha256") != digest:
            raise ConfigError(f"model.init: {str(file)!r} has sha256 {digest[:16]}..., but {str(rfile)!r} records "
                              f"{str(recipe.get('sha256'))[:16]}...; re-make it with bench/pretrain_tiny.py")
    state = load_file(str(file))
    for comp in _COMPONENTS:
        module = getattr(model.pipe, comp, None)
        prefix = f"{comp}."
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if module is None or not part:
            raise ConfigError(f"model.init: {str(file)!r} and the model disagree on component {comp!r}")
        own = module.state_dict()
        missing, extra = sorted(set(own) - set(part)), sorted(set(part) - set(own))
        bad = [k for k in own if k in part and own[k].shape != part[k].shape]
        if missing or extra or bad:
            raise ConfigError(f"model.init: {str(file)!r} does not fit the {getattr(model, 'name', '?')} model's {comp}: "
                              f"missing {missing[:3]}, unexpected {extra[:3]}, shape mismatch {bad[:3]}")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(part[k].to(t.dtype))
    return recipe
