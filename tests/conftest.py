"""Shared test configuration: one torch thread per test process, and a GPU marker helper."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def gpu_test(n: int = 1) -> pytest.MarkDecorator:
    """Skip unless ``n`` CUDA devices are present."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} CUDA device(s), found {count}")
