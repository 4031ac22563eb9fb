"""ZeroMQ-specific behaviour: garbage is dropped and counted, the shared-memory lane reuses and
releases its segments, high-water marks push back, sockets are cleaned up on every path, and the
cuda_ipc transport's host-staging fallback warns, counts, or refuses when strict."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch
import zmq

from digenrl.errors import ConfigError, TransportBroken
from digenrl.transport import make_transport
from digenrl.transport._shm import SHM_DIR
from digenrl.transport.codec import PROTOCOL_VERSION
from digenrl.transport.zmq import ZmqTransport

from tests.transport.test_conformance import _CHILD

pytestmark = pytest.mark.timeout(60)


def ipc() -> str:
    return f"ipc://{tempfile.gettempdir()}/digenrl-test-{uuid.uuid4().hex[:12]}.sock"


def our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"digenrl-{os.getpid()}-")}


async def test_tcp_port_zero_reports_real_port() -> None:
    t = make_transport("zmq", "tcp://127.0.0.1:0")
    try:
        host, port = t.address.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        await t.aclose()


async def test_advertised_address_is_what_peers_dial_and_see() -> None:
    # (A wildcard bind would be the real use; tests stay on loopback.)
    a = make_transport("zmq", "tcp://127.0.0.1:0", advertise="localhost")
    b = make_transport("zmq", "tcp://127.0.0.1:0")
    try:
        assert a.address.startswith("tcp://localhost:")
        await b.send(a.address, {"op": "ping"})
        msg = await a.recv()
        await a.send(msg.src, {"op": "pong"})
        assert (await b.recv()).src == a.address
    finally:
        await a.aclose()
        await b.aclose()


async def test_garbage_is_dropped_and_counted_receiver_survives() -> None:
    import msgpack

    b = make_transport("zmq", ipc())
    a = make_transport("zmq", ipc())
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.IDENTITY, b"evil")
    evil.connect(b.address)
    try:
        recv = asyncio.create_task(b.recv())
        evil.send_multipart([b"\xc1 not msgpack"])
        evil.send_multipart([msgpack.packb([PROTOCOL_VERSION + 7, 0, {}, None])])
        evil.send_multipart([msgpack.packb([PROTOCOL_VERSION, 3, {}, None])])
        await a.send(b.address, {"op": "good"})
        msg = await asyncio.wait_for(recv, 5)
        assert msg.header == {"op": "good"} and msg.src == a.address
        # A hand-written message from a process without digenrl (the format is plain msgpack). It
        # follows the garbage on evil's own connection, so when it arrives all three were read (the
        # ROUTER fair-queues evil's and a's connections: "good" may come first).
        evil.send_multipart([msgpack.packb([PROTOCOL_VERSION, 0, {"op": "hi"}, [1, 2]])])
        msg = await asyncio.wait_for(b.recv(), 5)
        assert (msg.src, msg.header, msg.payload) == ("evil", {"op": "hi"}, [1, 2])
        assert b.stats["dropped"] == 3 and b.stats["received"] == 2
    finally:
        evil.close(linger=0)
        ctx.term()
        await a.aclose()
        await b.aclose()


async def test_shm_lane_reuses_segment_after_release_and_leaks_nothing() -> None:
    before = our_segments()
    a, b = make_transport("zmq", ipc()), make_transport("zmq", "tcp://127.0.0.1:0")
    try:
        x = torch.randn(1 << 20)  # 4 MiB: over shm_min_bytes
        for i in range(3):
            await a.send(b.address, {"i": i}, {"x": x + i})
            msg = await b.recv()
            assert torch.equal(msg.payload["x"], x + i)
            del msg  # the receiver lets go: the segment is FREE for the next send
            gc.collect()
        pool = a._peers[b.address].pool  # loopback tcp counts as same host
        assert pool is not None and len(pool.segments) == 1
        # While the receiver holds a tensor its segment stays BUSY, so a second one is made.
        await a.send(b.address, {}, {"x": x})
        held = await b.recv()
        await a.send(b.address, {}, {"x": x * 2})
        held2 = await b.recv()
        assert len(pool.segments) == 2 and torch.equal(held.payload["x"], x) and torch.equal(held2.payload["x"], x * 2)
        assert our_segments() == before  # names are unlinked as soon as the receiver maps them
    finally:
        await a.aclose()
        await b.aclose()
    assert our_segments() == before


async def test_shm_lane_carries_strided_and_mixed_tensors_bit_exact() -> None:
    """A 1-D strided tensor (x[::2]) of >= 1 MiB once crashed the send (viewed as bytes before it was contiguous)."""
    a, b = make_transport("zmq", ipc()), make_transport("zmq", ipc())
    try:
        g = torch.Generator().manual_seed(0)
        payload = {"t": torch.randn(1024, 768, generator=g).t(),  # strided: copied through a contiguous temporary
                   "bf16": torch.randn(3 << 19, generator=g).to(torch.bfloat16),
                   "i64": torch.arange(1 << 18, dtype=torch.int64)[::2],
                   "empty": torch.empty(0, 4)}
        await a.send(b.address, {}, payload)
        got = (await b.recv()).payload
        pool = a._peers[b.address].pool
        assert pool is not None and len(pool.segments) == 1 and a.stats["shm_fallback"] == 0  # it took the lane
        assert set(got) == set(payload)
        for k, v in payload.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    finally:
        await a.aclose()
        await b.aclose()


async def test_shm_pool_full_falls_back_to_frames() -> None:
    a = make_transport("zmq", ipc(), shm_pool_bytes=2 << 20)
    b = make_transport("zmq", ipc())
    try:
        x = torch.arange(3 << 18, dtype=torch.int32)  # 3 MiB: needs a 4 MiB segment > pool
        await a.send(b.address, {}, {"x": x})
        assert torch.equal((await b.recv()).payload["x"], x)
        assert a.stats["shm_fallback"] == 1
    finally:
        await a.aclose()
        await b.aclose()


async def test_high_water_mark_pushes_back() -> None:
    a = make_transport("zmq", ipc(), hwm=2, shm=False)
    b = make_transport("zmq", ipc(), hwm=2, shm=False)
    try:
        await b.send(a.address, {})  # start b's reader, then stop reading
        chunk = torch.zeros(256 << 10, dtype=torch.uint8)

        async def flood() -> None:
            for i in range(200):
                await a.send(b.address, {"i": i}, chunk)

        task = asyncio.create_task(flood())
        await asyncio.sleep(0.5)
        assert not task.done()  # 50 MiB cannot fit in two queues of two messages plus socket buffers
        got = [(await b.recv()).header["i"] for _ in range(200)]
        await asyncio.wait_for(task, 20)
        assert got == list(range(200))
    finally:
        await a.aclose()
        await b.aclose()


async def test_gc_and_failed_construction_release_sockets() -> None:
    address = ipc()
    t = ZmqTransport(address)
    path = address.removeprefix("ipc://")
    assert os.path.exists(path)
    del t
    gc.collect()
    assert not os.path.exists(path)  # the finalizer closed the socket and removed the ipc file

    first = make_transport("zmq", "tcp://127.0.0.1:0")
    try:
        with pytest.raises(ConfigError, match=r"address = 'tcp://127\.0\.0\.1:\d+': cannot bind .*another process listens"):
            ZmqTransport(first.address)  # address in use: the half-built endpoint cleans up
    finally:
        await first.aclose()


async def test_links_to_peers_that_come_and_go_always_open() -> None:
    """A sender whose peers leave and new ones arrive (a worker rejoining after a blip, at a new port)
    reaches every new one: its monitor sockets never collide on a reused file descriptor's name
    (pyzmq's default, which failed with "Address already in use" and lost the driver's join reply)."""
    sender = make_transport("zmq", "tcp://127.0.0.1:0", heartbeat_s=0.1, heartbeat_timeout_s=0.5)
    broken: list[str] = []
    sender.add_peer_listener(lambda peer, err: broken.append(peer))
    try:
        for i in range(150):
            peer = make_transport("zmq", "tcp://127.0.0.1:0")
            try:
                await sender.send(peer.address, {"op": "hello", "n": i})
                assert (await asyncio.wait_for(peer.recv(), 5)).header["n"] == i
            finally:
                await peer.aclose()
            for _ in range(100):  # its disconnect seen: the sender closed that link's sockets
                if peer.address in broken:
                    break
                await asyncio.sleep(0.01)
            sender.forget_peer(peer.address)
    finally:
        await sender.aclose()


async def test_hung_peer_is_detected_by_heartbeats() -> None:
    """A peer that stops answering (SIGSTOP: the kernel keeps its socket open) misses ZMTP pings."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, "tcp://127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    t = make_transport("zmq", "tcp://127.0.0.1:0", heartbeat_s=0.1, heartbeat_timeout_s=0.5)
    try:
        address = (await asyncio.to_thread(proc.stdout.readline)).split()[1]  # type: ignore[union-attr]
        await t.send(address, {"op": "hello"})
        broken: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        t.add_peer_listener(lambda peer, err: broken.done() or broken.set_result(peer))
        proc.send_signal(signal.SIGSTOP)
        assert await asyncio.wait_for(broken, 10) == address
        with pytest.raises(TransportBroken, match="missed heartbeats"):
            await t.send(address, {"op": "again"})
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        await t.aclose()


