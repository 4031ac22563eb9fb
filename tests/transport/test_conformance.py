"""One conformance suite for every transport (diffusers ``SchedulerCommonTest`` style).

``TransportConformance`` holds the contract of ``digenrl.transport.base.Transport``; each
subclass only says how to build an endpoint, how to run a peer that can die, and on which device
its payload tensors live (``device``: the one the implementation is for, so the CUDA IPC lane is
checked with CUDA tensors, which it hands over by handle, not with host tensors it would stage).
Real sockets and, for zmq, a real child process that is SIGKILLed. A payload staged through host
memory fails every test here (``HostStagingWarning`` is an error, ``stats["staged"]`` must stay 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest
import torch

from digenrl.errors import TransportBroken, TransportClosed
from digenrl.transport import Message, Transport, make_transport

from tests.conftest import child_env, gpu_test

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("error::digenrl.transport.cuda_ipc.HostStagingWarning")]

# A peer in another process that imports only zmq and msgpack (starts in ~0.1 s, no torch):
# binds a ROUTER, says READY on stdout, and reports each message's first header key.
_CHILD = r"""
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("READY", sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
while True:
    frames = sock.recv_multipart()
    print("GOT", frames[0].decode(), len(frames), flush=True)
"""


class TransportConformance:
    """The contract every transport keeps. Subclasses set ``kind`` (and ``device``) and may override the hooks."""

    kind: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    device: ClassVar[str] = "cpu"  # where every payload tensor is made: the device the implementation is for

    def address(self) -> str | None:
        return None

    def make(self) -> Transport:
        return make_transport(self.kind, self.address(), **self.options)

    async def dying_peer(self) -> tuple[str, Callable[[], Awaitable[None]]]:
        """An address that accepts messages, and a coroutine function that kills it."""
        peer = self.make()
        return peer.address, peer.aclose

    @pytest.fixture
    async def pair(self) -> AsyncIterator[tuple[Transport, Transport]]:
        a, b = self.make(), self.make()
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()

    async def recv(self, t: Transport, within: float = 20.0) -> Message:
        """``t``'s next message. One that ``t`` cannot decode (say a device handle it cannot open) is dropped
        and counted, never delivered: fail at once, with ``t``'s counters, rather than wait for the timeout."""
        loop = asyncio.get_running_loop()
        dropped, end = t.stats["dropped"], loop.time() + within
        task = asyncio.ensure_future(t.recv())
        while not task.done():
            if t.stats["dropped"] > dropped or loop.time() > end:
                task.cancel()
                pytest.fail(f"{t.kind} endpoint {t.address}: a message was dropped, or none came within {within} s; "
                            f"counters {t.stats}")
            await asyncio.wait({task}, timeout=0.02)
        return task.result()

    def received(self, got: torch.Tensor, sent: torch.Tensor) -> None:
        """``got`` arrived on this suite's device, bit for bit equal to ``sent`` (dtype, shape, bytes)."""
        assert got.device.type == torch.device(self.device).type, f"sent on {sent.device}, received on {got.device}"
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))

    async def test_send_recv_identifies_sender(self, pair: tuple[Transport, Transport]) -> None:
        a, b = pair
        x = torch.randn(4, 16, 8, 8, device=self.device)
        payload = {"x": x, "meta": {"v": 3, "ids": (1, 2)}, "flag": torch.tensor(True, device=self.device)}
        await a.send(b.address, {"op": "step", "policy_version": 3}, payload)
        msg = await self.recv(b)
        assert msg.src == a.address
        assert msg.header == {"op": "step", "policy_version": 3}
        self.received(msg.payload["x"], x)
        self.received(msg.payload["flag"], payload["flag"])
        assert msg.payload["meta"] == {"v": 3, "ids": (1, 2)}
        await b.send(msg.src, {"op": "reply"})
        assert (await self.recv(a)).header == {"op": "reply"}
        assert a.stats["staged"] == 0  # nothing took the host path

    async def test_order_kept_per_sender(self, pair: tuple[Transport, Transport]) -> None:
        a, b = pair
        c = self.make()
        try:
            n = 150

            async def blast(t: Transport, tag: str) -> None:
                for i in range(n):
                    payload = torch.full((300 if i % 3 else 5,), i, device=self.device) if i % 2 else None
                    await t.send(b.address, {"tag": tag, "i": i}, payload)

            await asyncio.gather(blast(a, "a"), blast(c, "c"))
            seen: dict[str, list[int]] = {a.address: [], c.address: []}
            for _ in range(2 * n):
                msg = await self.recv(b)
                seen[msg.src].append(msg.header["i"])
                if msg.payload is not None:
                    i = msg.header["i"]
                    self.received(msg.payload, torch.full((300 if i % 3 else 5,), i, device=self.device))
            assert seen[a.address] == list(range(n)) and seen[c.address] == list(range(n))
            assert a.stats["staged"] == c.stats["staged"] == 0
        finally:
            await c.aclose()

    async def test_big_payload_bit_for_bit(self, pair: tuple[Transport, Transport]) -> None:
        a, b = pair
        g = torch.Generator(self.device).manual_seed(1)
        big = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=g, device=self.device)
        weights = {"w": torch.randn(1024, 1024, generator=g, device=self.device).bfloat16(),
                   "b": torch.randn(3, generator=g, device=self.device)}
        await a.send(b.address, {"op": "big"}, {"blob": big, "sd": weights})
        msg = await self.recv(b)
        self.received(msg.payload["blob"], big)
        self.received(msg.payload["sd"]["w"], weights["w"])
        self.received(msg.payload["sd"]["b"], weights["b"])
        assert a.stats["staged"] == 0
        if a.device_direct and big.device.type != "cpu":
            return  # device memory is handed over, not copied: the sender must not write to it (cuda_ipc.py)
        # The sender may reuse its buffers once send returned: the receiver's copy is its own.
        big.zero_()
        assert int(msg.payload["blob"][:1000].sum()) > 0

    async def test_close_while_receiving(self) -> None:
        t = self.make()
        pending = asyncio.create_task(t.recv())
        await asyncio.sleep(0.01)
        await t.aclose()
        with pytest.raises(TransportClosed):
            await pending
        with pytest.raises(TransportClosed):
            await t.recv()
        with pytest.raises(TransportClosed):
            await t.send(t.address, {})
        await t.aclose()  # idempotent

    async def test_cancelling_recv_loses_nothing(self, pair: tuple[Transport, Transport]) -> None:
        a, b = pair
        got: list[int] = []
        for i in range(40):
            task = asyncio.create_task(b.recv())
            await asyncio.sleep(0)
            await a.send(b.address, {"i": i})
            for _ in range(i % 4):  # cancel at varying points relative to the arrival
                await asyncio.sleep(0)
            task.cancel()
            try:
                got.append((await task).header["i"])
            except asyncio.CancelledError:
                pass
        while len(got) < 40:
            got.append((await asyncio.wait_for(b.recv(), 5)).header["i"])
        assert got == list(range(40))

    async def test_peer_death_surfaces(self) -> None:
        t = self.make()
        try:
            address, kill = await self.dying_peer()
            await t.send(address, {"op": "hello"})
            broken: asyncio.Future[TransportBroken] = asyncio.get_running_loop().create_future()
            t.add_peer_listener(lambda peer, err: peer == address and not broken.done() and broken.set_result(err))
            await kill()
            err = await asyncio.wait_for(broken, 10)  # a pending exchange learns of the death
            assert isinstance(err, TransportBroken) and address in str(err)
            with pytest.raises(TransportBroken):
                await t.send(address, {"op": "again"})
        finally:
            await t.aclose()

    async def test_send_to_nobody_is_broken(self) -> None:
        t = self.make()
        try:
            with pytest.raises(TransportBroken):
                await t.send(self.unbound_address(), {"op": "x"})
        finally:
            await t.aclose()

    def unbound_address(self) -> str:
        return f"inproc://nobody-{uuid.uuid4().hex}"


