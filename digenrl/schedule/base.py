"""Vocabulary of the schedules: devices, the workload, tokens out and events in.

A schedule is a pure, I/O-free state machine. A driver (the simulator's virtual clock, or the real
coordinator) calls ``start()`` once and then ``on_event(event)`` for every completion, death or join,
and runs each returned ``Token`` on the device the token names. Nothing here knows about time,
processes or tensors: durations come from whoever runs the token, estimates from a ``CostEstimate``.

Versions: batch ``k`` is trained into version ``k + 1`` by one optimizer step. A rollout token carries
the single ``policy_version`` its trajectory is generated with; ``staleness = k - policy_version``
(0 on-policy, at most 1 with async1).

Contract a driver relies on (real coordinator or simulator):

- Every token names the device that runs it; a schedule only issues a token to an idle device, so a
  device's queue is at most its running token. An ``OPTIM`` token is a collective: it also occupies
  every device in ``Token.group`` (the device included) until its ``TokenDone``.
- ``TokenDone(token)`` frees the device(s). ``observed_seconds`` (optional) lets the schedule learn
  per-device speed online. ``TokenDone`` of a ``PUBLISH`` token means version ``policy_version`` is now
  on every live rollout device (the device keeps the previous version too). ``TokenDone`` of a
  ``REWARD`` token means its fragments are scored and their trajectories are durable (handed to the
  fragment store); a fragment not yet scored lives only on the device named in ``Token.sources``.
- ``DeviceDied(name)``: the device's running token is void (its ``TokenDone`` must not be sent
  later); the schedule re-issues the lost work. A dead trainer's accumulated gradients are lost too,
  so its rows of the current batch are re-trained elsewhere.
- ``DeviceJoined(device)``: the device is up and already holds the newest published version.
- ``Schedule.failed`` is a reason string once the run cannot continue (e.g. no trainer left); the
  driver stops. ``Schedule.done`` is true once every batch's optimizer step has completed.

What tokens carry for an executor: ``fragments`` (the samples: which prompts, which members of each
prompt's group), ``step_start``/``step_end`` (denoising steps, ROLLOUT), ``sources`` (device holding
each fragment's latents; ``""`` = start from noise), ``rows`` (TRAIN: which (sample x timestep)
transitions of each fragment, see ``Fragment.row``), ``policy_version`` (the version that generated
the samples: ROLLOUT generates with it, TRAIN checks staleness with it, PUBLISH publishes it).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Role",
    "Device",
    "Fragment",
    "Workload",
    "TokenKind",
    "Token",
    "TokenDone",
    "DeviceDied",
    "DeviceJoined",
    "Event",
    "CostEstimate",
    "SwitchCost",
    "Schedule",
]


class Role(enum.StrEnum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"
    REWARD = "reward"  # decodes and scores fragments; without one, the latents' holder scores
    HYBRID = "hybrid"  # colocated: samples, then trains


@dataclass(frozen=True, slots=True)
class Device:
    """One actor holding one device. ``speed`` scales its throughput relative to the cost model's unit."""

    name: str
    role: Role
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class Fragment:
    """A slice of logical batch ``batch`` along the generation axis.

    It holds prompts ``[prompt_start, prompt_end)`` and, of each of those prompts' ``group_size``
    samples, the members ``[member_start, member_end)``. Sample id (within the batch) of prompt ``p``,
    member ``m`` is ``p * group_size + m``. Local sample ``i`` (0-based, prompt-major) and trained step
    index ``t`` form training row ``i * trained_steps + t``.
    """

    batch: int
    index: int
    prompt_start: int
    prompt_end: int
    member_start: int
    member_end: int
    group_size: int

    @property
    def num_prompts(self) -> int:
        return self.prompt_end - self.prompt_start

    @property
    def num_members(self) -> int:
        return self.member_end - self.member_start

    @property
    def num_samples(self) -> int:
        return self.num_prompts * self.num_members

    def sample_id(self, local: int) -> int:
        """Batch-level sample id of this fragment's ``local``-th sample."""
        prompt = self.prompt_start + local // self.num_members
        return prompt * self.group_size + self.member_start + local % self.num_members

    def sample_ids(self) -> list[int]:
        return [self.sample_id(i) for i in range(self.num_samples)]

    def row(self, row: int, trained_steps: int) -> tuple[int, int]:
        """``(sample id, trained step index)`` of training row ``row``."""
        return self.sample_id(row // trained_steps), row % trained_steps


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

    @property
    def rows_per_batch(self) -> int:
        """Training rows (sample x trained step transitions) of one logical batch."""
        return self.samples_per_batch * self.trained_steps


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
    fragments: tuple[Fragment, ...] = ()  # ROLLOUT (several = step-level batching), REWARD, TRAIN
    rows: tuple[tuple[int, int], ...] = ()  # TRAIN: [start, end) training rows, one per fragment
    sources: tuple[str, ...] = ()  # ROLLOUT/REWARD: holder of each fragment's latents, "" = fresh
    group: tuple[str, ...] = ()  # OPTIM: all devices the collective occupies (device included)
    packed: bool = False  # TRAIN: TSP packing of (sample x timestep) rows vs a per-timestep loop
    helper: bool = False  # ROLLOUT/REWARD on a trainer (TAG)
    switch_to: str = ""  # SWITCH: "rollout" or "train"

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device this token occupies while it runs."""
        return self.group or (self.device,)


@dataclass(frozen=True, slots=True)
class TokenDone:
    token: Token
    observed_seconds: float | None = None  # measured run time; schedules learn device speed from it


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


class SwitchCost(Protocol):
    """Optional extension of a ``CostEstimate``: the TAG switch a trainer pays around helping.

    A cost estimate that also has ``helper_switch_seconds`` lets the TAG decision charge a trainer's
    onload of the rollout state (before its first helper token) and the offload back (before it
    trains again). ``seconds()`` of a helper token stays the token's own run time, so a driver that
    measures ``observed_seconds`` does not have to separate the two. Without it, switches count 0.
    """

    def helper_switch_seconds(self, device: Device) -> float: ...


class Schedule(abc.ABC):
    """Base of the schedule state machines. Subclasses decide which tokens to emit and where."""

    name: str
    failed: str | None = None  # set to a reason when the run cannot continue (e.g. no trainer left)

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


class DispatchingSchedule(Schedule):
    """The event loop every built-in schedule shares: route an event to its handler, then hand out
    whatever work may start. Subclasses write the handlers and ``_dispatch``; none re-implements the loop.
    """

    version: int
    w: Workload

    @property
    def done(self) -> bool:
        return self.version >= self.w.num_batches

    def start(self) -> list[Token]:
        out: list[Token] = []
        self._begin()
        self._dispatch(out)
        return out

    def on_event(self, event: Event) -> list[Token]:
        """Advance by one event; return the tokens that may start now.

        Raises:
            ConfigError: a joining device has a role this schedule cannot use.
            TypeError: ``event`` is not an ``Event``.
        """
        out: list[Token] = []
        if self.done or self.failed:
            return out
        if isinstance(event, TokenDone):
            self._on_done(event)
        elif isinstance(event, DeviceDied):
            self._on_died(event.device)
        elif isinstance(event, DeviceJoined):
            self._on_joined(event.device)
        else:
            raise TypeError(f"not a schedule event: {event!r}")
        if not self.done and not self.failed:
            self._before_dispatch()
            self._dispatch(out)
        return out

    def _before_dispatch(self) -> None:
        """Hook run after every event that leaves the run going (default: nothing)."""

    @abc.abstractmethod
    def _begin(self) -> None: ...

    @abc.abstractmethod
    def _dispatch(self, out: list[Token]) -> None: ...

    @abc.abstractmethod
    def _on_done(self, event: TokenDone) -> None: ...

    @abc.abstractmethod
    def _on_died(self, device: str) -> None: ...

    @abc.abstractmethod
    def _on_joined(self, device: Device) -> None: ...
