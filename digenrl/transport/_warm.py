"""Warm host buffers for copies: a buffer is reused once every view of its last copy is gone.

Why: copying 64 MiB into a fresh allocation (``bytearray``, ``torch.empty``) runs at a fraction of
memcpy speed, because the allocator maps new pages for every large block and each first touch
faults (on this class of VM ~0.1 of a warm memcpy). Copying into a buffer whose pages are already
mapped runs at memcpy speed.

Rule (the ownership contract, tested): :meth:`WarmBuffers.copy` returns a numpy view of a pooled
buffer; the buffer goes back to the pool only when that view is garbage (a ``weakref.finalize`` on
it), i.e. when every tensor, memoryview or array the receiver made from it is gone. So a
receiver owns its copy for as long as it keeps any piece of it; nothing is ever overwritten under
a live reader. Buffers come in power-of-two size classes (only the pages a copy touches are ever
faulted in); at most ``max_bytes`` of free buffers are kept, copies beyond that use plain
allocations. Thread-safe: a finalizer may run on whichever thread drops the last view.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["WarmBuffers"]


class WarmBuffers:
    """A pool of reusable host buffers (see the module docstring).

    Args:
        min_bytes: copies smaller than this use a plain ``bytearray`` (the allocator recycles
            small blocks well already).
        max_bytes: the most memory kept in free buffers.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, max_bytes: int = 1 << 30) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}  # size class -> free buffers
        self._free_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.reused = 0  # copies that landed in a warm buffer
        self.allocated = 0  # pooled buffers created

    def copy(self, src: Any) -> Any:
        """A private copy of ``src`` (anything with the buffer protocol), in a warm buffer if one is free."""
        mv = memoryview(src).cast("B")
        n = mv.nbytes
        if n < self.min_bytes:
            return bytearray(mv)
        size = 1 << (n - 1).bit_length()
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= size
                self.reused += 1
            else:
                self.allocated += 1
        if buf is None:
            buf = np.empty(size, dtype=np.uint8)
        view = buf[:n]
        np.copyto(view, np.frombuffer(mv, dtype=np.uint8))
        weakref.finalize(view, self._give_back, buf)
        return view

    def _give_back(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        with self._lock:
            if self._closed or self._free_bytes + size > self.max_bytes:
                return  # dropped: the allocator takes it back
            self._free.setdefault(size, []).append(buf)
            self._free_bytes += size

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        """Drop every free buffer; buffers still viewed are dropped when their views go."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._free_bytes = 0
