"""Tensor encodings for slow links (digenrl/transport/compress.py) against independent numpy computations."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from digenrl.errors import ProtocolError
from digenrl.transport.codec import decode, encode
from digenrl.transport.compress import (QUANT_BLOCK, add_delta, decode_delta, encode_delta, encoded_nbytes,
                                        pack_tensor, unpack_tensor)


def _delta(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, generator=g) * 1e-3
    d[n // 3] = 0.5  # an outlier: it costs only its own block's precision
    return d


def _numpy_int8(d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 per block of QUANT_BLOCK: scale = max|d| / 127, q = round half to even (d / scale), decoded q * scale."""
    n = d.size
    blocks = np.concatenate([d, np.zeros(-n % QUANT_BLOCK, np.float32)]).reshape(-1, QUANT_BLOCK)
    amax = np.abs(blocks).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1)[:n], scale, (q.astype(np.float32) * scale[:, None]).reshape(-1)[:n]


@pytest.mark.parametrize("n", [1, QUANT_BLOCK, 3 * QUANT_BLOCK + 17])
def test_int8_delta_equals_numpy_and_is_within_half_a_step(n: int) -> None:
    d = _delta(n)
    enc = encode_delta(d, "int8")
    q, scale, decoded = _numpy_int8(d.numpy())
    assert np.array_equal(enc["q"].numpy(), q) and np.array_equal(enc["s"].numpy(), scale)
    out = decode_delta(enc, n)
    assert np.array_equal(out.numpy(), decoded)
    step = np.repeat(scale, QUANT_BLOCK)[:n]
    assert np.all(np.abs(out.numpy() - d.numpy()) <= step / 2 * (1 + 1e-6))
    assert encoded_nbytes(enc) == n + 4 * math.ceil(n / QUANT_BLOCK)  # one byte per element, one scale per block


def test_topk_delta_keeps_the_largest_entries_as_numpy_picks_them() -> None:
    n, frac = 10_000, 0.013
    d = _delta(n, seed=1)
    enc = encode_delta(d, "topk", frac)
    k = math.ceil(frac * n)
    want = np.sort(np.argpartition(-np.abs(d.numpy()), k - 1)[:k])
    assert enc["i"].dtype == torch.int32 and np.array_equal(enc["i"].numpy(), want)
    out = decode_delta(enc, n).numpy()
    expect = np.zeros(n, np.float32)
    expect[want] = _numpy_int8(d.numpy()[want])[2]  # the kept values quantised as int8 deltas are
    assert np.array_equal(out, expect)
    assert encoded_nbytes(enc) == 5 * k + 4 * math.ceil(k / QUANT_BLOCK)  # an int32 index + an int8 value each


def test_add_delta_rounds_to_the_base_dtype_and_replaces_integer_buckets() -> None:
    base = torch.randn(5000).to(torch.bfloat16)
    d = _delta(5000)
    enc = encode_delta(d, "int8")
    out = add_delta(base, enc)
    assert out.dtype == torch.bfloat16
    expect = (base.float().numpy() + _numpy_int8(d.numpy())[2])
    assert torch.equal(out, torch.from_numpy(expect).to(torch.bfloat16))
    ints = torch.arange(6)
    assert torch.equal(add_delta(ints, {"m": "set", "t": ints + 1}), ints + 1)
    with pytest.raises(ProtocolError, match="can only be replaced"):
        add_delta(ints, enc)


def test_malformed_deltas_are_refused_naming_the_problem() -> None:
    enc = encode_delta(_delta(100), "int8")
    with pytest.raises(ProtocolError, match="encoding of 101 elements, got method 'int8' of 100"):
        decode_delta(enc, 101)
    with pytest.raises(ProtocolError, match="field 'q'"):
        decode_delta({**enc, "q": enc["q"].float()}, 100)
    top = encode_delta(_delta(100), "topk", 0.1)
    with pytest.raises(ProtocolError, match="do not fit 100"):
        decode_delta({**top, "i": top["i"] + 100}, 100)
    with pytest.raises(ValueError, match="unknown method"):
        encode_delta(_delta(10), "fp4")


def _numpy_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by integer arithmetic (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_bf16_latents_round_to_nearest_even_within_2_to_the_minus_8() -> None:
    y = torch.randn(2, 16, 8, 8, dtype=torch.float32)
    packet = pack_tensor(y, "bf16")
    assert np.array_equal(packet["b"].view(torch.int16).numpy().view(np.uint16), _numpy_bf16_bits(y.numpy()))
    back = unpack_tensor(packet)
    assert back.dtype == torch.float32 and back.shape == y.shape
    assert float(((back - y).abs() / y.abs()).max()) <= 2.0 ** -8
    assert encoded_nbytes(packet) == y.numel() * 2


@pytest.mark.parametrize("t", [torch.randn(3, 700), torch.randn(40, 50).to(torch.bfloat16), torch.arange(5000),
                               torch.rand(3000) > 0.5, torch.zeros(0, 4), torch.randn(64, 64).t()],
                         ids=["f32", "bf16", "i64", "bool", "empty", "non-contiguous"])
def test_lossless_is_bit_exact_and_independently_inflatable(t: torch.Tensor) -> None:
    packet = pack_tensor(t, "lossless")
    back = unpack_tensor(decode(encode({}, packet))[1])  # through the wire codec, as a fragment travels
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
    # independently: zlib inflates the byte planes, numpy interleaves them back into the elements' bytes
    size = t.element_size()
    planes = np.frombuffer(zlib.decompress(packet["b"].numpy().tobytes()), np.uint8).reshape(size, -1)
    assert np.array_equal(planes.T.reshape(-1), t.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_lossless_shrinks_integer_indices_and_refuses_corrupt_or_oversized_data() -> None:
    idx = torch.arange(10_000)
    assert encoded_nbytes(pack_tensor(idx, "lossless")) < idx.numel() * 8 / 20
    packet = pack_tensor(torch.randn(2000), "lossless")
    with pytest.raises(ProtocolError, match="corrupt"):
        unpack_tensor({**packet, "b": torch.full((50,), 7, dtype=torch.uint8)})
    with pytest.raises(ProtocolError, match="its shape says 4000"):  # never inflated past what the shape says
        unpack_tensor({**packet, "sh": [1000]})
    with pytest.raises(ProtocolError, match="shape must be"):
        unpack_tensor({**packet, "sh": [-1]})
    with pytest.raises(ProtocolError, match="not a lossless"):
        unpack_tensor({**packet, "zc": "pickle"})
