"""Inproc ownership: pooled copies are never overwritten under a live reader; handoff is by reference."""

from __future__ import annotations

import gc

import torch

from digenrl.transport.inproc import InprocTransport
from digenrl.transport._warm import WarmBuffers

MiB = 1 << 20


async def test_pooled_copy_is_reused_only_once_the_receiver_let_go() -> None:
    a, b = InprocTransport(), InprocTransport()
    try:
        first = torch.full((2 * MiB,), 1, dtype=torch.uint8)
        await a.send(b.address, {"i": 1}, {"x": first})
        kept = (await b.recv()).payload["x"]
        first.fill_(9)  # the sender may reuse its buffer once send returned
        await a.send(b.address, {"i": 2}, {"x": torch.full((2 * MiB,), 2, dtype=torch.uint8)})
        second = (await b.recv()).payload["x"]
        # A receiver that still holds the first copy sees it intact: the pool gave out another buffer.
        assert int(kept.min()) == int(kept.max()) == 1 and int(second.min()) == 2
        assert kept.data_ptr() != second.data_ptr()
        old = kept.data_ptr()
        view = kept[10:20]  # any piece of the copy keeps the whole buffer out of the pool
        del kept
        gc.collect()
        await a.send(b.address, {"i": 3}, {"x": torch.full((2 * MiB,), 3, dtype=torch.uint8)})
        third = (await b.recv()).payload["x"]
        assert third.data_ptr() != old and int(view.max()) == 1
        del view, third
        gc.collect()
        await a.send(b.address, {"i": 4}, {"x": torch.full((2 * MiB,), 4, dtype=torch.uint8)})
        fourth = (await b.recv()).payload["x"]
        assert int(fourth.min()) == int(fourth.max()) == 4
        assert a._warm is not None and a._warm.reused >= 1  # warm buffers really came back
    finally:
        await a.aclose()
        await b.aclose()


async def test_handoff_passes_tensors_by_reference() -> None:
    a, b = InprocTransport(copy=False), InprocTransport(copy=False)
    try:
        blob = torch.arange(4 * MiB, dtype=torch.uint8)
        await a.send(b.address, {}, {"x": blob})
        got = (await b.recv()).payload["x"]
        assert got.data_ptr() == blob.data_ptr() and torch.equal(got, blob)  # zero copy
    finally:
        await a.aclose()
        await b.aclose()


def test_warm_buffers_size_classes_and_limit() -> None:
    pool = WarmBuffers(min_bytes=MiB, max_bytes=4 * MiB)
    small = pool.copy(b"abc")
    assert isinstance(small, bytearray) and small == b"abc"  # below min_bytes: plain copy
    src = bytes(range(256)) * (3 * MiB // 256)
    a = pool.copy(src)
    assert bytes(a) == src and a.base.nbytes == 4 * MiB  # a 4 MiB class holds 3 MiB
    del a
    assert pool.free_bytes == 4 * MiB
    b = pool.copy(src[: 2 * MiB + 1])  # same class: the warm buffer again
    assert pool.reused == 1 and bytes(b) == src[: 2 * MiB + 1]
    c = pool.copy(src)  # the class is busy: a new buffer
    del b, c
    assert pool.free_bytes == 4 * MiB  # the second one did not fit under max_bytes: dropped
    pool.close()
    assert pool.free_bytes == 0
