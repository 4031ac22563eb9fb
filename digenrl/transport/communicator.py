"""The communicator seam: a group of processes formed at runtime that moves flat device buffers.

Weight publication (one trainer to many rollout actors) and device latents need three things:
``broadcast`` a list of buffers from a root, ``send`` / ``recv`` them to / from one peer, on the
communicator's stream. Every member enters each operation in the same order (they are collectives).

Formation, without a torch.distributed world and without environment variables, so actors started
at different times (``digenrl worker --join``, a cluster engine, a re-spawn after a crash) can join
and leave::

    host = GroupHost("gloo", "127.0.0.1")            # root side, once
    spec = host.new_group(world=3)                   # generation g+1; a msgpack-able dict on the wire
    # every member r (the root is rank 0) is handed spec.to_wire() over the actor control channel:
    comm = join_group(GroupSpec.from_wire(wire), r)  # blocks until all `world` members joined

A group is never changed in place: when a member dies or a new one arrives, the root makes the next
*generation* (a new NCCL unique id, or a fresh store prefix for gloo) and the members of the new
membership join it; the old communicator is dropped. Nothing of generation g can meet generation g+1:
gloo's rendezvous keys live under a per-generation prefix with a random nonce, NCCL's under a new
unique id, and :class:`OrderedOps` refuses an operation numbered for another generation.

Implementations: :class:`GlooCommunicator` here (the CPU twin, over a ``ProcessGroupGloo`` built on a
``TCPStore`` that the root opens on a free port of its host) and
:class:`digenrl.transport.nccl.NcclCommunicator` (``cupy.cuda.nccl``; the unique id's 128 bytes ride
in ``uid``). Both take contiguous buffers on :attr:`Communicator.device` and are bit-exact (gloo moves
every buffer as raw bytes; NCCL maps dtypes, bf16 as raw 16-bit).

Ordering: the operations are blocking and every member must enter them in one order. The root
numbers them (``seq`` 0, 1, ... within a generation) and sends the number with the control message;
:class:`OrderedOps` runs a member's operations on one thread of their own in that order, whatever
order the control messages were handled in, so concurrent publications cannot cross.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from digenrl.errors import ProtocolError, TransportBroken, TransportClosed
from digenrl.transport.gloo_iface import gloo_device
# The interface lives in its own file so that the implementations (nccl.py) import it without a circle.
from digenrl.transport.group import COMM_KINDS, Communicator, GroupSpec

__all__ = ["COMM_KINDS", "Communicator", "GlooCommunicator", "GroupHost", "GroupSpec", "OrderedOps", "join_group",
           "join_group_async"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class GlooCommunicator(Communicator):
    """The CPU twin: a ``ProcessGroupGloo`` outside any torch.distributed world.

    It joins through the root's ``TCPStore`` under the prefix ``digenrl-g<generation>-<nonce>``, so
    it never touches the default process group (a trainer keeps its own) and a re-formed group's
    rendezvous keys never meet the old one's. Every buffer travels as raw bytes (bit-exact for any
    dtype, bf16 included).
    """

    kind = "gloo"

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        import torch.distributed as dist

        super().__init__(spec, rank)
        host, port = spec.address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            self._store: Any = dist.TCPStore(host.strip("[]"), int(port), None, False, timeout=timeout)
            prefix = dist.PrefixStore(f"digenrl-g{spec.generation}-{spec.uid.hex()}", self._store)
            # Listen where the other members reach us (gloo's own default, the host name's address, is
            # often loopback: a group across hosts would never form); see gloo_iface.
            options = dist.ProcessGroupGloo._Options()
            options._devices = [gloo_device(host, f"gloo group generation {spec.generation} rank {rank}")]
            options._timeout, options._threads = timeout, 2
            self._pg: Any = dist.ProcessGroupGloo(prefix, rank, spec.world, options)
        except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
            raise TransportBroken(f"gloo group generation {spec.generation}: rank {rank} could not join "
                                  f"{spec.address} within {spec.timeout_s:g} s: {exc}") from exc
        self._tags: dict[int, int] = {}
        self._inflight = 0  # operations between issue and completion (see close)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def broadcast(self, buffers: Sequence[torch.Tensor], root: int = 0) -> None:
        import torch.distributed as dist

        self._check(buffers, root, "root")
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        # Issue every bucket, then wait: gloo pipelines them instead of a round trip per bucket.
        self._wait([self._pg.broadcast([_raw(b)], opts) for b in buffers if b.numel()], f"broadcast from {root}")

    def send(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        self._check(buffers, peer, "peer")
        self._wait([self._pg.send([_raw(b)], peer, self._next_tag(peer)) for b in buffers if b.numel()],
                   f"send to {peer}")

    def recv(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        self._check(buffers, peer, "peer")
        self._wait([self._pg.recv([_raw(b)], peer, self._next_tag(peer)) for b in buffers if b.numel()],
                   f"recv from {peer}")

    def _next_tag(self, peer: int) -> int:
        # One counter per pair: both ends see the same sequence of p2p buffers between them, so the
        # tags of a send and its recv match whatever else either end exchanged with third members.
        self._tags[peer] = self._tags.get(peer, 0) + 1
        return self._tags[peer]

    def _wait(self, works: list[Any], what: str) -> None:
        self._inflight += 1
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:
            raise TransportBroken(f"gloo group generation {self.generation} rank {self.rank}: {what} failed "
                                  f"(a peer died or timed out after {self.spec.timeout_s:g} s): {exc}") from exc
        finally:
            self._inflight -= 1

    def close(self) -> None:
        held = [self._pg, self._store]
        self._pg = self._store = None
        if not self._inflight:
            held.clear()
            return
        # A ProcessGroupGloo's destructor waits for its running operations, which after a peer's
        # death only end at the timeout, holding the GIL: drop the last reference on a thread of
        # its own, never on the event loop (it would stop heartbeats and control endpoints).
        threading.Thread(target=held.clear, name=f"digenrl-comm-drop-g{self.generation}", daemon=True).start()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class GroupHost:
    """The root's side of a group across its generations.

    gloo: opens one ``TCPStore`` server on a free port of ``host`` (the root's address as peers reach
    it; loopback by default) and gives each generation a random key prefix. NCCL: each generation gets
    a fresh unique id.

    Args:
        kind: ``gloo`` or ``nccl``.
        host: the interface members reach the root's store on (gloo).
        timeout_s: join and operation timeout written into every spec.

    Raises:
        ValueError: an unknown ``kind``.
    """

    def __init__(self, kind: str, host: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        if kind not in COMM_KINDS:
            raise ValueError(f"communicator kind {kind!r} is not one of {', '.join(COMM_KINDS)}")
        self.kind, self.host, self.timeout_s = kind, host, timeout_s
        self.generation = -1
        self._store: Any = None

    def new_group(self, world: int) -> GroupSpec:
        """The spec of the next generation, for ``world`` members (this root is rank 0)."""
        self.generation += 1
        if self.kind == "nccl":
            from digenrl.transport.nccl import new_unique_id

            return GroupSpec("nccl", self.generation, world, new_unique_id(), "", self.timeout_s)
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(self.host, 0, None, True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        host = f"[{self.host}]" if ":" in self.host else self.host
        return GroupSpec("gloo", self.generation, world, os.urandom(8), f"{host}:{self._store.port}", self.timeout_s)

    def close(self) -> None:
        self._store = None


def join_group(spec: GroupSpec, rank: int, device: torch.device | str | None = None) -> Communicator:
    """Join ``spec``'s generation as ``rank``; blocks until all ``spec.world`` members joined.

    ``device``: NCCL's CUDA device (default: the current one; gloo always works in host memory).

    Raises:
        TransportBroken: the group did not form within ``spec.timeout_s``.
        ConfigError: NCCL asked for but cupy or CUDA is missing here.
    """
    if spec.kind == "nccl":
        from digenrl.transport.nccl import NcclCommunicator

        return NcclCommunicator(spec, rank, device)
    return GlooCommunicator(spec, rank)


async def join_group_async(spec: GroupSpec, rank: int, device: torch.device | str | None = None) -> Communicator:
    """:func:`join_group` off the event loop, on a daemon thread.

    Not ``asyncio.to_thread``: a join whose peer died waits out the spec's timeout, and the default
    executor's threads are joined when the loop closes, which would hold up the process's exit.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Communicator] = loop.create_future()

    def work() -> None:
        try:
            result, error = join_group(spec, rank, device), None
        except BaseException as exc:  # delivered to the awaiting task
            result, error = None, exc
        _settle(fut, result, error)

    threading.Thread(target=work, name=f"digenrl-comm-join-g{spec.generation}", daemon=True).start()
    return await fut


