"""Sequence-parallel groups: ``placement.sp`` processes (one per device) that act as ONE rollout actor or trainer.

The coordinator knows only the group's **leader** (``rollout-0``, ``trainer-0``): one name, one token at a
time, one publication target, one checkpoint and digest. The other **members** (``rollout-0-sp1``, ...) are
actor processes the recipe spawns beside it; they hold the full weights and run the same endpoint bodies
with the same inputs, so every transformer forward and backward is a collective of the group
(:func:`digenrl.models.sequence_parallel.parallelize` splits its sequence over the members).

How a member gets each call's inputs (never pickled: every message is the actor runtime's msgpack):

* ``@mirrored`` endpoints: the leader calls the same endpoint of every member, concurrently with its own
  body, and answers once all are done (its own result; the members' are the same). Rollout, train,
  optimizer step, checkpoint load, the fixed evaluation, weight staging (zmq lane) and probes are mirrored.
* A fragment handed over from another actor reaches the leader only: each member asks the leader for it
  (``sp_fragment``, a control endpoint answered while the leader computes), or learns that the leader
  recomputes it from noise and does the same. Fragments held by the group are held by every member.
* Stored fragments (trainers): a member fetches them from the storing trainer, as any trainer does.
* Weights on the gloo / nccl lane reach the leader; it stages them on every member (zmq lane messages).

Trainers form one torch.distributed world of every trainer process (``trainer x trainer_sp`` ranks, the
trainer group's one rendezvous); inside it each SP group is a sub-group (``sync_gradients`` over it) and
the members of the same SP rank across trainers form the data-parallel sub-group that the DDP all-reduce
runs over (a 2-D mesh, data parallel x SP). A rollout SP group forms a world of its own the same way.

Faults: the group lives and dies as one. A member that dies fails the leader's mirrored call with
``ActorDied``; the leader then leaves (its process exits), so the coordinator sees one dead actor and
re-issues its tokens (a trainer group stops the run, as any dead trainer does). The recipe also reports a
leader dead as soon as any member is (``Cluster.is_dead``), which covers an idle group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from digenrl.actors.base import endpoint
from digenrl.errors import ActorDied

__all__ = ["SpPlace", "SequenceParallel", "mirrored", "member_name", "sp_members", "sp_summary", "mesh_ranks"]

log = logging.getLogger(__name__)

LEAVE_CODE = 75  # the exit status of a member that leaves because its group broke
DEATH_GRACE_S = 5.0  # how long a failed collective waits for the death notice of the member that broke it


def member_name(leader: str, rank: int) -> str:
    """The actor name of SP rank ``rank`` of ``leader``'s group (rank 0 is the leader itself)."""
    return leader if rank == 0 else f"{leader}-sp{rank}"


def sp_members(leader: str, size: int) -> list[str]:
    """Every member's name of ``leader``'s group of ``size``, leader first."""
    return [member_name(leader, r) for r in range(size)]


def sp_summary(placement: Any) -> str:
    """One line for ``digenrl validate`` and the run's log: each role's SP degree and the processes it takes."""
    parts = []
    for role, count in (("rollout", placement.rollout), ("trainer", placement.trainer)):
        sp = placement.sp_of(role)
        parts.append(f"{count} {role} actor(s) of sp = {sp}" + (f" ({count * sp} processes)" if sp > 1 else ""))
    parts.append(f"{placement.reward} reward actor(s) of sp = 1")
    return f"sequence parallelism: {', '.join(parts)}; {placement.actors} actor processes in all"


