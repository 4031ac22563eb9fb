"""Tensor encodings for slow links: lossy weight deltas, lossless and bf16 samples (pure; never pickle).

Every ``encode_*`` returns a plain dict of str / int / tensors (what :mod:`~digenrl.transport.codec` carries) and
every ``decode_*`` validates what arrived and raises :class:`~digenrl.errors.ProtocolError` naming the problem.

Weight deltas (a flat float tensor ``d``, decoded to float32):

* ``int8``: per block of ``QUANT_BLOCK`` elements, ``scale = max|d| / 127`` and ``q = round(d / scale)``: one byte
  per element plus 4 per block, and ``|d - decode| <= scale / 2`` element-wise.
* ``topk``: the ``k = ceil(fraction * n)`` entries of largest ``|d|`` as an int32 index and an int8 value (the
  values quantised as above): 5 bytes per kept entry; the rest decode to zero. The sender's error feedback
  carries what was left out, and the values' rounding, into the next delta.

``add_delta(base, enc)`` is the one reconstruction both sides run, so the sender's copy of the receiver's weights
and the receiver's own agree bit for bit (separate multiply and add kernels: no fused rounding on one side only).

Samples (any tensor): ``lossless`` shuffles the byte planes (each element's k-th byte together: a float's sign and
exponent bytes repeat, its low mantissa bytes do not) and deflates them with zlib, restored bit for bit; ``bf16``
rounds a float tensor to bfloat16 (relative error <= 2^-8) and names the dtype it had.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import torch

from digenrl.errors import ProtocolError
from digenrl.transport.codec import DTYPES

__all__ = ["QUANT_BLOCK", "DELTA_METHODS", "encode_delta", "decode_delta", "add_delta", "encoded_nbytes",
           "pack_tensor", "unpack_tensor", "is_packed"]

QUANT_BLOCK = 4096  # elements per int8 scale (0.1 % overhead; an outlier costs only its own block's precision)
DELTA_METHODS = ("int8", "topk")
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_ELEMENTS = 1 << 40
_ZLIB_LEVEL = 1  # fast: at a few hundred MB/s it keeps up with the links that call for it


def encode_delta(delta: torch.Tensor, method: str, topk_fraction: float = 0.01) -> dict[str, Any]:
    """Encode a flat float delta with ``method`` (``int8`` or ``topk``).

    Raises:
        ValueError: an unknown method, a tensor that is not flat and floating, or a fraction outside (0, 1].
    """
    if delta.ndim != 1 or not delta.is_floating_point():
        raise ValueError(f"encode_delta: expected a flat float tensor, got {delta.dtype} of shape {tuple(delta.shape)}")
    d = delta.detach().float()
    n = d.numel()
    if method == "int8":
        return {"m": "int8", "n": n, **_quantise(d)}
    if method == "topk":
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError(f"encode_delta: topk_fraction must be in (0, 1], got {topk_fraction}")
        k = min(n, math.ceil(topk_fraction * n))
        index = torch.topk(d.abs(), k, sorted=False).indices if k else torch.zeros(0, dtype=torch.int64)
        index, _ = torch.sort(index)  # ascending indices: the receiver's scatter reads memory in order
        return {"m": "topk", "n": n, "i": index.to(torch.int32 if n < 1 << 31 else torch.int64), **_quantise(d[index])}
    raise ValueError(f"encode_delta: unknown method {method!r} (one of {', '.join(DELTA_METHODS)})")


def _quantise(d: torch.Tensor) -> dict[str, torch.Tensor]:
    """int8 per block of QUANT_BLOCK: ``{"q": int8 [n], "s": float32 [blocks]}``."""
    n = d.numel()
    blocks = torch.nn.functional.pad(d, (0, -n % QUANT_BLOCK)).view(-1, QUANT_BLOCK)
    amax = blocks.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return {"q": q.contiguous(), "s": scale}


def _dequantise(enc: dict[str, Any], n: int) -> torch.Tensor:
    q, s = _tensor(enc, "q", (torch.int8,)), _tensor(enc, "s", (torch.float32,))
    if q.numel() != n or s.numel() != -(-n // QUANT_BLOCK):
        raise ProtocolError(f"weights delta: int8 sizes q={q.numel()} s={s.numel()} do not fit {n} values")
    padded = torch.nn.functional.pad(q, (0, -n % QUANT_BLOCK)).view(-1, QUANT_BLOCK)
    return (padded.float() * s[:, None]).view(-1)[:n]


def decode_delta(enc: Any, numel: int) -> torch.Tensor:
    """The float32 delta of ``numel`` elements that :func:`encode_delta` encoded.

    Raises:
        ProtocolError: a malformed encoding, or one of another size (names the field).
    """
    method = enc.get("m") if isinstance(enc, dict) else None
    if method not in DELTA_METHODS or enc.get("n") != numel:
        raise ProtocolError(f"weights delta: expected an int8 / topk encoding of {numel} elements, got "
                            f"method {method!r} of {enc.get('n') if isinstance(enc, dict) else None!r}")
    if method == "int8":
        return _dequantise(enc, numel)
    index = _tensor(enc, "i", (torch.int32, torch.int64))
    values = _dequantise(enc, index.numel())
    if index.numel() > numel or (index.numel() and not 0 <= int(index.min()) <= int(index.max()) < numel):
        raise ProtocolError(f"weights delta: topk indices do not fit {numel} elements")
    out = torch.zeros(numel, dtype=torch.float32)
    out[index.long()] = values
    return out


def add_delta(base: torch.Tensor, enc: dict[str, Any]) -> torch.Tensor:
    """``base + decode(enc)`` in float32, rounded to ``base``'s dtype (the reconstruction both sides run).

    ``enc = {"m": "set", "t": tensor}`` replaces a bucket that is not floating (sent as it is).

    Raises:
        ProtocolError: the encoding does not fit ``base``.
    """
    if isinstance(enc, dict) and enc.get("m") == "set":
        t = _tensor(enc, "t", (base.dtype,))
        if t.shape != base.shape:
            raise ProtocolError(f"weights delta: a replaced bucket of shape {tuple(t.shape)} for {tuple(base.shape)}")
        return t.clone()
    if not base.is_floating_point():
        raise ProtocolError(f"weights delta: a {base.dtype} bucket can only be replaced ('set'), not added to")
    return (base.float() + decode_delta(enc, base.numel())).to(base.dtype)


def encoded_nbytes(obj: Any) -> int:
    """Bytes of the tensors in an encoding (any nesting of dicts and lists): what crosses the link."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(encoded_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(encoded_nbytes(v) for v in obj)
    return 0