async def test_cuda_ipc_stages_cpu_tensors_with_warning_and_counter() -> None:
    from digenrl.transport.cuda_ipc import HostStagingWarning

    a, b = make_transport("cuda_ipc", ipc()), make_transport("cuda_ipc", ipc())
    try:
        x = torch.randn(1000)
        with pytest.warns(HostStagingWarning, match="staging 1 tensor"):
            await a.send(b.address, {"op": "w"}, {"x": x, "step": torch.tensor(3)})
        msg = await b.recv()
        assert torch.equal(msg.payload["x"], x) and a.stats["staged"] == 1
    finally:
        await a.aclose()
        await b.aclose()


async def test_cuda_ipc_strict_refuses_staging() -> None:
    if torch.cuda.is_available():
        a, b = make_transport("cuda_ipc", ipc(), strict=True), make_transport("cuda_ipc", ipc())
        try:
            with pytest.raises(ConfigError, match="strict=True"):
                await a.send(b.address, {}, {"x": torch.randn(1000)})
        finally:
            await a.aclose()
            await b.aclose()
    else:
        with pytest.raises(ConfigError, match="needs CUDA"):
            make_transport("cuda_ipc", ipc(), strict=True)


def test_sweep_removes_files_of_killed_processes_only() -> None:
    from digenrl.transport import _stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sock = os.path.join(tempfile.gettempdir(), f"digenrl-{dead.pid}-0.sock")
    seg = os.path.join(SHM_DIR, f"digenrl-{dead.pid}-{uuid.uuid4().hex}")
    fresh = os.path.join(SHM_DIR, f"digenrl-{dead.pid}-{uuid.uuid4().hex}")
    mine = os.path.join(SHM_DIR, f"digenrl-{os.getpid()}-{uuid.uuid4().hex}")
    for path in (sock, seg, fresh, mine):
        open(path, "w").close()
    os.utime(seg, (0, 0))  # old: its owner died long ago
    try:
        _stale._swept = False
        _stale.sweep_stale_once()
        assert not os.path.exists(sock) and not os.path.exists(seg)
        assert os.path.exists(fresh) and os.path.exists(mine)  # maybe in flight / owner alive
    finally:
        for path in (sock, seg, fresh, mine):
            if os.path.exists(path):
                os.unlink(path)
