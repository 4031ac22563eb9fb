"""A process's peak memory, as measured (beside what the memory plan predicts for its role).

On CUDA the caching allocator's peaks on the process's device: ``allocated`` (what tensors held at
most, the quantity ``digenrl plan`` predicts) and ``reserved`` (what the allocator kept from the
driver, fragmentation included). The CUDA context itself (~0.5 GB) is outside both; the plan keeps
``RESERVE_BYTES`` per process for it. On the CPU the process's peak resident set, which also counts
the interpreter and the libraries: not comparable with the plan's tensor bytes, reported as such.
"""

from __future__ import annotations

import resource
from typing import Any

import torch

__all__ = ["peak_memory"]


def peak_memory(device: str) -> dict[str, Any]:
    """``{"device", "allocated", "reserved"}`` in bytes on ``cuda``; ``{"device": "cpu", "rss"}`` otherwise."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        return {"device": str(dev), "allocated": torch.cuda.max_memory_allocated(dev),
                "reserved": torch.cuda.max_memory_reserved(dev)}
    return {"device": "cpu", "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
