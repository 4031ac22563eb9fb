"""A cost model measured on this machine: seconds per token fitted to real runs' tokens.

``digenrl bench bubbles --real`` fits it (and calibrates the simulator with it, see
``recipes/bench_real.py``); ``digenrl plan --fleet --costs bubbles.json`` plans with it, so a split
for the machine the bench ran on is chosen from what that machine measured, not from a GPU profile.

Besides the per-kind linear fits (``overhead + per_unit x units``), a plan needs what changes with the
split and the token sizes and that one placement's compute tokens do not show (costs version 2):

- ``dispatch_s``: the per-token overhead a device pays beyond its compute (the call's trip and the
  coordinator's handling of the result), charged on every ROLLOUT/REWARD/TRAIN token, so finer tokens
  cost more in all;
- ``optim``: one trainer's optimizer step, plus ``allreduce`` (bytes, bandwidth, latency measured over
  the trainer group's backend) priced by :func:`~digenrl.schedule.cost.ring_allreduce_seconds` for a
  group of several trainers;
- ``publish``: one weight publication;
- ``contention`` (optional): how the host's busy single-thread processes slow each other
  (:mod:`digenrl.sim.contention`); with it the fits are a process's seconds alone and the simulator
  applies the slowdown of each moment's busy devices.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Token, TokenKind
from digenrl.schedule.cost import ring_allreduce_seconds
from digenrl.sim.contention import Contention

__all__ = ["MeasuredCost", "AllReduce", "COSTS_VERSION"]

# 2: dispatch_s, optim, publish and the trainer-group all-reduce measured (version 1 files priced none of them)
COSTS_VERSION = 2
_COMPUTE = (TokenKind.ROLLOUT, TokenKind.REWARD, TokenKind.TRAIN)


def _units(token: Token) -> float:
    if token.kind is TokenKind.ROLLOUT:
        return float(token.num_samples * (token.step_end - token.step_start))
    if token.kind is TokenKind.REWARD:
        return float(token.num_samples)
    if token.kind is TokenKind.TRAIN:
        return float(token.transitions)
    return 1.0


@dataclass(frozen=True)
class AllReduce:
    """A gradient all-reduce measured on this machine: ``nbytes`` (the trainable set) and the ring's link."""

    nbytes: float
    bytes_per_s: float
    latency_s: float

    def seconds(self, members: int) -> float:
        return ring_allreduce_seconds(self.nbytes, members, self.bytes_per_s, self.latency_s)

    @classmethod
    def from_timings(cls, nbytes: float, small_s: float, full_s: float) -> AllReduce:
        """From two 2-rank timings: a one-element all-reduce (``2`` latencies) and one of ``nbytes``."""
        latency = max(0.0, small_s) / 2.0
        transfer = max(full_s - 2.0 * latency, 1e-9)
        return cls(float(nbytes), float(nbytes) / transfer, latency)


