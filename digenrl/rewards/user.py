"""Rewards the user writes in Python: ``[reward.models.<name>] python = "path/to/file.py:ClassName"``.

The spelling, and which processes may import the file (those whose own config names it, those their driver
launched with it, a joined worker with ``--allow-reward``, ``python -m digenrl.rewards.server --python``):
:mod:`digenrl.usercode`, shared with the user's algorithms.

**Interface.** The class is built once in each process that scores, ``ClassName(**settings)``, ``settings``
being the table's other keys (so one file serves several configs); a constructor with a ``device`` or
``dtype`` parameter the table does not set receives ``reward.device`` / ``reward.dtype`` resolved (``"cpu"``,
``"cuda:0"``; ``"float32"``, ``"bfloat16"``). Then ``score(images, prompts)`` is called per batch as for every
reward (``rewards/base.py``): ``images`` ``[B, 3, H, W]`` float in [0, 1] (videos ``[B, 3, F, H, W]``) on the
device they were decoded on, ``prompts`` the B prompt texts; it returns B finite scores (a tensor, or
anything ``torch.as_tensor`` takes). A class with ``uses_sources = True`` is called ``score(images, prompts,
sources)`` with each sample's input images ``[B, K, 3, H, W]`` (edit models). A score that raises or returns
the wrong shape or non-finite values is a :class:`RewardError`, so ``reward.on_error`` applies to it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from digenrl import usercode
from digenrl.errors import ConfigError
from digenrl.rewards.base import RewardError

__all__ = ["UserReward", "is_user_table", "check_spelling", "allow_user_reward", "allow_user_rewards",
           "user_reward_paths", "check_user_reward", "load_user_reward"]

_WHAT = "reward class"


def is_user_table(table: Any) -> bool:
    """``table`` (a ``[reward.models.<name>]`` table) names a Python reward: it has a ``python`` key."""
    return isinstance(table, Mapping) and "python" in table


def check_spelling(name: str, spec: Any) -> tuple[str, str]:
    """``python = "path/to/file.py:ClassName"`` split into the path and the class name; reads no file.

    Raises:
        ConfigError: naming ``reward.models.<name>.python``, with the expected spelling.
    """
    return usercode.split_spec(spec, f"reward.models.{name}.python", _WHAT)


def allow_user_reward(spec: str, key: str = "--allow-reward") -> str:
    """Let this process import the reward ``"path/to/file.py:ClassName"``; returns it resolved.

    Raises:
        ConfigError: ``spec`` is not spelled ``path.py:ClassName`` (naming ``key``).
    """
    return usercode.allow(spec, key, _WHAT)


def allow_user_rewards(models: Mapping[str, Any]) -> list[str]:
    """Let this process import every Python reward of its own ``reward.models``; returns them resolved (what
    :func:`digenrl.usercode.launch_env` grants the actor processes it launches).

    Only for a config this process started with, never one that arrived in a message (``load_config`` does it
    for the files it reads).

    Raises:
        ConfigError: a ``python`` value not spelled ``path.py:ClassName``.
    """
    out = []
    for name, table in models.items():
        if is_user_table(table):
            out.append(usercode.allow(table["python"], f"reward.models.{name}.python", _WHAT))
    return out


def user_reward_paths(models: Mapping[str, Any]) -> list[str]:
    """The files the Python rewards of ``reward.models`` read, as written (the host that runs a config reads them)."""
    return [str(t["python"]).rpartition(":")[0] for t in models.values() if is_user_table(t)]


def _reward_class(name: str, table: Mapping[str, Any]) -> tuple[type, Path]:
    """The reward class ``table["python"]`` names, imported (once allowed); its file.

    Raises:
        ConfigError: naming ``reward.models.<name>.python``: spelling, missing file, not allowed in this
            process, import failure, no such class, not a class with a ``score`` method.
    """
    key = f"reward.models.{name}.python"
    cls, path = usercode.load_class(table.get("python"), key, "reward class with a score(images, prompts) method",
                                    "--allow-reward")
    if not callable(getattr(cls, "score", None)):
        raise ConfigError(f"{key}: class {cls.__name__} in {table['python'].rpartition(':')[0]} has no "
                          "score(images, prompts) method")
    return cls, path


def _settings(name: str, table: Mapping[str, Any], cls: type, device: str, dtype: str) -> dict[str, Any]:
    """The constructor's keyword arguments: the table's keys but ``python``, plus ``device`` / ``dtype`` where
    the constructor asks for them and the table leaves them out.

    Raises:
        ConfigError: a setting the constructor does not take (naming ``reward.models.<name>.<key>``), or one
            it needs that the table lacks.
    """
    settings = {k: v for k, v in table.items() if k != "python"}
    params = inspect.signature(cls).parameters
    for key, value in (("device", device), ("dtype", dtype)):
        if key in params and key not in settings:
            settings[key] = value
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in settings:
            if key not in takes:
                raise ConfigError(f"reward.models.{name}.{key}: {cls.__name__} takes no setting {key!r} (its "
                                  f"settings: {', '.join(takes) or 'none'})")
    try:
        inspect.signature(cls).bind(**settings)
    except TypeError as exc:
        raise ConfigError(f"reward.models.{name}: {cls.__name__}{inspect.signature(cls)}: {exc}") from None
    return settings


def check_user_reward(name: str, table: Mapping[str, Any]) -> None:
    """``digenrl validate``'s check: the file imports, names a reward class, and the table's settings fit its
    constructor (which is not run: it may load a model).

    Raises:
        ConfigError: as :func:`load_user_reward`, but for the constructor's own failures.
    """
    cls, _ = _reward_class(name, table)
    _settings(name, table, cls, "cpu", "float32")


def load_user_reward(name: str, table: Mapping[str, Any], device: str = "cpu", dtype: str = "float32") -> UserReward:
    """The Python reward of ``[reward.models.<name>]``, built (only if this process was allowed its file).

    Raises:
        ConfigError: naming ``reward.models.<name>[.<key>]``: as :func:`check_user_reward`, or the constructor
            raised (the exception and the file's line).
    """
    cls, path = _reward_class(name, table)
    settings = _settings(name, table, cls, device, dtype)
    try:
        inner = cls(**settings)
    except Exception as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        raise ConfigError(f"reward.models.{name}: {cls.__name__}({shown}) raised {usercode.failure(exc, path)}") from None
    return UserReward(name, inner, path)


class UserReward:
    """A user's reward object behind the reward contract: its failures are :class:`RewardError`.

    Args:
        name: its ``reward.weights`` name.
        inner: the user's object (``score(images, prompts[, sources])``).
        path: its file, which errors name.
    """

    def __init__(self, name: str, inner: Any, path: Path) -> None:
        self.name, self.inner, self.path = name, inner, path
        self.uses_sources = bool(getattr(inner, "uses_sources", False))
        self._who = f"reward {name!r} ({path.name}:{type(inner).__name__}.score)"

    def score(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None) -> torch.Tensor:
        """The user's scores of the batch as ``[B]`` fp32 on the CPU.

        Raises:
            RewardError: the user's ``score`` raised, or returned something that is not B finite numbers.
        """
        try:
            out = self.inner.score(images, prompts, sources) if self.uses_sources else self.inner.score(images, prompts)
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"{self._who} raised {usercode.failure(exc, self.path)}") from exc
        try:
            scores = torch.as_tensor(out.detach() if isinstance(out, torch.Tensor) else out, dtype=torch.float32).cpu()
        except (TypeError, ValueError, RuntimeError):
            raise RewardError(f"{self._who} returned {type(out).__name__}, expected {images.shape[0]} numbers "
                              "(a tensor of shape [B])") from None
        if scores.shape != (images.shape[0],):
            raise RewardError(f"{self._who} returned shape {tuple(scores.shape)}, expected [{images.shape[0]}] "
                              "(one score per image)")
        if not bool(torch.isfinite(scores).all()):
            raise RewardError(f"{self._who} returned non-finite scores {scores.tolist()}")
        return scores
