"""Shared test configuration: one torch thread per test process, and a GPU marker helper."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")

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