class OrderedOps:
    """Runs one member's operations on a thread of their own, in the order the root numbered them.

    ``await ops.run(seq, fn)`` waits until every operation numbered below ``seq`` was submitted, then
    runs ``fn()`` (a blocking communicator call) on the thread. The event loop stays free meanwhile.
    After one operation failed, the generation is broken: every later one raises ``TransportBroken``
    at once instead of waiting for peers that will never come (the root re-forms the group).

    Args:
        comm: the communicator of one generation.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.next_seq = 0
        self._cond = asyncio.Condition()
        # A daemon thread, not a ThreadPoolExecutor: an operation stuck on a dead peer must not
        # hold up the process's exit (executors' threads are joined at exit).
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"digenrl-comm-g{comm.generation}", daemon=True)
        self._thread.start()
        self.broken: BaseException | None = None

    @property
    def generation(self) -> int:
        return self.comm.generation

    async def run(self, seq: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` as operation ``seq`` of this generation.

        Raises:
            ProtocolError: ``seq`` was already used.
            TransportBroken: this generation broke (an earlier operation failed).
            TransportClosed: the member left this generation (``close``).
        """
        async with self._cond:
            await self._cond.wait_for(lambda: self.next_seq >= seq or self.broken is not None)
            self._raise_if_broken()
            if seq != self.next_seq:
                raise ProtocolError(f"operation {seq} of generation {self.generation} was already run "
                                    f"(next is {self.next_seq})")
            fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            self._jobs.put((fn, fut))
            self.next_seq += 1
            self._cond.notify_all()
        return await fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                self._raise_if_broken()
                result, error = fn(), None
            except BaseException as exc:  # delivered to the awaiting task
                if self.broken is None:
                    self.broken = exc
                result, error = None, exc
            _settle(fut, result, error)
            del job, fn, fut  # the next get() may block for long: hold nothing meanwhile

    def _raise_if_broken(self) -> None:
        if isinstance(self.broken, TransportClosed):
            raise TransportClosed(str(self.broken))
        if self.broken is not None:
            raise TransportBroken(f"generation {self.generation} is broken: {self.broken}")

    def close(self) -> None:
        """Leave this generation: waiting operations raise, the thread ends when its call returns."""
        if self.broken is None:
            self.broken = TransportClosed(f"left generation {self.generation}")
        self._jobs.put(None)
        self.comm.close()
        self._wake()

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._cond:
                self._cond.notify_all()

        try:
            self._waking = asyncio.get_running_loop().create_task(notify())  # held: a bare task may be collected
        except RuntimeError:  # no loop running (closing at exit): nobody can be waiting
            pass


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete ``fut`` from the operation thread (on its loop; a closed loop has nobody to tell)."""
    def done() -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        fut.get_loop().call_soon_threadsafe(done)
    except RuntimeError:
        pass
