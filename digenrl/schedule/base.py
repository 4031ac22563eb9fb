"""Vocabulary of the schedules: devices, the workload, tokens out and events in.

A schedule is a pure, I/O-free state machine. A driver (the simulator's virtual clock, or the real
coordinator) calls ``start()`` once and then ``on_event(event)`` for every completion, death or join,
and runs each returned ``Token`` on the device the token names. Nothing here knows about time,
processes or tensors: durations come from whoever runs the token, estimates from a ``CostEstimate``.

Versions: batch ``k`` is trained into version ``k + 1`` by one optimizer step. A rollout token carries
the single ``policy_version`` its trajectory is generated with; ``staleness = k - policy_version``
(0 on-policy, at most 1 with async1).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Role",
    "Device",
    "Workload",
    "TokenKind",
    "Token",
    "TokenDone",
    "DeviceDied",
    "DeviceJoined",
    "Event",
    "CostEstimate",
    "Schedule",
]


class Role(enum.StrEnum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    REWARD = "reward"
    HYBRID = "hybrid"  # colocated: samples, then trains


@dataclass(frozen=True, slots=True)
class Device:
    """One actor holding one device. ``speed`` scales its throughput relative to the cost model's unit."""

    name: str
    role: Role
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class Workload:
    """What one run consumes: ``num_batches`` optimizer steps of ``prompts_per_batch`` x ``group_size`` samples."""

    num_batches: int
    prompts_per_batch: int
    group_size: int
    num_steps: int  # denoising steps per trajectory
    trained_steps: int  # transitions trained per sample (|T|)

    @property
    def samples_per_batch(self) -> int:
        return self.prompts_per_batch * self.group_size


class TokenKind(enum.StrEnum):
    ROLLOUT = "rollout"  # denoising steps [step_start, step_end) of a fragment's samples
    REWARD = "reward"  # decode and score a fragment
    TRAIN = "train"  # forward/backward over a fragment's transitions, gradients accumulate
    OPTIM = "optim"  # the optimizer step of a batch: version batch -> batch + 1
    PUBLISH = "publish"  # send a version's weights to the rollout devices
    SWITCH = "switch"  # colocated only: offload one phase's state and onload the other's


@dataclass(frozen=True, slots=True)
class Token:
    """A grant to run one unit of work on one device."""

    id: int
    kind: TokenKind
    device: str
    batch: int
    fragment: int = -1  # -1 for batch-level tokens (optim, publish, switch)
    num_samples: int = 0
    step_start: int = 0
    step_end: int = 0
    transitions: int = 0  # TRAIN: number of (sample x timestep) rows
    policy_version: int = 0
    meta: dict[str, object] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class TokenDone:
    token: Token


@dataclass(frozen=True, slots=True)
class DeviceDied:
    device: str


@dataclass(frozen=True, slots=True)
class DeviceJoined:
    device: Device


Event = TokenDone | DeviceDied | DeviceJoined


class CostEstimate(Protocol):
    """Predicted seconds of a token on a device; schedules use it to place work and to decide TAG."""

    def seconds(self, token: Token, device: Device) -> float: ...


class Schedule(abc.ABC):
    """Base of the schedule state machines. Subclasses decide which tokens to emit and where."""

    name: str

    @abc.abstractmethod
    def start(self) -> list[Token]:
        """Tokens to run at time zero."""

    @abc.abstractmethod
    def on_event(self, event: Event) -> list[Token]:
        """Advance the state machine by one event and return the tokens that may start now."""

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """True once every batch's optimizer step has run."""
