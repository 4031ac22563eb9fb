"""torch.distributed lane: bucketed state-dict broadcast and point-to-point tensors.

Weights go to many rollout actors at once; a collective does that in one pass (gloo on CPU, NCCL
on GPU). Each collective call costs ~0.3-0.4 ms on gloo no matter how small, so a LoRA state
dict of 64 tensors broadcast one by one is ~100x slower than the same bytes flattened
(FEASIBILITY §5). Here tensors are grouped by dtype and packed into flat buckets of at most
``bucket_mb`` MiB (a tensor bigger than a bucket gets its own), one ``broadcast`` per bucket.

Layout travels first, without pickle: the source encodes ``[[name, dtype, shape], ...]`` with
msgpack and broadcasts its length (one int64) and its bytes (one uint8 tensor); receivers validate
it (``ProtocolError`` on anything malformed) and allocate the buckets. The same framing carries
point-to-point ``send_tensors`` / ``recv_tensors``.

Functions here are blocking collectives: every rank of the group must call them in the same
order. :class:`TorchDistTransport` wraps them for asyncio (they run in a worker thread, so the
actor's event loop keeps serving control messages) and adds a zmq endpoint for the small control
headers (who broadcasts which version when), so a transport can be passed wherever a
:class:`~digenrl.transport.base.Transport` is expected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, ClassVar

import msgpack
import torch
import torch.distributed as dist

from digenrl.errors import ProtocolError
from digenrl.transport.codec import DTYPES
from digenrl.transport.zmq import ZmqTransport

__all__ = ["TorchDistTransport", "broadcast_state_dict", "send_tensors", "recv_tensors", "plan_buckets"]

log = logging.getLogger(__name__)

_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_LAYOUT = 64 << 20


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_buckets(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[list[int]]:
    """Group entries of ``layout`` (by index) into per-dtype buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` is a bucket on its own; order within a dtype is kept.
    """
    buckets: list[list[int]] = []
    for dtype in dict.fromkeys(d for _, d, _ in layout):
        current: list[int] = []
        size = 0
        for i, (_, d, shape) in enumerate(layout):
            if d != dtype:
                continue
            n = _numel(shape) * dtype.itemsize
            if current and size + n > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            buckets.append(current)
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _send_layout_bcast(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], src: int, group: Any,
                       device: torch.device) -> None:
    blob = msgpack.packb([[k, _NAMES[d], list(s)] for k, d, s in layout], use_bin_type=True)
    dist.broadcast(torch.tensor([len(blob)], dtype=torch.int64, device=device), src, group=group)
    dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), src, group=group)


def _recv_layout_bcast(src: int, group: Any, device: torch.device) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    buf = torch.empty(_check_len(int(n)), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group=group)
    return _parse_layout(bytes(buf.cpu().numpy()))


def _check_len(n: int) -> int:
    if not 0 < n <= _MAX_LAYOUT:
        raise ProtocolError(f"state-dict layout announces {n} bytes; expected 1..{_MAX_LAYOUT}")
    return n


def _parse_layout(blob: bytes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    try:
        raw = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise ProtocolError(f"state-dict layout is not msgpack: {exc}") from exc
    if not isinstance(raw, list):
        raise ProtocolError("state-dict layout must be a list of [name, dtype, shape]")
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in DTYPES and isinstance(entry[2], list)
                and all(isinstance(d, int) and 0 <= d < 1 << 48 for d in entry[2])):
            raise ProtocolError(f"bad state-dict layout entry {entry!r:.80}")
        out.append((entry[0], DTYPES[entry[1]], tuple(entry[2])))
    return out


def _layout_of(sd: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or v.dtype not in _NAMES:
            raise TypeError(f"state dict entry {k!r} must be a tensor of dtype {sorted(DTYPES)}, got "
                            f"{getattr(v, 'dtype', type(v).__name__)}")
    return [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()]


def _flatten(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors]) if tensors else \
        torch.empty(0, dtype=dtype, device=device)


def _unflatten(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shapes:
        n = _numel(s)
        out.append(flat[off : off + n].view(s))
        off += n
    return out


def broadcast_state_dict(
    sd: Mapping[str, torch.Tensor] | None,
    src: int,
    group: Any = None,
    *,
    bucket_mb: float = 64,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Broadcast a state dict from rank ``src`` to every rank of ``group``, in dtype buckets.

    Args:
        sd: the state dict on ``src`` (ignored elsewhere; pass None).
        src: global rank of the source.
        group: process group (None: the default group).
        bucket_mb: bucket size in MiB; one collective per bucket.
        into: on receivers, optional tensors to copy the values into in place (same keys, shapes
            and dtypes), e.g. ``model.state_dict()``.

    Returns:
        On every rank, the state dict (views of the received buckets, or ``into``'s tensors).

    Raises:
        ProtocolError: the layout received is malformed.
        ValueError: ``into`` does not match the broadcast layout (names the key).
        TypeError: ``sd`` holds a non-tensor or an unsupported dtype.
    """
    device = _device(group)
    is_src = dist.get_rank() == src
    if is_src:
        if sd is None:
            raise TypeError("the source rank must pass its state dict")
        layout = _layout_of(sd)
        _send_layout_bcast(layout, src, group, device)
    else:
        layout = _recv_layout_bcast(src, group, device)
    values = list(sd.values()) if is_src and sd is not None else []
    result: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(layout, int(bucket_mb * (1 << 20))):
        dtype = layout[bucket[0]][1]
        shapes = [layout[i][2] for i in bucket]
        if is_src:
            flat = _flatten([values[i] for i in bucket], dtype, device)
        else:
            flat = torch.empty(sum(_numel(s) for s in shapes), dtype=dtype, device=device)
        dist.broadcast(flat, src, group=group)
        for i, t in zip(bucket, _unflatten(flat, shapes), strict=True):
            result[layout[i][0]] = values[i] if is_src else t
    ordered = {k: result[k] for k, _, _ in layout}
    if into is not None and not is_src:
        return _copy_into(ordered, into)
    return ordered


def _copy_into(got: dict[str, torch.Tensor], into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    missing = set(into) ^ set(got)
    if missing:
        raise ValueError(f"broadcast state dict and `into` differ in keys: {sorted(missing)[:5]}")
    for k, v in got.items():
        dst = into[k]
        if dst.shape != v.shape or dst.dtype != v.dtype:
            raise ValueError(f"key {k!r}: broadcast {v.dtype} {list(v.shape)} but `into` holds {dst.dtype} {list(dst.shape)}")
        with torch.no_grad():
            dst.copy_(v)
    return dict(into)


def send_tensors(tensors: Mapping[str, torch.Tensor], dst: int, group: Any = None) -> None:
    """Send named tensors to rank ``dst`` (layout, then one flat buffer per dtype).

    Raises:
        TypeError: a value is not a tensor of a supported dtype.
    """
    device = _device(group)
    layout = _layout_of(tensors)
    blob = msgpack.packb([[k, _NAMES[d], list(s)] for k, d, s in layout], use_bin_type=True)
    dist.send(torch.tensor([len(blob)], dtype=torch.int64, device=device), dst, group=group)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst, group=group)
    values = list(tensors.values())
    for dtype in dict.fromkeys(d for _, d, _ in layout):
        idx = [i for i, (_, d, _) in enumerate(layout) if d == dtype]
        dist.send(_flatten([values[i] for i in idx], dtype, device), dst, group=group)


def recv_tensors(src: int, group: Any = None) -> dict[str, torch.Tensor]:
    """Receive the named tensors that rank ``src`` sends with :func:`send_tensors`.

    Raises:
        ProtocolError: the layout received is malformed.
    """
    device = _device(group)
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group)
    buf = torch.empty(_check_len(int(n)), dtype=torch.uint8, device=device)
    dist.recv(buf, src, group=group)
    layout = _parse_layout(bytes(buf.cpu().numpy()))
    out: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(d for _, d, _ in layout):
        idx = [i for i, (_, d, _) in enumerate(layout) if d == dtype]
        flat = torch.empty(sum(_numel(layout[i][2]) for i in idx), dtype=dtype, device=device)
        dist.recv(flat, src, group=group)
        for i, t in zip(idx, _unflatten(flat, [layout[i][2] for i in idx]), strict=True):
            out[layout[i][0]] = t
    return {k: out[k] for k, _, _ in layout}


class TorchDistTransport(ZmqTransport):
    """A zmq endpoint for control headers plus a torch.distributed group for bulk tensors.

    Args:
        address: the zmq address for control messages (see ``ZmqTransport``).
        rank, world_size: this process's rank and the group size.
        init_method: rendezvous URL, e.g. ``tcp://127.0.0.1:29500`` (loopback by default).
        backend: "gloo", "nccl", or None for NCCL when CUDA is available, else gloo.
        timeout_s: collective timeout.
        **kwargs: passed to ``ZmqTransport``.

    Raises:
        ValueError: a process group already exists in this process with another world size.
    """

    kind: ClassVar[str] = "torchdist"

    def __init__(self, address: str | None = None, *, rank: int, world_size: int,
                 init_method: str = "tcp://127.0.0.1:29500", backend: str | None = None,
                 timeout_s: float = 120.0, **kwargs: Any) -> None:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        elif dist.get_world_size() != world_size:
            raise ValueError(f"a process group of size {dist.get_world_size()} exists; asked for {world_size}")
        self.rank = rank
        self.world_size = world_size
        try:
            super().__init__(address, **kwargs)
        except BaseException:
            self._destroy_group()
            raise

    async def broadcast_state_dict(self, sd: Mapping[str, torch.Tensor] | None, src: int, *,
                                   bucket_mb: float = 64, into: Mapping[str, torch.Tensor] | None = None
                                   ) -> dict[str, torch.Tensor]:
        """:func:`broadcast_state_dict` on the default group, off the event loop."""
        return await asyncio.to_thread(broadcast_state_dict, sd, src, None, bucket_mb=bucket_mb, into=into)

    async def send_tensors(self, tensors: Mapping[str, torch.Tensor], dst_rank: int) -> None:
        """:func:`send_tensors` to ``dst_rank``, off the event loop."""
        await asyncio.to_thread(send_tensors, tensors, dst_rank)

    async def recv_tensors(self, src_rank: int) -> dict[str, torch.Tensor]:
        """:func:`recv_tensors` from ``src_rank``, off the event loop."""
        return await asyncio.to_thread(recv_tensors, src_rank)

    def _destroy_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    async def aclose(self) -> None:
        """Close the zmq endpoint and destroy the process group if this transport created it."""
        await super().aclose()
        self._destroy_group()
