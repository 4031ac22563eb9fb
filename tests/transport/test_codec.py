"""The wire codec: bit-for-bit round trips with exact frame counts, errors that name the problem,
and a fuzz test that garbage only ever raises ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from digenrl.errors import ProtocolError
from digenrl.transport.codec import PROTOCOL_VERSION, CodecOptions, decode, encode

INLINE = CodecOptions().inline_max_bytes


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and bits_equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000 if dtype != torch.uint8 else 0, 255, shape, generator=g).to(dtype)


# (name, tensor, expected payload frames): inline below the threshold, one frame above it.
CASES = [
    ("bf16-big", rand((64, 64), torch.bfloat16), 1),
    ("fp16-big", rand((1000,), torch.float16), 1),
    ("fp32-big", rand((4, 16, 8, 8), torch.float32), 1),
    ("int64-big", rand((300,), torch.int64), 1),
    ("int32-big", rand((300,), torch.int32), 1),
    ("uint8-big", rand((5000,), torch.uint8), 1),
    ("bool-big", rand((2000,), torch.bool), 1),
    ("fp32-small", rand((3, 4), torch.float32), 0),
    ("bf16-small", rand((7,), torch.bfloat16), 0),
    ("bool-small", rand((9,), torch.bool), 0),
    ("scalar-fp32", torch.tensor(3.5), 0),
    ("scalar-int64", torch.tensor(-7), 0),
    ("scalar-bool", torch.tensor(True), 0),
    ("empty", torch.empty(0, 3), 0),
    ("empty-bf16", torch.empty(2, 0, dtype=torch.bfloat16), 0),
    ("at-threshold", rand((INLINE // 4,), torch.float32), 0),
    ("over-threshold", rand((INLINE // 4 + 1,), torch.float32), 1),
    ("non-contiguous", rand((64, 32), torch.float32).t(), 1),
    ("non-contiguous-slice", rand((100, 100), torch.float16)[::3, 1::2], 1),
    ("expanded", torch.arange(4.0).expand(300, 4), 1),
    ("fp64-big", rand((300,), torch.float64), 1),
    ("int16-big", rand((600,), torch.int16), 1),
    ("int8-big", rand((2000,), torch.int8), 1),
    ("requires-grad", rand((300,), torch.float32).requires_grad_(), 1),
]


@pytest.mark.parametrize(("name", "tensor", "nframes"), CASES, ids=[c[0] for c in CASES])
def test_tensor_round_trip(name: str, tensor: torch.Tensor, nframes: int) -> None:
    frames = encode({"op": name}, tensor)
    assert len(frames) == 1 + nframes
    header, out = decode(frames)
    assert header == {"op": name}
    assert_same(tensor, out)


def test_special_float_values_bit_for_bit() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45] * 100)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _, out = decode(encode({}, x.to(dtype)))
        assert bits_equal(out, x.to(dtype))


def test_nested_state_dict_and_frame_count() -> None:
    sd = {
        "blocks.0.attn.to_q.lora_A.weight": rand((8, 64), torch.float32),  # 2 KiB: frame
        "blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 8, dtype=torch.bfloat16),  # 1 KiB: inline
        "step": torch.tensor(12),
        "meta": {"policy_version": 3, "names": ["a", "b"], "ratio": 0.5, "none": None, "raw": b"\x00\x01"},
        "pair": (rand((4, 600), torch.float16), [torch.tensor([True, False]), (1, "x")]),
        7: "int key",
    }
    frames = encode({"op": "load_weights", "v": 3}, sd)
    assert len(frames) == 1 + 2  # lora_A and the fp16 [4, 600]; everything else inline
    header, out = decode(frames)
    assert header == {"op": "load_weights", "v": 3}
    assert_same(sd, out)
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1][1], tuple)


def test_chunked_tensor_reassembles() -> None:
    opts = CodecOptions(chunk_bytes=1000)
    x = rand((1001,), torch.float32)  # 4004 bytes -> 5 chunks
    frames = encode({}, {"x": x, "y": rand((10,), torch.int64)}, options=opts)
    assert len(frames) == 1 + 5
    assert [len(memoryview(f)) for f in frames[1:]] == [1000, 1000, 1000, 1000, 4]
    _, out = decode([bytes(f) for f in frames], options=opts)
    assert bits_equal(out["x"], x)


def test_received_tensor_is_zero_copy_view_of_writable_frame() -> None:
    x = rand((1000,), torch.float32)
    frames = [bytes(frames_i) for frames_i in encode({}, x)]
    writable = [frames[0], bytearray(frames[1])]
    _, out = decode(writable)
    out[0] = 42.0  # the tensor views the received buffer: no copy was made
    assert torch.frombuffer(writable[1], dtype=torch.float32)[0] == 42.0


def test_unaligned_frames_decode_bit_for_bit() -> None:
    # A frame may start at any address; numpy views need alignment, so such frames take the bytewise path.
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = rand((700,), dtype)
        head, body = encode({}, x)
        buf = bytearray(len(memoryview(body)) + 1)
        buf[1:] = bytes(body)
        _, out = decode([head, memoryview(buf)[1:]])
        assert bits_equal(out, x)


def test_large_bytes_go_out_of_band() -> None:
    blob = bytes(range(256)) * 40
    frames = encode({}, {"blob": blob, "small": b"abc"})
    assert len(frames) == 2
    assert decode(frames)[1] == {"blob": blob, "small": b"abc"}


def test_encode_rejects_unsupported_types_by_path() -> None:
    with pytest.raises(TypeError, match=r"payload\['a'\]\[1\]"):
        encode({}, {"a": [1, object()]})
    with pytest.raises(TypeError, match="complex"):
        encode({}, torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="header must not contain tensors"):
        encode({"t": torch.zeros(1000)})


def test_encode_enforces_limits() -> None:
    with pytest.raises(ProtocolError, match="max_total_bytes"):
        encode({}, torch.zeros(1000), options=CodecOptions(max_total_bytes=2000))
    with pytest.raises(ProtocolError, match="max_frames"):
        encode({}, [torch.zeros(1000)] * 3, options=CodecOptions(max_frames=2))


def test_header_only_messages_take_one_frame_and_keep_every_type() -> None:
    # The fast path (plain header, no payload) and the general path must agree on the wire.
    plain = {"op": "echo", "id": 7, "t": 0.5, "ok": True, "none": None}
    frames = encode(plain)
    assert len(frames) == 1 and frames[0] == pack(PROTOCOL_VERSION, 0, plain, None)
    assert decode(frames) == (plain, None)
    for header in ({"ids": (1, 2)}, {"rows": [[0, 4]]}, {"blob": b"ab"}, {"m": {"k": 1}}):
        got, payload = decode(encode(header))
        assert payload is None
        assert_same(got, header)
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        encode({"op": "x" * 100}, options=CodecOptions(max_header_bytes=64))
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        decode(encode({"op": "x" * 100}), options=CodecOptions(max_header_bytes=64))
    with pytest.raises(ProtocolError, match="protocol version"):
        decode([pack(PROTOCOL_VERSION + 1, 0, plain, None)])


# ------------------------------------------------------------------------------------ bad input


def good_frames() -> list[bytes]:
    return [bytes(f) for f in encode({"op": "x"}, {"a": rand((600,), torch.float32), "b": torch.tensor(1)})]


def pack(*top: object) -> bytes:
    return msgpack.packb(list(top), use_bin_type=True)


def tensor_ext(dtype: str, shape: object, ref: object) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, ref], use_bin_type=True))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no header frame"),
        ([b"\xc1garbage"], "header frame is not one msgpack value"),
        ([pack(PROTOCOL_VERSION, 0, {})], r"\[version, n_frames, header, payload\]"),
        ([pack(PROTOCOL_VERSION + 1, 0, {}, None)], "protocol version 2"),
        ([pack(PROTOCOL_VERSION, 2, {}, None), b"x"], "announces 2 payload frames but 1 arrived"),
        ([pack(PROTOCOL_VERSION, 0, [1], None)], "header must be a map"),
        ([pack(PROTOCOL_VERSION, 0, {}, tensor_ext("c64", [1], b"12345678"))], "dtype 'c64'"),
        ([pack(PROTOCOL_VERSION, 0, {}, tensor_ext("f32", [-1], b""))], "invalid dimension -1"),
        ([pack(PROTOCOL_VERSION, 0, {}, tensor_ext("f32", [1 << 40, 1 << 40], 1))], "declares 4835703278458516698824704 bytes, over max_total_bytes"),
        ([pack(PROTOCOL_VERSION, 0, {}, tensor_ext("f32", [3], b"12"))], "inline tensor bytes hold 2 bytes.*needs 12"),
        ([pack(PROTOCOL_VERSION, 1, {}, tensor_ext("f32", [1 << 30], 1)), b"1234"], r"frame 1 hold 4 bytes.*needs 4294967296"),
        ([pack(PROTOCOL_VERSION, 1, {}, tensor_ext("f32", [1], 5)), b"1234"], "refers to frame 5"),
        ([pack(PROTOCOL_VERSION, 1, {}, tensor_ext("f32", [2], [1, 3])), b"1234"], r"spans frames 1..3"),
        ([pack(PROTOCOL_VERSION, 0, {}, tensor_ext("f32", [1], {"kind": "cuda_ipc"}))], "kind 'cuda_ipc' cannot be resolved"),
        ([pack(PROTOCOL_VERSION, 0, {}, msgpack.ExtType(9, b""))], "unknown msgpack extension type 9"),
        ([pack(PROTOCOL_VERSION, 0, {}, msgpack.ExtType(1, b"\x01"))], r"tensor record must be \[dtype, shape, ref\]"),
    ],
    ids=["empty", "garbage", "short-envelope", "wrong-version", "wrong-frame-count", "header-not-map",
         "bad-dtype", "negative-dim", "oversized-dims", "inline-size", "oversized-declared", "frame-index",
         "chunk-span", "unknown-handle", "unknown-ext", "bad-record"],
)
def test_malformed_input_names_the_problem(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_truncated_frames() -> None:
    frames = good_frames()
    with pytest.raises(ProtocolError, match="malformed message|not one msgpack value"):
        decode([frames[0][: len(frames[0]) // 2], frames[1]])
    with pytest.raises(ProtocolError, match="frame 1 hold 1200 bytes.*needs 2400"):
        decode([frames[0], frames[1][:1200]])
    with pytest.raises(ProtocolError, match="announces 1 payload frames but 0 arrived"):
        decode(frames[:1])


def test_decode_limits() -> None:
    frames = good_frames()
    with pytest.raises(ProtocolError, match="max_header_bytes=10"):
        decode(frames, options=CodecOptions(max_header_bytes=10))
    with pytest.raises(ProtocolError, match="max_total_bytes=100"):
        decode(frames, options=CodecOptions(max_total_bytes=100))
    two = [bytes(f) for f in encode({}, [rand((600,), torch.float32)] * 2)]
    with pytest.raises(ProtocolError, match="2 payload frames, over max_frames=1"):
        decode(two, options=CodecOptions(max_frames=1))


def test_deep_nesting_is_a_protocol_error() -> None:
    inner: object = None
    for _ in range(3000):
        inner = msgpack.ExtType(2, msgpack.packb([inner], use_bin_type=True))
    with pytest.raises(ProtocolError, match="deeper than 64 levels"):
        decode([pack(PROTOCOL_VERSION, 0, {}, inner)])


# ------------------------------------------------------------------------------------------ fuzz

_SEEDS = [good_frames(), [bytes(f) for f in encode({"op": "y"}, {"t": (rand((3,), torch.bfloat16), [1, "a"])})],
          [bytes(f) for f in encode({}, rand((700,), torch.int64), options=CodecOptions(chunk_bytes=1000))]]


@st.composite
def mutated_frames(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(_SEEDS))]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "drop", "dup", "random"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if op == "flip" and frames and frames[i]:
            j = draw(st.integers(0, len(frames[i]) - 1))
            frames[i][j] = draw(st.integers(0, 255))
        elif op == "truncate" and frames:
            frames[i] = frames[i][: draw(st.integers(0, len(frames[i])))]
        elif op == "insert" and frames:
            j = draw(st.integers(0, len(frames[i])))
            frames[i][j:j] = draw(st.binary(max_size=8))
        elif op == "drop" and frames:
            del frames[i]
        elif op == "dup" and frames:
            frames.insert(i, bytearray(frames[i]))
        elif op == "random":
            frames = [bytearray(b) for b in draw(st.lists(st.binary(max_size=64), max_size=4))]
    return [bytes(f) for f in frames]


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_frames())
def test_fuzz_only_protocol_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass
