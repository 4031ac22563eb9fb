"""torch.distributed lane on gloo with two real processes: bucketed state-dict broadcast (into
the receiver's tensors in place), p2p tensors, and a control header over the zmq side."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

from digenrl.transport.torchdist import plan_buckets

_RANK = r"""
import asyncio, sys, torch
torch.set_num_threads(1)
from digenrl.transport.torchdist import TorchDistTransport

rank, port, z0, z1 = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

def make_sd():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(300, 200, generator=g),
            "b": torch.randn(512, 1024, generator=g).bfloat16(),
            "c": torch.arange(1000),
            "flag": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
            "nc": torch.randn(64, 64, generator=g).t(),
            "big": torch.randn(600_000, generator=g),
            "h": torch.randn(33, generator=g).half()}

def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(b.contiguous().view(-1).view(torch.uint8).numpy())

async def main():
    t = TorchDistTransport(z0 if rank == 0 else z1, rank=rank, world_size=2,
                           init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        if rank == 0:
            out = await t.broadcast_state_dict(make_sd(), 0, bucket_mb=1)
            msg = await t.recv()
            assert msg.header == {"op": "loaded", "policy_version": 7} and msg.src == z1, msg
            got = await t.recv_tensors(1)
            g = torch.Generator().manual_seed(5)
            want = {"lat": torch.randn(4, 16, 8, 8, generator=g), "ids": torch.arange(4)}
            assert list(got) == ["lat", "ids"] and all(same(got[k], want[k]) for k in want)
        else:
            into = {k: torch.zeros_like(v) for k, v in make_sd().items()}
            out = await t.broadcast_state_dict(None, 0, bucket_mb=1, into=into)
            want = make_sd()
            assert list(out) == list(want), list(out)
            for k in want:
                assert same(out[k], want[k]), k
                assert out[k] is into[k], k   # loaded in place
            await t.send(z0, {"op": "loaded", "policy_version": 7})
            g = torch.Generator().manual_seed(5)
            await t.send_tensors({"lat": torch.randn(4, 16, 8, 8, generator=g), "ids": torch.arange(4)}, 0)
    finally:
        await t.aclose()
    print("OK", rank, flush=True)

asyncio.run(main())
"""


def test_plan_buckets_groups_by_dtype_and_caps_size() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    layout = [("a", f32, (100,)), ("b", bf16, (10,)), ("c", f32, (200,)), ("d", f32, (1000,)), ("e", f32, (1,))]
    # 1 KiB buckets: a(400 B)+c(800 B) overflow -> [a], [c]; d (4000 B) alone; e joins nothing bigger
    assert plan_buckets(layout, 1024) == [[0], [2], [3], [4], [1]]
    assert plan_buckets(layout, 1 << 20) == [[0, 2, 3, 4], [1]]


@pytest.mark.timeout(90)
def test_two_process_gloo_broadcast_p2p_and_control() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    tmp = tempfile.gettempdir()
    z = [f"ipc://{tmp}/digenrl-td-{uuid.uuid4().hex[:10]}-{r}.sock" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), port, *z], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=80))
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"OK {r}" in out, f"rank {r} failed:\n{out}\n{err[-3000:]}"
