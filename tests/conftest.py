"""Shared test configuration: one torch thread per test process, a GPU marker helper, and how tests start
child Python processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)


def gpu_marks(n: int = 1) -> list[pytest.MarkDecorator]:
    """The marks of a test that needs ``n`` CUDA devices: ``gpu`` (``multi_gpu`` too for n >= 2), and a
    skip with the reason unless ``n`` devices are present. For ``pytest.param(..., marks=gpu_marks(2))``."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    marks = [pytest.mark.gpu, pytest.mark.skipif(count < n, reason=f"needs {n} CUDA device(s), found {count}")]
    return marks + [pytest.mark.multi_gpu] if n >= 2 else marks


def gpu_test(n: int = 1) -> Callable[[T], T]:
    """Decorate a test that needs ``n`` CUDA devices (``pytest -m gpu`` lists it; it skips cleanly here)."""
    def apply(obj: T) -> T:
        for mark in gpu_marks(n):
            obj = mark(obj)
        return obj

    return apply


def child_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child Python process, plus ``extra`` variables.

    ``paths`` and the project root go *ahead of* the inherited ``PYTHONPATH``, never instead of it: where
    this interpreter's packages come from (a venv, a ``pip --target`` directory on ``PYTHONPATH`` as on the
    GPU machine, a system install) is not a test's business, and a child must import what we import.
    """
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*map(str, paths), str(ROOT), *inherited]))
    return env


def digenrl_command(*args: str) -> list[str]:
    """argv of the ``digenrl`` command run by this interpreter (its console script need not sit beside
    ``sys.executable``: a ``pip --target`` install puts it elsewhere)."""
    return [sys.executable, "-m", "digenrl_cli.main", *args]
