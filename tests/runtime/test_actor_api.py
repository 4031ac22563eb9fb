"""The actor API on in-process actors: typing, FIFO, errors, tell/broadcast, refs, lifecycle."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, assert_type

import pytest
import torch

from _actors import BadSetup, Counter, Cruncher
from digenrl.actors import Actor, ActorRef, ActorSystem, Endpoint, broadcast, endpoint
from digenrl.errors import ActorDied, RemoteError


@pytest.fixture
async def system():
    async with ActorSystem(transport="inproc") as s:
        yield s


async def test_endpoint_types_flow_to_the_caller(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c")
    assert_type(c, Counter)
    assert isinstance(Counter.add, Endpoint) and Counter.add.name == "add"
    fut = c.add.call(2)
    assert_type(fut, asyncio.Future[int])
    assert await fut == 2
    assert_type(await broadcast([c], Counter.add, 1), list[int])
    assert_type(c.ref, ActorRef[Counter])
    # At run time the handle is a ref, and the endpoint table matches the decorated methods.
    assert isinstance(c, ActorRef)
    assert set(Counter.endpoints) == {"add", "history", "pid", "getenv", "fail", "sleep", "echo", "loop_kind", "call_peer", "me"}
    assert Cruncher.endpoints["crunch"].compute and Cruncher.endpoints["poke"].control


def test_endpoint_misuse_is_rejected_at_class_creation() -> None:
    with pytest.raises(TypeError, match="compute=True.*plain `def`"):
        class _A(Actor):
            @endpoint(compute=True)
            async def f(self) -> None: ...

    with pytest.raises(TypeError, match=r"\['call'\] clash with ActorRef attributes"):
        class _B(Actor):
            @endpoint
            async def call(self) -> None: ...


async def test_mailbox_is_fifo_and_one_at_a_time(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c")
    # Issue 200 calls without awaiting; each add yields mid-update, so overlap would lose updates.
    futures = [c.add.call(k) for k in range(1, 201)]
    results = await asyncio.gather(*futures)
    assert results == [k * (k + 1) // 2 for k in range(1, 201)]
    assert await c.history.call() == list(range(1, 201))


async def test_tell_is_ordered_with_calls(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c", start=10)
    for k in (1, 2, 3):
        c.add.tell(k)
    assert await c.add.call(4) == 20
    assert await c.history.call() == [1, 2, 3, 4]


async def test_remote_error_carries_the_traceback(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c")
    with pytest.raises(RemoteError) as info:
        await c.fail.call("boom 42")
    err = info.value
    assert err.where == "c.fail" and err.exc_type == "ValueError" and err.message == "boom 42"
    assert "_helper_that_raises" in err.remote_traceback and "raise ValueError(message)" in err.remote_traceback
    # The actor survives its endpoint's error.
    assert await c.add.call(1) == 1


async def test_unknown_method_and_bad_arguments_name_the_method(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c")
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        c.nope  # noqa: B018  (the class is known: typos fail before sending)
    untyped = ActorRef.from_dict(c.ref.to_dict())  # no class: the actor itself must refuse
    with pytest.raises(RemoteError) as info:
        await untyped.call("nope", 1)
    assert info.value.where == "c.nope" and "no endpoint 'nope'" in info.value.message
    with pytest.raises(RemoteError) as info:
        await c.add.call(1, 2)
    assert info.value.exc_type == "TypeError" and info.value.message.startswith("add():")
    with pytest.raises(RemoteError, match="add\\(\\): missing a required argument: 'k'"):
        await c.add.call()
    with pytest.raises(RemoteError, match="unexpected keyword argument 'j'"):
        await c.add.call(k=1, j=2)
    assert await c.add.call(k=5) == 5


async def test_broadcast_returns_results_in_ref_order(system: ActorSystem) -> None:
    refs = [await system.spawn(Counter, name=f"c{i}", start=100 * i) for i in range(4)]
    assert await broadcast(refs, Counter.add, 1) == [1, 101, 201, 301]
    assert await broadcast(refs, "add", k=2) == [3, 103, 203, 303]
    with pytest.raises(RemoteError, match="c0.fail") as info:
        await broadcast(refs, Counter.fail, "x")
    assert any("also failed" in note for note in info.value.__notes__)


async def test_ref_round_trip_and_refs_inside_messages() -> None:
    async with ActorSystem(transport="inproc") as a, ActorSystem(transport="inproc") as b:
        ca = await a.spawn(Counter, name="ca")
        cb = await b.spawn(Counter, name="cb")
        d = ca.ref.to_dict()
        assert d == {"name": "ca", "address": a.address}
        again = ActorRef.from_dict(d, node=b.node)
        assert again == ca.ref and hash(again) == hash(ca.ref)
        # From system b, through the transport: b's actor calls a's actor through a ref argument.
        assert await cb.call_peer.call(ActorRef.from_dict(d), 7) == 7
        # A ref returned by a remote actor arrives as a working ref.
        me = await again.bind(b.node).call("me")
        assert isinstance(me, ActorRef) and me == ca.ref
        assert await me.call("add", 1) == 8
        # Tensors and nested containers cross too (through the real codec).
        x = torch.arange(600, dtype=torch.float32).reshape(20, 30)
        out = await again.bind(b.node).call("echo", {"x": x, "t": (1, "a"), "refs": [ca.ref]})
        assert torch.equal(out["x"], x) and out["t"] == (1, "a") and out["refs"] == [ca.ref]
    for bad, field in (({"name": "x"}, "address"), ({"name": 3, "address": "a"}, "name")):
        with pytest.raises(ValueError, match=f"field '{field}'"):
            ActorRef.from_dict(bad)


async def test_setup_failure_reaches_the_spawner(system: ActorSystem) -> None:
    with pytest.raises(RemoteError) as info:
        await system.spawn(BadSetup, name="bad")
    err = info.value
    assert err.where == "bad.setup()" and err.exc_type == "FileNotFoundError"
    assert "_load_weights_that_are_missing" in err.remote_traceback
    assert isinstance(err.__cause__, FileNotFoundError)
    # The name is free again and the system still works.
    c = await system.spawn(Counter, name="bad")
    assert await c.add.call(1) == 1


async def test_control_endpoints_run_while_compute_holds_the_mailbox(system: ActorSystem) -> None:
    w = await system.spawn(Cruncher, name="w")
    crunch = w.crunch.call(21)
    while not await w.is_started.call():  # control calls answer while crunch is queued/running
        await asyncio.sleep(0.01)
    queued = w.busy.call(0.0)  # FIFO: behind crunch
    assert not crunch.done() and not queued.done()
    assert await w.poke.call() == 1  # would deadlock if control went through the mailbox
    assert await crunch == 42
    thread = await queued
    assert thread.startswith("digenrl-w")  # compute runs in the actor's own worker thread
    first, second, loop_thread = await w.staged.call()
    assert first == second == thread != loop_thread  # in_thread: the same worker thread


async def test_cancelled_call_is_cancelled_remotely(system: ActorSystem) -> None:
    c = await system.spawn(Counter, name="c")
    slow = c.sleep.call(30)
    await asyncio.sleep(0.05)
    slow.cancel()
    # The actor is free again at once (the sleep was cancelled, not waited out).
    assert await asyncio.wait_for(c.add.call(1), 5) == 1


async def test_cleanup_hook_and_draining(system: ActorSystem) -> None:
    seen: list[Any] = []

    class Recorder(Counter):
        async def __cleanup__(self, exc: BaseException | None) -> None:
            seen.append(("cleanup", exc, list(self.log)))

    r = await system.spawn(Recorder, name="r")
    futures = [r.add.call(k) for k in (1, 2, 3)]
    await system.stop(r)  # drain: queued calls finish before cleanup
    assert [f.result() for f in futures] == [1, 3, 6]
    assert seen == [("cleanup", None, [1, 2, 3])]
    with pytest.raises(RemoteError, match="no actor named 'r'"):
        await r.add.call(1)


async def test_calls_after_shutdown_fail_cleanly() -> None:
    async with ActorSystem(transport="inproc", shutdown_timeout=0.5) as s:
        c = await s.spawn(Counter, name="c")
        pending = c.sleep.call(30)
    with pytest.raises((ActorDied, RemoteError)):
        await pending
    with pytest.raises(RuntimeError, match="no running ActorSystem"):
        c.add.call(1)


def test_public_api_is_documented() -> None:
    for obj in (Actor, ActorRef, ActorSystem, ActorSystem.spawn, ActorSystem.aclose, broadcast, endpoint):
        doc = inspect.getdoc(obj) or ""
        assert len(doc) > 40, obj


async def test_calls_during_setup_wait_for_it(system: ActorSystem) -> None:
    gate = asyncio.Event()

    class Slow(Cruncher):
        async def setup(self) -> None:
            await gate.wait()
            await super().setup()

    spawn = asyncio.ensure_future(system.spawn(Slow, name="slow"))
    await asyncio.sleep(0.05)
    ref = ActorRef("slow", system.address, actor_class=Slow, node=system.node)
    control, normal = ref.poke.call(), ref.busy.call(0.0)  # both need what setup builds
    await asyncio.sleep(0.05)
    assert not control.done() and not normal.done()
    gate.set()
    await spawn
    assert await control == 1 and (await normal).startswith("digenrl-slow")
