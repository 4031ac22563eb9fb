"""A default cost estimate and the online speed tracker the schedules place work with.

``UniformCost`` is a linear model (a fixed per-token overhead plus per-unit seconds, divided by
``Device.speed``). It is what a schedule uses when no calibrated ``CostEstimate`` is given; the
simulator's cost model replaces it. ``SpeedTracker`` turns ``TokenDone.observed_seconds`` into a
per-device correction factor, so a device that runs slower than predicted gets smaller tokens and
counts for less capacity in TAG decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.schedule.base import CostEstimate, Device, Fragment, Token, TokenKind

__all__ = ["UniformCost", "SpeedTracker"]


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


_PROBE_FRAGMENT = Fragment(batch=0, index=0, prompt_start=0, prompt_end=1, member_start=0, member_end=1, group_size=1)


class SpeedTracker:
    """Per-device throughput for placement: predicted units per second, corrected online.

    ``rollout_rate(name)`` is sample-steps per second and ``train_rate(name)`` is rows per second,
    from the cost estimate's prediction of a probe token (cached per device) divided by an
    exponential moving average of observed/predicted seconds.
    """

    def __init__(self, cost: CostEstimate, alpha: float = 0.3) -> None:
        self._cost = cost
        self._alpha = alpha
        self._devices: dict[str, Device] = {}
        self._factor: dict[str, float] = {}  # observed / predicted, EMA
        self._rates: dict[tuple[str, bool], float] = {}

    def add(self, device: Device) -> None:
        self._devices[device.name] = device
        self._factor.setdefault(device.name, 1.0)

    def seconds(self, token: Token, name: str) -> float:
        """Predicted seconds of ``token`` on device ``name``, corrected by what was observed."""
        return self._cost.seconds(token, self._devices[name]) * self._factor[name]

    def observe(self, token: Token, observed: float) -> None:
        name = token.device
        if name not in self._devices or observed <= 0:
            return
        predicted = self._cost.seconds(token, self._devices[name])
        if predicted <= 0:
            return
        old = self._factor[name]
        self._factor[name] = (1 - self._alpha) * old + self._alpha * (observed / predicted)

    def _rate(self, name: str, rollout: bool) -> float:
        key = (name, rollout)
        rate = self._rates.get(key)
        if rate is None:
            device = self._devices[name]
            n = 64  # big enough that the fixed overhead barely counts
            if rollout:
                probe = Token(-1, TokenKind.ROLLOUT, name, 0, num_samples=n, step_start=0, step_end=1,
                              fragments=(_PROBE_FRAGMENT,))
            else:
                probe = Token(-1, TokenKind.TRAIN, name, 0, transitions=n, packed=True, fragments=(_PROBE_FRAGMENT,))
            secs = self._cost.seconds(probe, device)
            rate = n / secs if secs > 0 else float("inf")
            self._rates[key] = rate
        return rate / self._factor[name]

    def rollout_rate(self, name: str) -> float:
        """Sample-steps per second of device ``name``."""
        return self._rate(name, rollout=True)

    def train_rate(self, name: str) -> float:
        """Training rows per second of device ``name``."""
        return self._rate(name, rollout=False)

    def relative_speed(self, name: str) -> float:
        """Speed of ``name`` relative to ``Device.speed == 1`` predictions, for sizing its tokens."""
        return self._devices[name].speed / self._factor[name]