def mesh_ranks(world: int, sp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The trainer world's 2-D mesh: ``(sp_groups, dp_groups)`` as rank lists.

    Trainer ``g``'s members are ranks ``g*sp .. g*sp + sp - 1`` (spawn order); the data-parallel group of SP
    rank ``s`` holds rank ``s`` of every trainer.
    """
    if world % sp:
        raise ValueError(f"a trainer world of {world} ranks does not split into SP groups of {sp}")
    sp_groups = [list(range(g * sp, (g + 1) * sp)) for g in range(world // sp)]
    dp_groups = [list(range(s, world, sp)) for s in range(sp)]
    return sp_groups, dp_groups


@dataclass(frozen=True)
class SpPlace:
    """This process's place in its sequence-parallel group: ``rank`` of ``members`` (leader first)."""

    rank: int
    members: list[str]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> str:
        return self.members[0]

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "members": list(self.members)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SpPlace:
        return cls(int(d["rank"]), [str(m) for m in d["members"]])


def reachable_host(address: str) -> str:
    """The host peers reach an actor at ``address`` by (its TCP address; loopback for ipc)."""
    host = urlsplit(address).hostname if address.startswith("tcp://") else None
    return host if host and host not in ("0.0.0.0", "*") else "127.0.0.1"


def parallelize_model(model: Any, group: Any, mesh: Any = None) -> None:
    """Make ``model``'s transformer run sequence-parallel over ``group`` (every member calls it; with the world's
    ``(dp, sp)`` mesh, every rank of the world)."""
    from digenrl.models.sequence_parallel import parallelize

    parallelize(model, group, mesh)


def leave(name: str, why: str) -> None:
    """This member's group broke: exit the process, so the run sees the whole group as one dead actor.

    A collective with a dead peer may never return (NCCL waits for its timeout): nothing here can be trusted
    to finish, and the device is free at once.
    """
    log.error("%s: sequence-parallel group broken (%s); this member leaves so its work is re-issued", name, why)
    logging.shutdown()
    os._exit(LEAVE_CODE)


class SequenceParallel:
    """Mixin of the role actors: membership of a sequence-parallel group (none: ``sp`` is None)."""

    name: str
    peers: dict[str, Any]
    sp: SpPlace | None = None
    sp_group: Any = None  # the members' torch.distributed group
    dp_group: Any = None  # trainers: the data-parallel group of this SP rank (None: the whole trainer world)

    @property
    def sp_leads(self) -> bool:
        """This process leads a group of several members (it mirrors calls to them)."""
        return self.sp is not None and self.sp.rank == 0 and self.sp.size > 1

    @property
    def sp_follows(self) -> bool:
        return self.sp is not None and self.sp.rank > 0

    def _handed(self) -> dict[tuple[int, int], asyncio.Future[Any]]:
        if "_sp_handed" not in self.__dict__:
            self._sp_handed: dict[tuple[int, int], asyncio.Future[Any]] = {}
        return self._sp_handed

    # -- forming ---------------------------------------------------------------------------------
    @endpoint
    async def open_sp_group(self, size: int) -> str:
        """Rollout leader: open its group's rendezvous (a TCPStore on a free port of its host); returns ``host:port``."""
        from digenrl.roles.trainer_group import open_store

        host = reachable_host(self.ref.address)  # type: ignore[attr-defined]  # the Actor this mixes into
        self._sp_store = await self._compute(open_store, host, size, self.cfg.train.group_timeout)  # type: ignore[attr-defined]
        return f"{host}:{self._sp_store.port}"

    @endpoint
    async def join_sp_group(self, place: dict[str, Any], address: str) -> str:
        """Rollout member: join its group's torch.distributed world (all members together) and split the model."""
        self.sp = SpPlace.from_wire(place)
        await self._compute(self._join_sp_world, address)  # type: ignore[attr-defined]
        return self.name

    def _join_sp_world(self, address: str) -> None:
        import torch.distributed as dist

        from digenrl.roles.trainer_group import TrainerGroup, group_backend

        assert self.sp is not None
        cfg = self.cfg  # type: ignore[attr-defined]
        self._sp_world = TrainerGroup(self.sp.rank, self.sp.size, address, group_backend(cfg.model.device),
                                      cfg.train.group_timeout, store=getattr(self, "_sp_store", None),
                                      label=f"sequence-parallel group of {self.sp.leader}")
        self.sp_group = dist.group.WORLD
        parallelize_model(self.engine.model, self.sp_group)  # type: ignore[attr-defined]

    def _join_trainer_mesh(self, group: dict[str, Any], model: Any) -> None:
        """Trainer (inside the trainer world just formed): its SP and data-parallel sub-groups; the model split.

        Every trainer process builds the world's ``(dp, sp)`` mesh (the layout of :func:`mesh_ranks`) and splits
        its model over it at once: both create groups by collectives of the whole world.
        """
        from digenrl.models.sequence_parallel import dp_sp_mesh

        sp = group.get("sp")
        if not sp:
            return
        self.sp = SpPlace.from_wire(sp)
        mesh = dp_sp_mesh(self.sp.size, torch.device(self.cfg.model.device).type)  # type: ignore[attr-defined]
        self.sp_group, self.dp_group = mesh.get_group("sp"), mesh.get_group("dp")
        parallelize_model(model, self.sp_group, mesh)

    def sync_sp_gradients(self, params: list[torch.Tensor]) -> None:
        """After the backward passes of a step: each member's gradients become the SP=1 gradients."""
        if self.sp is None or self.sp.size == 1:
            return
        from digenrl.models.sequence_parallel import sync_gradients

        sync_gradients(params, self.sp_group)

    def close_sp(self) -> None:
        world = getattr(self, "_sp_world", None)
        if world is not None:
            world.close()

    # -- inputs of the members ---------------------------------------------------------------------
    def sp_hand(self, key: tuple[int, int], data: dict[str, Any] | None) -> None:
        """Leader: fragment ``key`` of the running rollout token as it arrived (``None``: recomputed from noise)."""
        if self.sp_leads:
            fut = self._handed().setdefault(key, asyncio.get_running_loop().create_future())
            if not fut.done():
                fut.set_result(data)

    @endpoint(control=True)
    async def sp_fragment(self, batch: int, index: int) -> dict[str, Any] | None:
        """Leader, for a member: fragment ``(batch, index)`` as the leader took it from its holder for the running
        rollout token (waits until it has), or ``None`` when the leader recomputes it from noise."""
        fut = self._handed().setdefault((batch, index), asyncio.get_running_loop().create_future())
        return await asyncio.shield(fut)

    async def sp_taken(self, key: tuple[int, int]) -> dict[str, Any] | None:
        """Member: what its leader took for fragment ``key`` (``None``: recompute it)."""
        assert self.sp is not None
        return await self.peers[self.sp.leader].sp_fragment.call(key[0], key[1])  # type: ignore[no-any-return]

    @endpoint
    async def sp_drop(self, keys: list[list[int]]) -> int:
        """Member: forget fragments its leader handed over or scored (the leader popped its own copy)."""
        held = self.engine.fragments  # type: ignore[attr-defined]
        return sum(held.pop((b, i), None) is not None for b, i in keys)

    def sp_tell_drop(self, keys: list[tuple[int, int]]) -> None:
        """Leader: its members drop their copies of ``keys`` (in order with the calls that follow)."""
        if self.sp_leads and keys:
            assert self.sp is not None
            for member in self.sp.members[1:]:
                self.peers[member].sp_drop.tell([list(k) for k in keys])

    async def sp_run(self, method: str, own: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Leader: run ``own`` (this process's body of ``method``) beside the members' calls of it; its result.

        Raises:
            Exception: the leader's or a member's error (a member's death instead makes this process leave).
        """
        assert self.sp is not None
        calls = [asyncio.ensure_future(getattr(self.peers[m], method).call(*args, **kwargs))
                 for m in self.sp.members[1:]]
        mine = asyncio.ensure_future(own)
        try:
            results = await asyncio.gather(mine, *calls)
        except ActorDied as exc:
            leave(self.name, f"{exc}")
            raise
        except Exception:
            # A member's death fails the collectives of all the others: its notice may come a moment later.
            await asyncio.wait(calls, timeout=DEATH_GRACE_S)
            dead = [c.exception() for c in calls if c.done() and not c.cancelled() and isinstance(c.exception(), ActorDied)]
            if dead:
                leave(self.name, f"{dead[0]}")
            raise
        finally:
            for fut in self._handed().values():  # a member still waiting for a fragment the leader never took
                fut.cancel()
            self._handed().clear()
        return results[0]


    async def sp_call_members(self, method: str, *args: Any) -> None:
        """Leader: call ``method`` of every member with ``args`` (the failure rule of :meth:`sp_run`)."""
        if self.sp_leads:
            await self.sp_run(method, asyncio.sleep(0), args, {})


def mirrored(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an ``async`` endpoint body that every member of a sequence-parallel group runs with the same
    arguments: on the leader it also calls the members' (see the module docstring)."""

    @functools.wraps(fn)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.sp_leads:
            return await fn(self, *args, **kwargs)
        return await self.sp_run(fn.__name__, fn(self, *args, **kwargs), args, kwargs)

    return run
