"""The wire codec: a msgpack header frame plus one raw frame per (large) tensor. Never pickle.

Wire format, protocol version 1 (``PROTOCOL_VERSION``)::

    frame 0      msgpack array [version, n_payload_frames, header, payload]
    frame 1..n   raw little-endian tensor bytes (or a chunk of them), referenced from frame 0

``header`` is a plain msgpack map with str keys. ``payload`` is any nesting of dict / list / tuple /
str / int / float / bool / None / bytes / ``torch.Tensor``. Non-native values become msgpack
extension types so user data can never be mistaken for them:

* ``EXT_TENSOR`` (1): ``[dtype, shape, ref]`` where ``ref`` is
    - ``bytes``: the tensor's bytes inline (tensors up to ``inline_max_bytes``, and empty tensors),
    - ``int``: the index of the frame holding all its bytes (zero-copy on both sides),
    - ``[start, count]``: the bytes split over ``count`` consecutive frames (``chunk_bytes``),
    - ``{"kind": ..., ...}``: a transport handle (shared memory, CUDA IPC) that the receiving
      transport resolves through the ``resolve`` callback of :func:`decode`.
* ``EXT_TUPLE`` (2): a msgpack array that decodes to a ``tuple``.
* ``EXT_BLOB`` (3): ``bytes`` larger than ``inline_max_bytes``, sent as one frame index.

Zero copy: contiguous CPU tensors are sent as ``memoryview``s of their own storage (the caller must
not mutate them until the transport says the send is done). Received tensors are ``torch.frombuffer``
views of writable received frames (``zmq.Frame``, ``bytearray``); read-only frames (``bytes``) are
copied once so the tensor is writable. Chunked tensors are reassembled with one copy.

Every malformed, truncated, oversized or wrong-version input makes :func:`decode` raise
:class:`~digenrl.errors.ProtocolError` naming the problem; nothing else escapes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from digenrl.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "CodecOptions",
    "DEFAULT_OPTIONS",
    "DTYPES",
    "Offload",
    "Resolve",
    "encode",
    "decode",
    "frame_nbytes",
]

PROTOCOL_VERSION = 1
EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_BLOB = 3
_MAX_NDIM = 64
_MAX_DEPTH = 64

# Short wire names; only these dtypes cross the wire.
DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Raw bytes <-> tensors through numpy: one numpy view costs a fraction of a torch op (each torch
# call is a dispatch, ~1-2 us here; a 16 KiB latent took 4 of them each way). numpy has no
# bfloat16, so it travels as int16 bits and is viewed back by torch.
_NUMPY: dict[torch.dtype, Any] = {t: np.dtype(n) for t, n in (
    (torch.float64, "f8"), (torch.float32, "f4"), (torch.float16, "f2"), (torch.int64, "i8"), (torch.int32, "i4"),
    (torch.int16, "i2"), (torch.int8, "i1"), (torch.uint8, "u1"), (torch.bool, "?"), (torch.bfloat16, "i2"))}

# A transport may replace a tensor by a handle (shared memory, CUDA IPC): offload returns a
# msgpack-able dict with a "kind" key, or None to use frames; resolve turns it back into a tensor.
Offload = Callable[[torch.Tensor], "dict[str, Any] | None"]
Resolve = Callable[[torch.dtype, "tuple[int, ...]", "dict[str, Any]"], torch.Tensor]


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """Size knobs and limits of the codec; both ends should use the same limits.

    Attributes:
        inline_max_bytes: tensors/bytes up to this size travel inside the header frame.
        chunk_bytes: split larger tensors into frames of at most this many bytes (None: one frame).
        max_frames: the most payload frames one message may have.
        max_header_bytes: the largest header frame (frame 0) accepted.
        max_total_bytes: the largest message (all frames) accepted or produced.
    """

    inline_max_bytes: int = 1024
    chunk_bytes: int | None = None
    max_frames: int = 1 << 16
    max_header_bytes: int = 64 << 20
    max_total_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive or None, got {self.chunk_bytes}")
        if min(self.max_frames, self.max_header_bytes, self.max_total_bytes) <= 0:
            raise ValueError("codec limits must be positive")


DEFAULT_OPTIONS = CodecOptions()


def frame_nbytes(frame: Any) -> int:
    """Size in bytes of one frame (bytes, bytearray, memoryview, numpy array or ``zmq.Frame``)."""
    return _view(frame).nbytes


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame exposes its memory as .buffer
    mv = buf if isinstance(buf, memoryview) else memoryview(frame)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


# ---------------------------------------------------------------------------------------- encode


class _Encoder:
    def __init__(self, options: CodecOptions, offload: Offload | None) -> None:
        self.options = options
        self.offload = offload
        self.frames: list[Any] = []
        self.total = 0

    # ``path`` is ``(parent_path, key)`` chained from a root name and only rendered into text for an
    # error: building f-strings for every key made encoding a small header 5x slower than msgpack.
    def convert(self, obj: Any, path: Any) -> Any:
        if obj is None or type(obj) in _SCALARS or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            return {self.key(k, path): self.convert(v, (path, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.convert(v, (path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.convert(v, (path, i)) for i, v in enumerate(obj)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
        if isinstance(obj, (bytes, bytearray, memoryview)):
            mv = _view(obj)
            if mv.nbytes <= self.options.inline_max_bytes:
                return bytes(mv)
            return msgpack.ExtType(EXT_BLOB, msgpack.packb(self.add_frame(mv)))
        raise TypeError(f"cannot encode {type(obj).__name__} at {_render(path)}: only dict/list/tuple/str/int/"
                        "float/bool/None/bytes/torch.Tensor cross the wire (no pickle)")

    def key(self, k: Any, path: Any) -> Any:
        if type(k) is str or (isinstance(k, (str, int)) and not isinstance(k, bool)):
            return k
        raise TypeError(f"cannot encode dict key {k!r} at {_render(path)}: keys must be str or int")


    def add_frame(self, mv: memoryview) -> int:
        self.frames.append(mv)
        self.total += mv.nbytes
        return len(self.frames)  # frame 0 is the header, so payload frames count from 1

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"cannot encode tensor of dtype {t.dtype}; supported: {sorted(DTYPES)}")
        shape = list(t.shape)
        ref: Any = None
        if self.offload is not None:
            ref = self.offload(t)
        if ref is None:
            ref = self.tensor_bytes(t)
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, shape, ref], use_bin_type=True))

    def tensor_bytes(self, t: torch.Tensor) -> Any:
        nbytes = t.nbytes
        if t.is_cpu and not t.requires_grad and t.is_contiguous():  # the usual case: numpy views only
            arr = (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)
        else:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()  # host staging; device-direct transports offload before we get here
            arr = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        if nbytes <= self.options.inline_max_bytes:
            return arr.tobytes()
        mv = memoryview(arr)
        chunk = self.options.chunk_bytes
        if chunk is None or nbytes <= chunk:
            return self.add_frame(mv)
        start = len(self.frames) + 1
        for off in range(0, nbytes, chunk):
            self.add_frame(mv[off : off + chunk])
        return [start, len(self.frames) + 1 - start]


_SCALARS = frozenset({str, int, float, bool})


def _plain_header(header: dict[str, Any]) -> bool:
    for k, v in header.items():
        if type(k) is not str or (v is not None and type(v) not in _SCALARS):
            return False
    return True


def _render(path: Any) -> str:
    """``(("payload", "a"), 1)`` -> ``payload['a'][1]``."""
    keys: list[Any] = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key!r}]" if isinstance(key, str) else f"[{key}]")
    return str(path) + "".join(reversed(keys))

def encode(
    header: dict[str, Any],
    payload: Any = None,
    *,
    options: CodecOptions = DEFAULT_OPTIONS,
    offload: Offload | None = None,
) -> list[Any]:
    """Encode a header and payload into frames: ``[header_bytes, *tensor_frames]``.

    Args:
        header: a msgpack-able dict with str keys (no tensors).
        payload: nested containers of msgpack values, bytes and tensors.
        options: inline threshold, chunk size and limits.
        offload: optional transport hook that replaces a tensor by a handle dict.

    Returns:
        The frames; payload frames are zero-copy memoryviews of the tensors' storage.

    Raises:
        TypeError: the header or payload holds a type that cannot cross the wire.
        ProtocolError: the message exceeds ``options``' size limits.
    """
    if not isinstance(header, dict):
        raise TypeError(f"header must be a dict, got {type(header).__name__}")
    if payload is None and _plain_header(header):
        # Header only (most control messages): no frames to collect, nothing to convert.
        head = msgpack.packb([PROTOCOL_VERSION, 0, header, None], use_bin_type=True)
        _check_limits(len(head), 0, len(head), options, "encode")
        return [head]
    enc = _Encoder(options, offload)
    if _plain_header(header):
        wire_header: Any = header  # the usual header (str keys, scalar values) goes to msgpack as is
    else:
        for k in header:
            if not isinstance(k, str):
                raise TypeError(f"header keys must be str, got {k!r}")
        wire_header = enc.convert(header, "header")
        if enc.frames:
            raise TypeError("header must not contain tensors or large bytes; put them in the payload")
    wire_payload = None if payload is None else enc.convert(payload, "payload")
    head = msgpack.packb([PROTOCOL_VERSION, len(enc.frames), wire_header, wire_payload], use_bin_type=True)
    _check_limits(len(head), len(enc.frames), enc.total + len(head), options, "encode")
    return [head, *enc.frames]


def _check_limits(head: int, nframes: int, total: int, options: CodecOptions, where: str) -> None:
    if head > options.max_header_bytes:
        raise ProtocolError(f"{where}: header frame is {head} bytes, over max_header_bytes={options.max_header_bytes}",
                            reason="oversized")
    if nframes > options.max_frames:
        raise ProtocolError(f"{where}: {nframes} payload frames, over max_frames={options.max_frames}",
                            reason="oversized")
    if total > options.max_total_bytes:
        raise ProtocolError(f"{where}: message is {total} bytes, over max_total_bytes={options.max_total_bytes}",
                            reason="oversized")


# ---------------------------------------------------------------------------------------- decode


class _Decoder:
    def __init__(self, views: list[memoryview], resolve: Resolve | None, max_bytes: int) -> None:
        self.views = views  # views[0] is the header frame
        self.resolve = resolve
        self.max_bytes = max_bytes
        self.depth = 0

    def unpack(self, data: bytes | memoryview) -> Any:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=self.ext_hook, use_list=True)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:
            # Each tuple level recurses through msgpack's C unpacker: bound it before the C stack.
            if self.depth >= _MAX_DEPTH:
                raise ProtocolError(f"payload nests tuples deeper than {_MAX_DEPTH} levels")
            self.depth += 1
            try:
                items = self.unpack(data)
            finally:
                self.depth -= 1
            if not isinstance(items, list):
                raise ProtocolError(f"tuple extension holds {type(items).__name__}, expected an array")
            return tuple(items)
        if code == EXT_TENSOR:
            return self.tensor(data)
        if code == EXT_BLOB:
            idx = msgpack.unpackb(data)
            return bytes(self.frame(idx, "blob"))
        raise ProtocolError(f"unknown msgpack extension type {code}")

    def frame(self, idx: Any, what: str) -> memoryview:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 1 <= idx < len(self.views):
            raise ProtocolError(f"{what} refers to frame {idx!r}, but the message has payload frames "
                                f"1..{len(self.views) - 1}")
        return self.views[idx]

    def tensor(self, data: bytes) -> torch.Tensor:
        rec = msgpack.unpackb(data, raw=False)
        if not isinstance(rec, list) or len(rec) != 3:
            raise ProtocolError(f"tensor record must be [dtype, shape, ref], got {rec!r:.80}")
        name, shape, ref = rec
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise ProtocolError(f"tensor dtype {name!r:.40} is not one of {sorted(DTYPES)}")
        shape = _check_shape(shape)
        nbytes = math.prod(shape) * _itemsize(dtype)
        if nbytes > self.max_bytes:
            raise ProtocolError(f"{name} tensor of shape {list(shape)} declares {nbytes} bytes, over "
                                f"max_total_bytes={self.max_bytes}")
        if isinstance(ref, dict):
            return self.handle(dtype, shape, ref)
        if isinstance(ref, bytes):
            _check_size(len(ref), nbytes, "inline tensor bytes", shape, name)
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            return _from_buffer(bytearray(ref), dtype, shape)
        if isinstance(ref, list):
            return self.chunked(ref, dtype, shape, nbytes, name)
        mv = self.frame(ref, "tensor")
        _check_size(mv.nbytes, nbytes, f"frame {ref}", shape, name)
        if mv.readonly:
            mv = memoryview(bytearray(mv))
        return _from_buffer(mv, dtype, shape)

    def chunked(self, ref: list[Any], dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, name: str) -> torch.Tensor:
        if len(ref) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in ref) or ref[1] < 1:
            raise ProtocolError(f"chunked tensor ref must be [start_frame, count>=1], got {ref!r:.80}")
        start, count = ref
        if not (1 <= start and start + count <= len(self.views)):
            raise ProtocolError(f"chunked tensor spans frames {start}..{start + count - 1}, but the message "
                                f"has payload frames 1..{len(self.views) - 1}")
        chunks = self.views[start : start + count]
        _check_size(sum(c.nbytes for c in chunks), nbytes, f"frames {start}..{start + count - 1}", shape, name)
        out = torch.empty(nbytes, dtype=torch.uint8)
        off = 0
        for c in chunks:
            if c.nbytes:
                out[off : off + c.nbytes].copy_(torch.frombuffer(c if not c.readonly else bytearray(c), dtype=torch.uint8))
            off += c.nbytes
        return out.view(dtype).reshape(shape)

    def handle(self, dtype: torch.dtype, shape: tuple[int, ...], ref: dict[str, Any]) -> torch.Tensor:
        kind = ref.get("kind")
        if self.resolve is None:
            raise ProtocolError(f"tensor handle of kind {kind!r:.40} cannot be resolved by this receiver")
        return self.resolve(dtype, shape, ref)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
        raise ProtocolError(f"tensor shape must be a list of at most {_MAX_NDIM} ints, got {shape!r:.80}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0 or d >= 1 << 48:
            raise ProtocolError(f"tensor shape {shape!r:.80} has an invalid dimension {d!r:.20}")
    return tuple(shape)


def _check_size(got: int, want: int, what: str, shape: tuple[int, ...], name: str) -> None:
    if got != want:
        raise ProtocolError(f"{what} hold {got} bytes, but a {name} tensor of shape {list(shape)} needs {want}")


def _from_buffer(buf: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing the writable buffer ``buf`` (its size already checked)."""
    arr = np.frombuffer(buf, dtype=_NUMPY[dtype])
    if not arr.flags.aligned:  # torch.from_numpy refuses unaligned data; torch views it bytewise
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    out = torch.from_numpy(arr.reshape(shape))
    return out.view(torch.bfloat16) if dtype is torch.bfloat16 else out


