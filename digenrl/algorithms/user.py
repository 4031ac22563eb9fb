"""Algorithms the user writes in Python: ``train.algorithm = "path/to/file.py:ClassName"``.

The class subclasses :class:`~digenrl.algorithms.base.Algorithm` and is built as the built-ins are,
``ClassName(cfg, model, trains)``, in every process that trains or samples (``examples/algorithms/reward_weighted.py``;
docs/algorithms.md). The spelling, and which processes may import the file (those whose own config names it,
those their driver launched with it, a joined worker with ``--allow-algorithm``): :mod:`digenrl.usercode`.
"""

from __future__ import annotations

from digenrl import usercode
from digenrl.algorithms.base import Algorithm
from digenrl.errors import ConfigError

__all__ = ["allow_user_algorithm", "user_algorithm_class"]

_KEY = "train.algorithm"
_WHAT = "Algorithm subclass"


def allow_user_algorithm(spec: str, key: str = "--allow-algorithm") -> str:
    """Let this process import the algorithm ``"path/to/file.py:ClassName"``; returns it resolved.

    Raises:
        ConfigError: ``spec`` not spelled ``path.py:ClassName`` (naming ``key``).
    """
    return usercode.allow(spec, key, _WHAT)


def user_algorithm_class(spec: str) -> type[Algorithm]:
    """The :class:`Algorithm` subclass ``"path/to/file.py:ClassName"`` names, imported (once allowed).

    Raises:
        ConfigError: naming ``train.algorithm``: spelling, missing file, not allowed in this process, import
            failure, no such class, not an Algorithm subclass.
    """
    cls, _ = usercode.load_class(spec, _KEY, _WHAT, "--allow-algorithm")
    if not issubclass(cls, Algorithm):
        raise ConfigError(f"{_KEY}: {spec} is not a subclass of digenrl.algorithms.Algorithm "
                          "(docs/algorithms.md, 'Adding an algorithm')")
    return cls