class TestInproc(TransportConformance):
    kind = "inproc"


class _ZmqBase(TransportConformance):
    kind = "zmq"
    options: ClassVar[dict[str, Any]] = {"connect_timeout_s": 1.0, "heartbeat_s": 0.2, "heartbeat_timeout_s": 1.0}

    async def dying_peer(self) -> tuple[str, Callable[[], Awaitable[None]]]:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, self.address() or ""], stdout=subprocess.PIPE,
                                text=True, env=child_env())
        line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.startswith("READY"), line
        address = line.split()[1]

        async def kill() -> None:
            got = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
            assert got.startswith("GOT"), got  # the child really received our message
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            proc.stdout.close()  # type: ignore[union-attr]
            if address.startswith("ipc://") and os.path.exists(address[6:]):
                os.unlink(address[6:])  # a SIGKILLed process cannot remove its socket file

        return address, kill


class TestZmqIpc(_ZmqBase):
    """ipc:// with the default same-host shared-memory lane for large tensors."""

    def address(self) -> str:
        return f"ipc://{tempfile.gettempdir()}/digenrl-test-{uuid.uuid4().hex[:12]}.sock"

    def unbound_address(self) -> str:
        return self.address()


class TestZmqTcp(_ZmqBase):
    """tcp:// loopback with shared memory off, so large tensors cross as chunked zmq frames."""

    options: ClassVar[dict[str, Any]] = {**_ZmqBase.options, "shm": False}

    def address(self) -> str:
        return "tcp://127.0.0.1:0"

    def unbound_address(self) -> str:
        import socket

        with socket.socket() as s:  # a port that was free a moment ago: nobody listens there
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@gpu_test(1)
class TestCudaIpc(TransportConformance):
    """Payloads on the GPU: they must cross by IPC handle (a host-staging fallback fails the test)."""

    kind = "cuda_ipc"
    device = "cuda"

    def address(self) -> str:
        return f"ipc://{tempfile.gettempdir()}/digenrl-test-{uuid.uuid4().hex[:12]}.sock"

    unbound_address = TestZmqIpc.unbound_address
    dying_peer = _ZmqBase.dying_peer
    options = _ZmqBase.options