def decode(
    frames: Sequence[Any],
    *,
    options: CodecOptions = DEFAULT_OPTIONS,
    resolve: Resolve | None = None,
) -> tuple[dict[str, Any], Any]:
    """Decode frames made by :func:`encode` back into ``(header, payload)``.

    Args:
        frames: bytes, bytearray, memoryview or ``zmq.Frame`` objects; frame 0 is the header.
        options: the limits to enforce (use the sender's).
        resolve: transport hook for tensors sent as handles (shared memory, CUDA IPC).

    Returns:
        The header dict and the payload; tensors view the received frames where possible.

    Raises:
        ProtocolError: the frames are malformed, truncated, oversized or of another protocol version.
    """
    try:
        return _decode(frames, options, resolve)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack and torch raise many types on garbage; callers see one
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _decode(frames: Sequence[Any], options: CodecOptions, resolve: Resolve | None) -> tuple[dict[str, Any], Any]:
    if len(frames) == 0:
        raise ProtocolError("empty message: no header frame", reason="garbage")
    if len(frames) - 1 > options.max_frames:
        raise ProtocolError(f"{len(frames) - 1} payload frames, over max_frames={options.max_frames}",
                            reason="oversized")
    views = [_view(f) for f in frames]
    _check_limits(views[0].nbytes, len(views) - 1, sum(v.nbytes for v in views), options, "decode")
    try:
        top = msgpack.unpackb(views[0], raw=False, strict_map_key=False, use_list=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ProtocolError(f"header frame is not one msgpack value ({type(exc).__name__}: {exc})",
                            reason="garbage") from exc
    if not isinstance(top, list) or len(top) != 4:
        raise ProtocolError("header frame must be [version, n_frames, header, payload]", reason="garbage")
    if top[0] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {top[0]!r:.20}, this side speaks version {PROTOCOL_VERSION}",
                            reason="version")
    if top[1] != len(views) - 1:
        raise ProtocolError(f"header announces {top[1]!r:.20} payload frames but {len(views) - 1} arrived")
    if top[3] is None and type(top[2]) is dict and _plain_header(top[2]):
        return top[2], None  # header only: no extension can hide in str keys and scalar values
    # Unpack again with the extension hook now that the envelope is known to be sane.
    _, _, header, payload = _Decoder(views, resolve, options.max_total_bytes).unpack(views[0])
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise ProtocolError(f"header must be a map with str keys, got {type(header).__name__}")
    return header, payload
