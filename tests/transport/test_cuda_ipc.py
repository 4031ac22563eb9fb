"""The CUDA IPC lane's protocol on the CPU: route decision, the sender's ledger, the receiver's acks,
acks over real ZeroMQ endpoints, and release on a receiver's death. Handle export / open on real
device memory: tests/transport/test_conformance.py::TestCudaIpc (marked gpu)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from digenrl.errors import ProtocolError
from digenrl.transport import make_transport
from digenrl.transport.cuda_ipc import ACK, AckBatcher, CudaIpcTransport, IpcLedger, ipc_route
from tests.conftest import child_env, gpu_test
from tests.transport.test_zmq import ipc


def test_route_uses_handles_only_for_gpu_tensors_on_this_node_with_cuda() -> None:
    assert ipc_route(is_cuda=True, cuda_here=True, same_host=True) is None
    assert ipc_route(True, True, False) == "the peer is not on this node"
    assert ipc_route(True, False, True) == "CUDA is not available"
    assert ipc_route(False, True, True) == "the tensors are not on a GPU"


def test_ledger_holds_until_acknowledged_and_releases_a_dead_receiver() -> None:
    ledger = IpcLedger()
    x, y, z = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    a = [ledger.hold("ipc://a", x), ledger.hold("ipc://a", y)]
    b = ledger.hold("ipc://b", z)
    assert a == [0, 1] and b == 2 and ledger.held == 3
    assert ledger.release("ipc://a", [a[1], 99]) == 1 and ledger.unknown_acks == 1  # a late ack is not fatal
    assert ledger.held_for("ipc://a") == 1 and ledger.release("ipc://b", [a[0]]) == 0  # ids are per receiver
    assert ledger.forget("ipc://a") == 1 and ledger.held == 1
    assert (ledger.exported, ledger.released) == (3, 2)
    with pytest.raises(ProtocolError, match="must be a list of ints"):
        ledger.release("ipc://b", "2")


def test_acks_are_sent_once_the_last_view_of_a_received_tensor_is_gone() -> None:
    sent: list[tuple[str, list[int]]] = []
    scheduled: list = []
    batcher = AckBatcher(lambda src, ids: sent.append((src, ids)), scheduled.append)
    t1, t2, t3 = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    batcher.watch(t1, "ipc://a", 5)
    batcher.watch(t2, "ipc://a", 6)
    batcher.watch(t3, "ipc://b", 7)
    view = t1[1:3]
    del t1
    gc.collect()
    assert not scheduled  # a view keeps the mapped tensor alive
    del view, t2, t3
    gc.collect()
    assert len(scheduled) == 1  # one flush for the batch
    scheduled.pop()()
    assert sorted(sent) == [("ipc://a", [5, 6]), ("ipc://b", [7])]


async def test_ack_travels_back_over_zmq_and_is_never_delivered() -> None:
    a, b = make_transport("cuda_ipc", ipc()), make_transport("cuda_ipc", ipc())
    assert isinstance(a, CudaIpcTransport) and isinstance(b, CudaIpcTransport)
    try:
        ident = a.ledger.hold(b.address, torch.zeros(8))  # what an export to b does
        a._count()
        await a.send(b.address, {"op": "hello"})  # b learns a's address as the source
        msg = await b.recv()
        received = torch.zeros(8)  # stands for the tensor b mapped from the handle
        b._batcher().watch(received, msg.src, ident)
        del received
        gc.collect()
        b._batcher().flush()  # (what the scheduled callback does on the next loop turn)
        await asyncio.gather(*b._ack_tasks)
        await b.send(a.address, {"op": "after"})
        assert (await a.recv()).header == {"op": "after"}  # the ack came first and was consumed
        assert a.ledger.held == 0 and a.stats["ipc_released"] == 1 and a.stats["ipc_held"] == 0
        await b.send(a.address, {ACK: "junk"})  # a malformed ack is dropped and counted
        await b.send(a.address, {"op": "last"})
        assert (await a.recv()).header == {"op": "last"} and a.stats["dropped"] == 1
    finally:
        await a.aclose()
        await b.aclose()


async def test_handles_held_for_a_receiver_that_dies_are_released() -> None:
    a, c = make_transport("cuda_ipc", ipc()), make_transport("cuda_ipc", ipc())
    assert isinstance(a, CudaIpcTransport)
    dead = asyncio.get_running_loop().create_future()
    a.add_peer_listener(lambda peer, err: dead.done() or dead.set_result(peer))
    try:
        await a.send(c.address, {"op": "x"})
        await c.recv()
        a.ledger.hold(c.address, torch.zeros(8))
        await c.aclose()
        assert await asyncio.wait_for(dead, 30) == c.address
        assert a.ledger.held == 0 and a.ledger.released == 1
    finally:
        await a.aclose()
        await c.aclose()


_RECEIVER = r"""
import asyncio, gc, sys, torch
from digenrl.transport import make_transport

async def main():
    b = make_transport("cuda_ipc", sys.argv[1])
    print("READY", flush=True)
    msg = await b.recv()
    x = msg.payload["x"]
    ok = x.is_cuda and torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.float32))
    src = msg.src
    del msg, x
    gc.collect()
    b._batcher().flush()
    await asyncio.gather(*b._ack_tasks)
    await b.send(src, {"ok": bool(ok)})
    await b.recv()  # until the parent says stop
    await b.aclose()

asyncio.run(main())
"""


@gpu_test(1)
async def test_a_cuda_tensor_goes_by_handle_to_another_process_and_is_released_after_its_ack() -> None:
    import subprocess
    import sys

    address = ipc()
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, address], stdout=subprocess.PIPE, text=True,
                             env=child_env())  # it imports digenrl: the tests' own, whatever our PYTHONPATH
    a = make_transport("cuda_ipc", ipc())
    assert isinstance(a, CudaIpcTransport)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        await a.send(address, {"op": "x"}, {"x": x})
        assert a.stats["staged"] == 0 and a.ledger.held == 1
        reply = await a.recv()  # the ack arrived before it (FIFO per sender) and was consumed
        assert reply.header == {"ok": True} and a.ledger.held == 0 and a.stats["ipc_released"] == 1
        await a.send(address, {"op": "stop"})
        assert child.wait(60) == 0
    finally:
        child.kill()
        await a.aclose()