def pack_tensor(t: torch.Tensor, method: str) -> dict[str, Any]:
    """``t`` as a ``lossless`` (byte-shuffled zlib) or ``bf16`` packet; :func:`unpack_tensor` restores it.

    Raises:
        ValueError: an unknown method, or ``bf16`` of a tensor that is not floating.
    """
    t = t.detach().cpu().contiguous()
    head = {"zc": method, "dt": _NAMES[t.dtype], "sh": list(t.shape)}
    if method == "bf16":
        if not t.is_floating_point():
            raise ValueError(f"pack_tensor: bf16 rounds float tensors only, got {t.dtype}")
        return {**head, "b": t.to(torch.bfloat16)}
    if method != "lossless":
        raise ValueError(f"pack_tensor: unknown method {method!r} (lossless or bf16)")
    planes = t.reshape(-1).view(torch.uint8).numpy().reshape(-1, t.element_size()).T
    raw = zlib.compress(np.ascontiguousarray(planes).tobytes(), _ZLIB_LEVEL)
    return {**head, "b": torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)}


def is_packed(obj: Any) -> bool:
    """Whether ``obj`` is a packet of :func:`pack_tensor` (a dict with its marker key)."""
    return isinstance(obj, dict) and "zc" in obj


def unpack_tensor(packet: Any) -> torch.Tensor:
    """The tensor :func:`pack_tensor` packed (``bf16``: rounded, in its original dtype).

    Raises:
        ProtocolError: a malformed packet, a bad dtype or shape, or zlib data that does not inflate to exactly
            the size the shape says (never inflated beyond it).
    """
    if not is_packed(packet) or packet["zc"] not in ("lossless", "bf16") or packet.get("dt") not in DTYPES:
        raise ProtocolError(f"samples: not a lossless / bf16 packet: {str(packet)[:80]}")
    shape, dtype = _shape(packet.get("sh")), DTYPES[packet["dt"]]
    if packet["zc"] == "bf16":
        b = _tensor(packet, "b", (torch.bfloat16,))
        if not dtype.is_floating_point or b.shape != shape:
            raise ProtocolError(f"samples: a bf16 packet of shape {tuple(b.shape)} for {packet['dt']} {list(shape)}")
        return b.to(dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    want = math.prod(shape) * itemsize
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(_tensor(packet, "b", (torch.uint8,)).numpy().tobytes(), want + 1)
    except zlib.error as exc:
        raise ProtocolError(f"samples: a lossless packet's zlib data is corrupt ({exc})") from exc
    if len(raw) != want or not inflate.eof:
        raise ProtocolError(f"samples: a lossless packet inflates to {len(raw)}+ bytes, its shape says {want}")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1).T
    return torch.from_numpy(np.array(planes, order="C").reshape(-1)).view(dtype).reshape(shape)  # a writable copy


def _tensor(enc: dict[str, Any], key: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    t = enc.get(key)
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise ProtocolError(f"compressed tensor: field {key!r} must be a tensor of {[str(d) for d in dtypes]}, "
                            f"got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.reshape(-1) if key != "b" else t


def _shape(shape: Any) -> torch.Size:
    if not isinstance(shape, list) or len(shape) > 64 or not all(isinstance(s, int) and s >= 0 for s in shape) or \
            math.prod(shape) > _MAX_ELEMENTS:
        raise ProtocolError(f"samples: a packet's shape must be a list of sizes >= 0, got {shape!r:.80}")
    return torch.Size(shape)
