"""Conformance of the communicator seam, over real actor processes: one suite, parametrised over the
implementations (gloo here; NCCL where cupy and enough GPUs are present).

The test process is the root (rank 0, as the lead trainer is); members are ``CommMember`` actor
processes that join each generation from the spec handed over the actor control channel.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from digenrl.actors import ActorSystem
from digenrl.errors import ProtocolError, RemoteError
from digenrl.roles.weights import CommPublisher, pack_buckets, state_digest
from digenrl.transport.codec import DTYPES
from digenrl.transport.communicator import GroupHost, GroupSpec, OrderedOps, join_group
from tests.conftest import gpu_marks
from tests.transport._comm_actors import CommMember, digest, make_buffers

pytestmark = pytest.mark.timeout(150)


def _nccl(world: int) -> Any:
    # One GPU per member (NCCL refuses two ranks on one device): the root and `world - 1` actors.
    needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
    return pytest.param("nccl", marks=[*gpu_marks(world), needs_cupy])


def kinds(world: int) -> list[Any]:
    return ["gloo", _nccl(world)]


def sd_of(version: int) -> dict[str, torch.Tensor]:
    """A state dict with random *bits* in fp32, bf16, int64, fp16 and bool tensors (NaN payloads included)."""
    sizes = [["f32", 30_000], ["bf16", 20_001], ["i64", 4_097], ["f16", 333], ["f32", 7], ["bool", 5]]
    names = ["blocks.0.w", "blocks.0.b16", "ids", "h", "tiny", "flag"]
    bufs = make_buffers(1000 + version, sizes)
    bufs[-1] = bufs[-1].view(torch.uint8) % 2 == 1  # a bool tensor must hold 0/1
    out = dict(zip(names, bufs, strict=True))
    out["blocks.0.w"] = out["blocks.0.w"].view(100, 300)
    return out


@asynccontextmanager
async def members(kind: str, n: int) -> AsyncIterator[tuple[ActorSystem, dict[str, Any]]]:
    async with ActorSystem(heartbeat_interval=0.5, heartbeat_timeout=10.0, shutdown_timeout=5.0) as system:
        refs = await asyncio.gather(*(spawn(system, kind, f"m{i}", i) for i in range(n)))
        yield system, {f"m{i}": r for i, r in enumerate(refs)}


async def spawn(system: ActorSystem, kind: str, name: str, index: int) -> Any:
    env = {"CUDA_VISIBLE_DEVICES": str(index + 1), "DIGENRL_TEST_CUDA": "1"} if kind == "nccl" else None
    return await system.spawn(CommMember, name=name, process=True, env=env)


async def states(refs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(zip(refs, await asyncio.gather(*(r.state.call() for r in refs.values())), strict=True))


@pytest.mark.parametrize("kind", kinds(3))
async def test_group_forms_and_bucketed_broadcast_is_bit_exact(kind: str) -> None:
    assert len(pack_buckets(sd_of(0), 0.05)[1]) >= 6  # several buckets per dtype at 50 KiB
    pub = CommPublisher(kind, bucket_mb=0.05, timeout_s=60)
    try:
        async with members(kind, 2) as (_, refs):
            out = await pub.publish(0, sd_of(0), refs)
            assert (out["generation"], out["failed"], pub.formations) == (0, [], 1)
            got = await states(refs)
            assert [s["rank"] for s in got.values()] == [1, 2]
            assert all(s["digests"] == {0: state_digest(sd_of(0))} for s in got.values())
            # The next version rides the same generation: no re-formation.
            out = await pub.publish(1, sd_of(1), refs)
            assert (out["generation"], pub.formations) == (0, 1)
            got = await states(refs)
            assert all(s["digests"][1] == state_digest(sd_of(1)) and s["log"] == [0, 1] for s in got.values())
            # A publication numbered for another generation is refused, not mixed in.
            with pytest.raises(RemoteError, match="generation 7, but this actor is in generation 0"):
                await refs["m0"].receive_weights_comm.call(7, 2, 9, [], [])
    finally:
        pub.close()


@pytest.mark.parametrize("kind", kinds(3))
async def test_send_recv_and_operations_run_in_the_roots_order(kind: str) -> None:
    """Each member is told its operations in reverse order; they still run in the numbered order."""
    host = GroupHost(kind, timeout_s=60)
    sizes: list[list[Any]] = [["f32", 1000], ["bf16", 333], ["i64", 77], ["u8", 0]]
    want = {s: digest(make_buffers(s, sizes)) for s in (10, 11, 12, 13)}
    async with members(kind, 2) as (_, refs):
        m1, m2 = refs.values()
        spec = host.new_group(3)
        joined = await asyncio.gather(asyncio.to_thread(join_group, spec, 0),
                                      m1.join_weights_group.call(spec.to_wire(), 1),
                                      m2.join_weights_group.call(spec.to_wire(), 2))
        ops = OrderedOps(joined[0])
        try:
            device = ops.comm.device
            plans = {  # member -> [(seq, op, peer, seed)]; seeds name the sender's buffers
                m1: [(0, "bcast", 0, 10), (1, "send", 2, 11), (2, "bcast", 2, 12), (3, "recv", 0, 13)],
                m2: [(0, "bcast", 0, 10), (1, "recv", 1, 11), (2, "bcast", 2, 12)],
            }
            calls = [m.collective.call(op, seq, peer, seed, sizes) for m, plan in plans.items()
                     for seq, op, peer, seed in reversed(plan)]
            bufs = [make_buffers(10, sizes, device), [torch.zeros(n, dtype=DTYPES[d], device=device) for d, n in sizes],
                    make_buffers(13, sizes, device)]
            root = [ops.run(2, lambda: ops.comm.send(bufs[2], 1)), ops.run(1, lambda: ops.comm.broadcast(bufs[1], 2)),
                    ops.run(0, lambda: ops.comm.broadcast(bufs[0], 0))]
            results = await asyncio.gather(*calls, *root)
            assert results[:7] == [want[13], want[12], want[11], want[10], want[12], want[11], want[10]]
            assert digest(bufs[1]) == want[12]  # the root received member 2's broadcast
            with pytest.raises(ProtocolError, match="operation 1 of generation 0 was already run"):
                await ops.run(1, lambda: None)
        finally:
            ops.close()
            host.close()


@pytest.mark.parametrize("kind", kinds(4))
async def test_reforms_after_kill9_and_a_respawned_member_gets_the_current_version(kind: str) -> None:
    pub = CommPublisher(kind, bucket_mb=0.05, timeout_s=60)
    try:
        async with members(kind, 3) as (system, refs):
            await pub.publish(0, sd_of(0), refs)
            os.kill(await refs["m1"].pid.call(), signal.SIGKILL)
            # Nobody told the publisher: it finds m1 dead inside the broadcast and re-forms without it.
            out = await pub.publish(1, sd_of(1), refs)
            assert out["failed"] == ["m1"] and out["generation"] == 1
            survivors = {n: refs[n] for n in ("m0", "m2")}
            got = await states(survivors)
            assert [s["rank"] for s in got.values()] == [1, 2]
            assert all(s["generation"] == 1 and s["digests"][1] == state_digest(sd_of(1)) for s in got.values())
            # A replacement (same slot, new process) is admitted before any work: it holds v1 (and v0).
            survivors["m1b"] = await spawn(system, kind, "m1b", 1)
            out = await pub.admit(survivors)
            assert out == {"failed": [], "generation": 2}
            new = (await states({"m1b": survivors["m1b"]}))["m1b"]
            assert new["digests"] == {0: state_digest(sd_of(0)), 1: state_digest(sd_of(1))}
            out = await pub.publish(2, sd_of(2), survivors)
            assert out["generation"] == 2
            got = await states(survivors)
            assert all(s["digests"][2] == state_digest(sd_of(2)) for s in got.values())
    finally:
        pub.close()


@pytest.mark.parametrize("kind", kinds(4))
async def test_late_joiner_receives_the_current_version_before_anything_else(kind: str) -> None:
    pub = CommPublisher(kind, bucket_mb=0.05, timeout_s=60, keep=2)
    try:
        async with members(kind, 2) as (system, refs):
            for v in range(3):
                await pub.publish(v, sd_of(v), refs)
            late = await spawn(system, kind, "late", 2)
            assert (await late.state.call())["digests"] == {}
            everyone = {**refs, "late": late}
            assert await pub.admit(everyone) == {"failed": [], "generation": 1}
            got = await states(everyone)
            assert got["late"]["log"] == [1, 2]  # the newest two (staleness 1), oldest first
            assert got["late"]["digests"] == {v: state_digest(sd_of(v)) for v in (1, 2)}
            assert got["m0"]["digests"] == {v: state_digest(sd_of(v)) for v in range(3)}  # the replay changed nothing
            assert await pub.admit(everyone) == {"failed": [], "generation": 1}  # same members: no re-formation
            await pub.publish(3, sd_of(3), everyone)
            got = await states(everyone)
            assert all(s["digests"][3] == state_digest(sd_of(3)) for s in got.values())
    finally:
        pub.close()


@pytest.mark.parametrize("kind", kinds(3))
async def test_concurrent_publications_arrive_in_order(kind: str) -> None:
    pub = CommPublisher(kind, bucket_mb=0.05, timeout_s=60)
    try:
        async with members(kind, 2) as (_, refs):
            await pub.publish(0, sd_of(0), refs)
            outs = await asyncio.gather(*(pub.publish(v, sd_of(v), refs) for v in range(1, 7)))
            assert {o["generation"] for o in outs} == {0}
            got = await states(refs)
            for s in got.values():
                assert s["log"] == list(range(7))
                assert s["digests"] == {v: state_digest(sd_of(v)) for v in range(7)}
    finally:
        pub.close()


def test_group_spec_round_trips_and_names_a_bad_field() -> None:
    spec = GroupSpec("gloo", 3, 4, os.urandom(8), "127.0.0.1:1234", 30.0)
    assert GroupSpec.from_wire(spec.to_wire()) == spec
    for key, value, message in [("kind", "mpi", "field 'kind' is invalid"), ("world", 0, "field 'world' is invalid"),
                                ("uid", "text", "field 'uid' is invalid"), ("gen", None, "lacks field 'gen'")]:
        wire = spec.to_wire()
        if value is None:
            del wire[key]
        else:
            wire[key] = value
        with pytest.raises(ProtocolError, match=message):
            GroupSpec.from_wire(wire)
