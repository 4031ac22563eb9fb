"""A communicator group member for the conformance tests: an actor process with the weight lane's
two control endpoints (as a rollout actor has) and raw communicator operations."""

from __future__ import annotations

import os
from typing import Any

import torch

from digenrl.actors import Actor, endpoint
from digenrl.roles.weights import CommReceiver, state_digest
from digenrl.transport.codec import DTYPES


class Shelf:
    """The weight store's interface without a model: versions received, kept as copies."""

    def __init__(self) -> None:
        self.sds: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self.sds)

    def stage(self, version: int, sd: dict[str, torch.Tensor]) -> None:
        self.sds[version] = {k: v.detach().cpu().clone() for k, v in sd.items()}


def make_buffers(seed: int, sizes: list[list[Any]], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Deterministic buffers of the given ``[[dtype, numel], ...]`` (random bits for every dtype)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d, n in sizes:
        dtype = DTYPES[d]
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out.append(raw.view(dtype).to(device))
    return out


def digest(buffers: list[torch.Tensor]) -> str:
    return state_digest({str(i): b for i, b in enumerate(buffers)})


class CommMember(Actor):
    def __init__(self) -> None:
        self.shelf = Shelf()

    async def setup(self) -> None:
        torch.set_num_threads(1)
        if os.environ.get("DIGENRL_TEST_CUDA") == "1":
            torch.cuda.set_device(0)  # the test gives each member its own device by CUDA_VISIBLE_DEVICES
        self.lane = CommReceiver(self.shelf)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.lane.close()

    @endpoint(control=True)
    async def join_weights_group(self, wire: dict[str, Any], rank: int) -> int:
        return await self.lane.join(wire, rank)

    @endpoint(control=True)
    async def receive_weights_comm(self, generation: int, seq: int, version: int, layout: Any, sizes: Any) -> int:
        return await self.lane.receive(generation, seq, version, layout, sizes)

    @endpoint(control=True)
    async def collective(self, op: str, seq: int, peer: int, seed: int, sizes: list[list[Any]]) -> str:
        """Raw communicator operation ``seq``: ``bcast`` (root ``peer``), ``send`` to / ``recv`` from ``peer``.
        Sends and broadcast roots use ``make_buffers(seed)``; returns the digest of the buffers after."""
        ops = self.lane.ops
        assert ops is not None
        comm = ops.comm
        if op == "recv" or (op == "bcast" and peer != comm.rank):
            bufs = [torch.zeros(n, dtype=DTYPES[d], device=comm.device) for d, n in sizes]
        else:
            bufs = make_buffers(seed, sizes, comm.device)
        fn = {"bcast": lambda: comm.broadcast(bufs, peer), "send": lambda: comm.send(bufs, peer),
              "recv": lambda: comm.recv(bufs, peer)}[op]
        await ops.run(seq, fn)
        return digest(bufs)

    @endpoint
    async def state(self) -> dict[str, Any]:
        ops = self.lane.ops
        return {"log": list(self.lane.log), "generation": None if ops is None else ops.generation,
                "rank": None if ops is None else ops.comm.rank,
                "digests": {v: state_digest(sd) for v, sd in self.shelf.sds.items()}}

    @endpoint
    async def pid(self) -> int:
        return os.getpid()