@dataclass(frozen=True)
class MeasuredCost:
    """A cost estimate fitted to measured tokens: ``seconds = overhead + per_unit x units`` per kind.

    ``fits["optim"]`` is one trainer's step (overhead), ``fits["publish"]`` one publication; ``dispatch_s``,
    ``allreduce`` and ``contention`` as the module docstring says (0 / ``None``: not measured, not charged).
    """

    fits: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (overhead, per unit)
    dispatch_s: float = 0.0
    allreduce: AllReduce | None = None
    contention: Contention | None = None

    @classmethod
    def fit(cls, samples: list[tuple[Token, float]]) -> MeasuredCost:
        """Least squares per token kind (overhead clamped at >= 0; one unit size: per-unit mean)."""
        by: dict[str, list[tuple[float, float]]] = {}
        for token, secs in samples:
            by.setdefault(token.kind.value, []).append((_units(token), secs))
        fits = {}
        for kind, pts in by.items():
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0
            overhead = my - slope * mx
            if var == 0 or slope <= 0 or overhead < 0:
                overhead, slope = (0.0, my / mx) if mx > 0 else (my, 0.0)
            fits[kind] = (overhead, slope)
        return cls(fits)

    def seconds(self, token: Token, device: Device) -> float:
        kind = token.kind
        overhead, per = self.fits.get(kind.value, (1e-3, 0.0))
        base = max(1e-4, overhead + per * _units(token))
        if kind in _COMPUTE:
            base += self.dispatch_s
        elif kind is TokenKind.OPTIM and self.allreduce is not None:
            base += self.allreduce.seconds(len(token.devices))
        return base / device.speed

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float:
        return 0.0  # a TAG trainer holds the newest weights already: no onload/offload on CPU

    def scaled(self, factor: float) -> MeasuredCost:
        """Every cost ``factor`` times as long (e.g. two busy processes sharing the machine's memory)."""
        return MeasuredCost({k: (o * factor, p * factor) for k, (o, p) in self.fits.items()},
                            self.dispatch_s * factor, self.allreduce, self.contention)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The per-kind fits (``calibration.measured_costs``); see :meth:`to_calibration` for the rest."""
        return {k: {"overhead_s": o, "per_unit_s": p} for k, (o, p) in self.fits.items()}

    def to_calibration(self) -> dict[str, Any]:
        """Everything a plan reads back with :meth:`from_calibration`, as ``bubbles.json`` stores it."""
        out: dict[str, Any] = {"costs_version": COSTS_VERSION, "measured_costs": self.to_dict(),
                               "dispatch_s": self.dispatch_s}
        if self.allreduce is not None:
            a = self.allreduce
            out["allreduce"] = {"bytes": a.nbytes, "bytes_per_s": a.bytes_per_s, "latency_s": a.latency_s,
                                "seconds_2": a.seconds(2)}
        if self.contention is not None:
            out["contention"] = self.contention.to_dict()
        return out

    @classmethod
    def from_calibration(cls, cal: dict[str, Any], where: str = "calibration") -> MeasuredCost:
        """Read :meth:`to_calibration`'s dict back.

        Raises:
            ConfigError: a field is missing or malformed (named), or the file predates costs version 2.
        """
        version = cal.get("costs_version")
        if version is None or version < COSTS_VERSION:
            raise ConfigError(
                f"{where}.costs_version: {version!r}, need {COSTS_VERSION}: this report was written before `bench "
                "bubbles --real` measured the optimizer step, the trainer-group all-reduce, the per-token overhead "
                "and the publication, so a plan from it favours more trainers and finer tokens than this machine "
                "runs well; rerun `digenrl bench bubbles --real --out DIR` (with an actor schedule) and plan with "
                "its bubbles.json")
        try:
            costs = cal["measured_costs"]
            fits = {str(k): (float(v["overhead_s"]), float(v["per_unit_s"])) for k, v in costs.items()}
            dispatch = float(cal["dispatch_s"])
            a = cal["allreduce"]
            allreduce = AllReduce(float(a["bytes"]), float(a["bytes_per_s"]), float(a["latency_s"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where}: measured costs malformed or incomplete ({type(exc).__name__}: {exc}); "
                              "expected measured_costs, dispatch_s and allreduce as `bench bubbles --real` "
                              "writes them") from exc
        need = {"rollout", "reward", "train", "optim", "publish"}
        if not fits.keys() >= need:
            raise ConfigError(f"{where}.measured_costs lacks {sorted(need - fits.keys())}")
        contention = cal.get("contention")  # reports before it: each device owns its compute
        return cls(fits, dispatch, allreduce,
                   Contention.from_dict(contention, f"{where}.contention") if contention is not None else None)

    @staticmethod
    def read_calibration(path: str | Path) -> dict[str, Any]:
        """The ``calibration`` table of a ``bench bubbles --real`` report (``bubbles.json``), unchecked.

        Raises:
            ConfigError: the file is missing, not JSON, or has no ``calibration`` table.
        """
        p = Path(path)
        try:
            cal = json.loads(p.read_text())["calibration"]
            if not isinstance(cal, dict):
                raise TypeError("calibration is not a table")
        except FileNotFoundError as exc:
            raise ConfigError(f"{p}: no such file; write one with `digenrl bench bubbles --real --out DIR`") from exc
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{p}: not a `digenrl bench bubbles --real` report (calibration: "
                              f"{type(exc).__name__}: {exc})") from exc
        return cal

    @classmethod
    def from_report(cls, path: str | Path) -> MeasuredCost:
        """The calibration a ``bench bubbles --real`` report (``bubbles.json``) holds.

        Raises:
            ConfigError: the file is missing, not JSON, has no ``calibration``, or is an old (version 1) report.
        """
        return cls.from_calibration(cls.read_calibration(path), f"{Path(path)}: calibration")

    @staticmethod
    def report_error(path: str | Path) -> float | None:
        """The simulator's measured error the report states for these costs (``calibration.plan_error``)."""
        try:
            value = MeasuredCost.read_calibration(path).get("plan_error")
        except ConfigError:
            return None
        return float(value) if isinstance(value, int | float) else None
