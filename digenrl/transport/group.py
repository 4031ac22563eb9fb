"""The communicator interface: what one member of a runtime-formed group can do, and the spec it
joins by. Implementations: :class:`digenrl.transport.communicator.GlooCommunicator` (CPU twin) and
:class:`digenrl.transport.nccl.NcclCommunicator`; formation, ordering and the seam's overview are in
:mod:`digenrl.transport.communicator`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from digenrl.errors import ProtocolError

__all__ = ["COMM_KINDS", "Communicator", "GroupSpec"]

COMM_KINDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one generation of a group (made by the root).

    Attributes:
        kind: ``gloo`` or ``nccl``.
        generation: increases with every re-formation of the group under one root.
        world: number of members, the root included (rank 0).
        uid: NCCL: the 128-byte unique id of ``cupy.cuda.nccl.get_unique_id()``; gloo: a random
            nonce naming this generation's key prefix in the root's store.
        address: gloo: ``host:port`` of the root's ``TCPStore``; NCCL: unused (the unique id holds
            the root's bootstrap address).
        timeout_s: how long joining and each operation may wait for a peer.
    """

    kind: str
    generation: int
    world: int
    uid: bytes
    address: str = ""
    timeout_s: float = 120.0

    def to_wire(self) -> dict[str, Any]:
        """A plain dict (msgpack: bytes stay bytes) for the actor control channel."""
        return {"kind": self.kind, "gen": self.generation, "world": self.world, "uid": self.uid,
                "addr": self.address, "timeout": self.timeout_s}

    @classmethod
    def from_wire(cls, wire: Any) -> GroupSpec:
        """Validate a spec received over the control channel.

        Raises:
            ProtocolError: a field is missing or of the wrong type (names the field).
        """
        if not isinstance(wire, dict):
            raise ProtocolError(f"group spec must be a dict, got {type(wire).__name__}")
        checks = {"kind": lambda v: v in COMM_KINDS, "gen": lambda v: _int(v) and v >= 0,
                  "world": lambda v: _int(v) and v >= 1, "uid": lambda v: isinstance(v, bytes) and 0 < len(v) <= 4096,
                  "addr": lambda v: isinstance(v, str), "timeout": lambda v: isinstance(v, int | float) and v > 0}
        for key, ok in checks.items():
            if key not in wire:
                raise ProtocolError(f"group spec lacks field {key!r}")
            if not ok(wire[key]):
                raise ProtocolError(f"group spec field {key!r} is invalid: {wire[key]!r:.60}")
        return cls(wire["kind"], wire["gen"], wire["world"], wire["uid"], wire["addr"], float(wire["timeout"]))


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Communicator(ABC):
    """One member's handle on one generation of a group.

    Operations are blocking collectives (run them off the event loop, see :class:`OrderedOps`):
    every member calls the same operation with buffers of the same sizes in the same order.
    Buffers are contiguous tensors on :attr:`device`; ``broadcast`` and ``recv`` write into them.

    Raises (from every operation):
        TransportBroken: a peer died or did not answer within the spec's timeout.
        ValueError: a buffer is not contiguous or not on :attr:`device` (names its index).
    """

    kind: ClassVar[str]

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        if not 0 <= rank < spec.world:
            raise ValueError(f"rank {rank} is outside the group of {spec.world} (generation {spec.generation})")
        self.spec = spec
        self.rank = rank

    @property
    def world(self) -> int:
        return self.spec.world

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where buffers must live."""

    @property
    def stream(self) -> Any:
        """The stream operations are queued on (``None``: host memory, operations are synchronous)."""
        return None

    @abstractmethod
    def broadcast(self, buffers: Sequence[torch.Tensor], root: int = 0) -> None:
        """Copy ``root``'s buffers into every other member's buffers (same sizes everywhere)."""

    @abstractmethod
    def send(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        """Send buffers to ``peer``, which calls :meth:`recv` with buffers of the same sizes."""

    @abstractmethod
    def recv(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        """Receive into buffers what ``peer`` sends with :meth:`send`."""

    @abstractmethod
    def close(self) -> None:
        """Release this member's side of the group (idempotent)."""

    def _check(self, buffers: Sequence[torch.Tensor], who: int, what: str) -> None:
        if not 0 <= who < self.world:
            raise ValueError(f"{what} {who} is outside the group of {self.world} (generation {self.generation})")
        for i, b in enumerate(buffers):
            if not isinstance(b, torch.Tensor) or not b.is_contiguous() or b.device != self.device:
                raise ValueError(f"buffer {i}: expected a contiguous tensor on {self.device}, got "
                                 f"{getattr(b, 'device', type(b).__name__)} (contiguous: {getattr(b, 'is_contiguous', lambda: '-')()})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world}, generation={self.generation})"
