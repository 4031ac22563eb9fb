"""A default cost estimate and the online speed tracker the schedules place work with.

``UniformCost`` is a linear model (a fixed per-token overhead plus per-unit seconds, divided by
``Device.speed``). It is what a schedule uses when no calibrated ``CostEstimate`` is given; the
simulator's cost model replaces it. ``SpeedTracker`` turns ``TokenDone.observed_seconds`` into a
per-device correction factor, so a device that runs slower than predicted gets smaller tokens and
counts for less capacity in TAG decisions. :func:`ring_allreduce_seconds` is the gradient all-reduce
of a multi-trainer optimizer step (NCCL's ring), which the simulator's cost model charges.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.schedule.base import CostEstimate, Device, Fragment, Token, TokenKind

__all__ = ["UniformCost", "SpeedTracker", "ring_allreduce_seconds"]


@dataclass(frozen=True, slots=True)
class UniformCost:
    """Linear seconds per token at unit speed; every term is divided by the device's speed.

    Attributes:
        overhead: fixed seconds per ROLLOUT/TRAIN token (kernel launches, latents in/out), which is
            what makes step-level batching and TSP packing pay.
        rollout_sample_step: seconds per sample per denoising step.
        reward_sample: seconds per sample to decode and score.
        train_row: seconds per (sample x timestep) row in a per-timestep loop.
        train_row_packed: seconds per row when TSP packs rows into large passes.
        optim: seconds of one optimizer step (including the gradient all-reduce).
        publish: seconds to publish one version to the rollout devices.
        switch: seconds of one colocated phase switch (offload/onload, re-shard).
    """

    overhead: float = 0.05
    rollout_sample_step: float = 0.1
    reward_sample: float = 0.05
    train_row: float = 0.3
    train_row_packed: float = 0.2
    optim: float = 0.5
    publish: float = 0.5
    switch: float = 1.0

    def seconds(self, token: Token, device: Device) -> float:
        kind = token.kind
        if kind is TokenKind.ROLLOUT:
            base = self.overhead + self.rollout_sample_step * token.num_samples * (token.step_end - token.step_start)
        elif kind is TokenKind.REWARD:
            base = self.reward_sample * token.num_samples
        elif kind is TokenKind.TRAIN:
            base = self.overhead + (self.train_row_packed if token.packed else self.train_row) * token.transitions
        elif kind is TokenKind.OPTIM:
            base = self.optim
        elif kind is TokenKind.PUBLISH:
            base = self.publish
        else:
            base = self.switch
        return base / device.speed


def ring_allreduce_seconds(nbytes: float, members: int, bytes_per_s: float, latency_s: float,
                           bucket_bytes: float = 64 * 2**20) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``members`` ranks, sent in buckets of ``bucket_bytes``.

    A ring all-reduce is a reduce-scatter then an all-gather, ``2 (n - 1)`` steps; each rank sends
    ``nbytes / n`` per step, so ``2 (n - 1) / n * nbytes`` in all, over the slowest link of the ring;
    every step of every bucket also pays the per-message latency::

        2 (n - 1) / n * nbytes / bandwidth  +  buckets * 2 (n - 1) * latency

    One member: no traffic, 0 s.
    """
    if members <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (members - 1)
    buckets = -(-nbytes // bucket_bytes)
    return steps / members * nbytes / bytes_per_s + buckets * steps * latency_s


_PROBE_FRAGMENT = Fragment(batch=0, index=0, prompt_start=0, prompt_end=1, member_start=0, member_end=1, group_size=1)


def _group(kind: TokenKind) -> int:
    """Speed is learned separately for generation, training and everything else."""
    return 0 if kind is TokenKind.ROLLOUT else 1 if kind is TokenKind.TRAIN else 2


class SpeedTracker:
    """Per-device throughput for placement: predicted units per second, corrected online.

    ``rollout_rate(name)`` is sample-steps per second and ``train_rate(name)`` is rows per second,
    from the cost estimate's prediction of a probe token (cached per device) divided by an
    exponential moving average of observed/predicted seconds, kept apart for ROLLOUT, TRAIN and
    other tokens (a device's generation and training speeds need not scale together).
    """

    def __init__(self, cost: CostEstimate, alpha: float = 0.3) -> None:
        self._cost = cost
        self._alpha = alpha
        self._devices: dict[str, Device] = {}
        self._factor: dict[tuple[str, int], float] = {}  # (device, group) -> observed / predicted, EMA
        self._rates: dict[tuple[str, int], float] = {}
        # Sum and count of live devices' speeds per (role, group), kept incrementally so that
        # relative_speed is O(1): token sizes follow speed relative to the device's peers.
        self._sum: dict[tuple[object, int], float] = {}
        self._count: dict[object, int] = {}

    def add(self, device: Device) -> None:
        if device.name in self._devices:
            self.remove(device.name)
        self._devices[device.name] = device
        role = device.role
        self._count[role] = self._count.get(role, 0) + 1
        for group in range(3):
            self._factor[(device.name, group)] = 1.0
            self._rates.pop((device.name, group), None)
            self._sum[(role, group)] = self._sum.get((role, group), 0.0) + device.speed

    def remove(self, name: str) -> None:
        """Forget a dead device's speed (it no longer counts in its peers' mean)."""
        device = self._devices.pop(name, None)
        if device is None:
            return
        self._count[device.role] -= 1
        for group in range(3):
            self._sum[(device.role, group)] -= self._speed_of(device, group)

    def _speed_of(self, device: Device, group: int) -> float:
        return device.speed / self._factor[(device.name, group)]

    def seconds(self, token: Token, name: str) -> float:
        """Predicted seconds of ``token`` on device ``name``, corrected by what was observed."""
        return self._cost.seconds(token, self._devices[name]) * self._factor[(name, _group(token.kind))]

    def observe(self, token: Token, observed: float) -> None:
        device = self._devices.get(token.device)
        if device is None or observed <= 0 or token.kind not in (TokenKind.ROLLOUT, TokenKind.TRAIN):
            return  # only generation and training speeds steer placement
        predicted = self._cost.seconds(token, device)
        if predicted <= 0:
            return
        group = _group(token.kind)
        key = (token.device, group)
        before = self._speed_of(device, group)
        self._factor[key] = (1 - self._alpha) * self._factor[key] + self._alpha * (observed / predicted)
        self._sum[(device.role, group)] += self._speed_of(device, group) - before

    def _rate(self, name: str, group: int) -> float:
        key = (name, group)
        rate = self._rates.get(key)
        if rate is None:
            n = 64  # big enough that the fixed overhead barely counts
            if group == 0:
                probe = Token(-1, TokenKind.ROLLOUT, name, 0, num_samples=n, step_start=0, step_end=1,
                              fragments=(_PROBE_FRAGMENT,))
            else:
                probe = Token(-1, TokenKind.TRAIN, name, 0, transitions=n, packed=True, fragments=(_PROBE_FRAGMENT,))
            secs = self._cost.seconds(probe, self._devices[name])
            rate = self._rates[key] = n / secs if secs > 0 else float("inf")
        return rate / self._factor[key]

    def rollout_rate(self, name: str) -> float:
        """Sample-steps per second of device ``name``."""
        return self._rate(name, 0)

    def train_rate(self, name: str) -> float:
        """Training rows per second of device ``name``."""
        return self._rate(name, 1)

    def relative_speed(self, name: str, kind: TokenKind) -> float:
        """Speed of ``name`` at ``kind`` tokens relative to the mean of live devices of its role.

        Token sizes scale with it: a device twice as fast as its peers gets twice the work per
        token, while a uniformly mis-predicted pool keeps the configured sizes.
        """
        device = self._devices[name]
        group = _group(kind)
        mean = self._sum[(device.role, group)] / max(1, self._count[device.role])
        return self._speed_of(device, group) / mean if mean > 0 else 1.0
