"""The parts of the NCCL communicator that do not need a GPU: dtype mapping, unique-id forms, errors.
The collective paths run in tests/transport/test_communicator.py[nccl] (marked gpu)."""

from __future__ import annotations

import importlib.util
import os

import msgpack
import pytest
import torch

from digenrl.errors import ConfigError, ProtocolError
from digenrl.transport.communicator import GroupHost, GroupSpec, join_group
from digenrl.transport.nccl import NCCL_TYPES, nccl_args, unique_id_arg, unique_id_bytes
from tests.conftest import gpu_test

HAS_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_every_codec_dtype_moves_all_its_bytes(dtype: torch.dtype) -> None:
    t = torch.zeros(37, dtype=dtype)
    datatype, count = nccl_args(t)
    width = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}[datatype]  # NCCL's element sizes
    assert count * width == t.numel() * t.element_size()


def test_bf16_goes_as_raw_bytes_and_others_keep_their_type() -> None:
    assert nccl_args(torch.zeros(5, dtype=torch.bfloat16)) == (NCCL_TYPES["NCCL_UINT8"], 10)
    assert nccl_args(torch.zeros(5, dtype=torch.float32)) == (NCCL_TYPES["NCCL_FLOAT32"], 5)
    assert nccl_args(torch.zeros(5, dtype=torch.int64)) == (NCCL_TYPES["NCCL_INT64"], 5)
    with pytest.raises(TypeError, match="no mapping for torch.complex64"):
        nccl_args(torch.zeros(2, dtype=torch.complex64))


def test_mirrored_constants_are_cupys_documented_enum() -> None:
    # cupy_backends/cuda/libs/nccl.pxd
    assert NCCL_TYPES == {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
                          "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8,
                          "NCCL_BFLOAT16": 9}
    if HAS_CUPY:
        from cupy.cuda import nccl

        assert all(getattr(nccl, k) == v for k, v in NCCL_TYPES.items() if hasattr(nccl, k))


def test_unique_id_survives_msgpack_in_every_cupy_form() -> None:
    raw = os.urandom(128)
    as_signed = tuple(b - 256 if b > 127 else b for b in raw)  # cupy <= 13 on x86-64 (signed char)
    as_unsigned = tuple(raw)  # cupy <= 13 on aarch64 (unsigned char)
    for form in (raw, as_signed, as_unsigned):
        assert unique_id_bytes(form) == raw
    wire = GroupSpec("nccl", 2, 4, unique_id_bytes(as_signed)).to_wire()
    back = GroupSpec.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert back.uid == raw
    assert unique_id_arg(back.uid, 14) == raw
    assert unique_id_arg(back.uid, 13, "x86_64") == as_signed
    assert unique_id_arg(back.uid, 13, "aarch64") == as_unsigned
    for bad in (raw[:100], (1, 2, 3), (300,) * 128, "text"):
        with pytest.raises(ProtocolError):
            unique_id_bytes(bad)


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed")
def test_nccl_without_cupy_is_a_config_error_naming_the_fix() -> None:
    # the wheel built for torch's CUDA major (cupy-cuda12x was once named whatever torch's CUDA was)
    wheel = f"cupy-cuda{torch.version.cuda.split('.')[0]}x" if torch.version.cuda else "a cupy-cudaNNx wheel"
    with pytest.raises(ConfigError, match=f"needs cupy with NCCL: pip install {wheel} "):
        GroupHost("nccl").new_group(2)
    with pytest.raises(ConfigError, match="needs cupy"):
        join_group(GroupSpec("nccl", 0, 2, bytes(128)), 1)


@gpu_test(1)
@pytest.mark.skipif(not HAS_CUPY, reason="cupy is not installed")
def test_a_group_of_one_broadcasts_and_the_unique_id_is_128_bytes() -> None:
    """The smallest NCCL check: one rank, every dtype through bcast on the communication stream."""
    host = GroupHost("nccl")
    spec = host.new_group(1)
    assert len(spec.uid) == 128
    comm = join_group(spec, 0, "cuda:0")
    try:
        bufs = [torch.arange(10, dtype=d, device="cuda:0") for d in (torch.float32, torch.bfloat16, torch.int64)]
        want = [b.clone() for b in bufs]
        comm.broadcast(bufs, 0)
        assert all(torch.equal(a, b) for a, b in zip(bufs, want, strict=True))
    finally:
        comm.close()
