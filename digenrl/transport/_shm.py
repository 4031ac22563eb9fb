"""Same-host shared-memory lane for large tensors (used by ``ZmqTransport``).

Why: on this class of VM a fresh page costs far more than copying into a warm one (fresh
``torch.empty`` + copy ran at ~0.75 GB/s against ~4.4 GB/s for a warm memcpy), and a zmq receive
always lands in a fresh buffer. So large tensors go through *reused, pre-faulted* shared-memory
segments instead: the sender copies the message's large tensors into one segment (one warm
memcpy), the zmq message carries only a small handle, and the receiver returns zero-copy tensor
views of its cached mapping of that segment.

Segment protocol (one pool per sender endpoint and destination):
  * A segment is a file in ``/dev/shm`` named ``digenrl-<pid>-<hex>``; its first ``_HDR`` bytes
    hold a state byte: ``FREE`` (0) or ``BUSY`` (1).
  * The sender picks a FREE segment big enough (or creates one, power-of-two size, pre-faulted),
    marks it BUSY, copies the tensors in at 64-byte aligned offsets (as fast as a memcpy into a warm
    buffer: ``bench/shm_profile.py``) and sends handles
    ``{"kind": "shm", "seg": id, "off": o, "n": nbytes[, "name": name]}``; ``name`` only on a
    segment's first use with that destination.
  * The receiver maps a named segment once, unlinks the name (so nothing leaks once mapped) and
    caches the mapping by ``(src, seg)``. Tensors of one message view one numpy array over the
    segment; a ``weakref.finalize`` on that array writes FREE when the last tensor is gone.
  * When the pool is full and no segment is FREE, the sender falls back to zmq frames (counted in
    ``stats["shm_fallback"]``). When the destination dies, the sender unlinks and drops its pool.

Limits: both ends must see the same ``/dev/shm`` (same host, same container); ``ZmqTransport``
enables this lane automatically only for ``ipc://`` and loopback ``tcp://`` destinations.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from digenrl.errors import ProtocolError

__all__ = ["ShmPool", "ShmReader", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_HDR = 64
_ALIGN = 64
_FREE, _BUSY = 0, 1
_NAME_RE = re.compile(r"^digenrl-\d+-[0-9a-f]{32}$")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(slots=True)
class _Segment:
    seg_id: int
    name: str
    mm: mmap.mmap
    size: int  # usable bytes after the header
    announced: bool = False

    def free(self) -> bool:
        return self.mm[0] == _FREE


@dataclass
class ShmPool:
    """The sender's pool of segments for one destination.

    Args:
        max_bytes: the most shared memory this pool may hold (segment sizes summed).
    """

    max_bytes: int
    segments: list[_Segment] = field(default_factory=list)
    next_id: int = 0

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)

    def acquire(self, nbytes: int) -> _Segment | None:
        """A BUSY-marked segment with at least ``nbytes`` usable bytes, or None if the pool is full."""
        fits = [s for s in self.segments if s.size >= nbytes and s.free()]
        if fits:
            seg = min(fits, key=lambda s: s.size)
        else:
            size = max(1 << 20, 1 << (nbytes - 1).bit_length())
            if self.nbytes + size > self.max_bytes:
                return None
            seg = self._create(size)
        seg.mm[0] = _BUSY
        return seg

    def _create(self, size: int) -> _Segment:
        name = f"digenrl-{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _HDR + size)
            # MAP_POPULATE pre-faults every page now, once, instead of on each first touch.
            mm = mmap.mmap(fd, _HDR + size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        seg = _Segment(self.next_id, name, mm, size)
        self.next_id += 1
        self.segments.append(seg)
        return seg

    def write(self, seg: _Segment, tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
        """Copy ``tensors`` (CPU) into ``seg`` and return their handles (in order)."""
        out = torch.frombuffer(seg.mm, dtype=torch.uint8)
        handles: list[dict[str, Any]] = []
        off = _HDR
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1)  # a strided tensor (even 1-D: x[::2]) is copied first
            n = flat.numel() * flat.element_size()
            out[off : off + n].copy_(flat.view(torch.uint8))
            h: dict[str, Any] = {"kind": "shm", "seg": seg.seg_id, "off": off, "n": n}
            if not seg.announced:
                h["name"] = seg.name
            handles.append(h)
            off += _align(n)
        del out  # drop the export so the mmap can be closed later
        seg.announced = True
        return handles

    def release(self, seg: _Segment) -> None:
        """Mark ``seg`` FREE again (the send failed before the receiver saw it)."""
        seg.mm[0] = _FREE

    def close(self, unlink: bool) -> None:
        """Unmap every segment; with ``unlink``, also remove names the receiver never mapped."""
        for seg in self.segments:
            if unlink:
                try:
                    os.unlink(os.path.join(SHM_DIR, seg.name))
                except FileNotFoundError:
                    pass  # the receiver mapped it and removed the name already
            try:
                seg.mm.close()
            except BufferError:
                pass  # a view is still exported; gc unmaps it later
        self.segments.clear()


def segment_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes a segment needs to hold ``tensors`` at aligned offsets."""
    return sum(_align(t.numel() * t.element_size()) for t in tensors)


class ShmReader:
    """The receiver's cache of mapped segments, keyed by ``(sender address, segment id)``."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, int], mmap.mmap] = {}

    def drop(self, src: str) -> None:
        """Forget ``src``'s segments; live tensors keep their mappings alive until gc."""
        for key in [k for k in self._maps if k[0] == src]:
            del self._maps[key]

    def clear(self) -> None:
        self._maps.clear()

    def resolver(self, src: str) -> _MessageResolver:
        """A ``codec.Resolve`` callable for one message from ``src``."""
        return _MessageResolver(self, src)

    def _map(self, src: str, seg: int, name: Any) -> mmap.mmap:
        key = (src, seg)
        if name is not None:
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise ProtocolError(f"shm segment name {name!r:.80} is not a digenrl segment name")
            path = os.path.join(SHM_DIR, name)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise ProtocolError(f"cannot open shm segment {path}: {exc.strerror} (is the sender on "
                                    "another host or container? configure shm=False)") from exc
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
                os.unlink(path)  # mapped now; the name is no longer needed by anyone
            self._maps[key] = mm
            return mm
        mm = self._maps.get(key)
        if mm is None:
            raise ProtocolError(f"shm segment {seg!r:.20} from {src} was never announced to this receiver")
        return mm


class _MessageResolver:
    """Resolves the shm handles of one message; its tensors share one array per segment."""

    def __init__(self, reader: ShmReader, src: str) -> None:
        self.reader = reader
        self.src = src
        self.arrays: dict[int, np.ndarray] = {}

    def __call__(self, dtype: torch.dtype, shape: tuple[int, ...], ref: dict[str, Any]) -> torch.Tensor:
        if ref.get("kind") != "shm":
            raise ProtocolError(f"tensor handle of kind {ref.get('kind')!r:.40} is not supported over zmq")
        seg, off, n = ref.get("seg"), ref.get("off"), ref.get("n")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (seg, off, n)):
            raise ProtocolError(f"shm handle needs int seg/off/n, got {ref!r:.120}")
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n != want:
            raise ProtocolError(f"shm handle holds {n} bytes, but a {dtype} tensor of shape {list(shape)} needs {want}")
        arr = self.arrays.get(seg)
        if arr is None:
            mm = self.reader._map(self.src, seg, ref.get("name"))
            arr = np.frombuffer(mm, dtype=np.uint8)
            # The sender may reuse the segment only once every tensor viewing it is gone.
            weakref.finalize(arr, _mark_free, mm)
            self.arrays[seg] = arr
        if off < _HDR or off + n > arr.nbytes:
            raise ProtocolError(f"shm handle [{off}, {off + n}) lies outside segment {seg} of {arr.nbytes} bytes")
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(arr[off : off + n], dtype=torch.uint8).view(dtype).reshape(shape)


def _mark_free(mm: mmap.mmap) -> None:
    if not mm.closed:
        mm[0] = _FREE
