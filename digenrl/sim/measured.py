"""A cost model measured on this machine: seconds per token fitted to real runs' tokens.

``digenrl bench bubbles --real`` fits it (and calibrates the simulator with it, see
``recipes/bench_real.py``); ``digenrl plan --fleet --costs bubbles.json`` plans with it, so a split
for the machine the bench ran on is chosen from what that machine measured, not from a GPU profile.

Per token kind a linear fit, ``overhead + per_unit x units``; a ROLLOUT token also pays ``step_s`` per
denoising step it runs, whatever its sample count (the transformer call and its launches per step of a
batch), so finer tokens (fewer samples per step call) cost what they do (costs version 3). Besides
these, a plan needs what changes with the split and the token sizes and that one placement's compute
tokens do not show (costs version 2):

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

The costs are seconds of one device type (the ``testbed`` of the report's rows, ``measured`` for this
host's processes) running the bench's model: they price pools of that type and nothing else, so a
fleet or scenario with any other device type is refused (:meth:`MeasuredCost.check_fleet`); a report
whose rows name no device type prices a fleet of one type.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Token, TokenKind
from digenrl.schedule.cost import ring_allreduce_seconds
from digenrl.sim.contention import Contention
from digenrl.sim.devices import device_spec

__all__ = ["MeasuredCost", "AllReduce", "COSTS_VERSION"]

# 2: dispatch_s, optim, publish and the trainer-group all-reduce measured (version 1 files priced none of them)
# 3: the rollout's per-step term (measured_costs.rollout.per_step_s); version 2 priced every sample-step alike
COSTS_VERSION = 3
_COMPUTE = (TokenKind.ROLLOUT, TokenKind.REWARD, TokenKind.TRAIN)
# Fit columns (the token's fixed overhead, its units, its steps) and the subsets tried, in order of
# preference on equal residuals. Every subset keeps the per-unit term (work costs time; a fit without it
# would make larger tokens free); a term the tokens cannot tell apart from another is dropped.
_INTERCEPT, _UNITS, _STEPS = 0, 1, 2
_SUBSETS = {"rollout": ((_INTERCEPT, _UNITS, _STEPS), (_INTERCEPT, _UNITS), (_UNITS, _STEPS), (_UNITS,)),
            "other": ((_INTERCEPT, _UNITS), (_UNITS,))}


def _one(values: set[Any]) -> str:
    """The one string of ``values``, else ``""``."""
    return next(iter(values)) if len(values) == 1 and isinstance(next(iter(values)), str) else ""


def _units(token: Token) -> float:
    if token.kind is TokenKind.ROLLOUT:
        return float(token.num_samples * (token.step_end - token.step_start))
    if token.kind is TokenKind.REWARD:
        return float(token.num_samples)
    if token.kind is TokenKind.TRAIN:
        return float(token.transitions)
    return 1.0


def _steps(token: Token) -> float:
    return float(token.step_end - token.step_start)


def _solve(cols: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares coefficients of ``ys`` on ``cols``; ``None`` when the columns are not independent."""
    x = np.array(cols, dtype=float).T
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0  # columns of ~1 and ~100s: normalised, so the rank test sees their shapes alone
    # rcond: a singular value under 1e-9 of the largest is a dependence (not only an exact one)
    coef, _, rank, _ = np.linalg.lstsq(x / scale, np.array(ys, dtype=float), rcond=1e-9)
    return None if rank < x.shape[1] else list(coef / scale)


def _fit_kind(kind: str, pts: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], str]:
    """Non-negative least squares of seconds on (1, units[, steps]): the least residual over the column
    subsets (``_SUBSETS``) whose own least squares is non-negative, which is the optimum with non-negative terms.

    Returns ``(overhead, per_unit, per_step)`` and a note when a term could not be told apart (empty if all fit).
    """
    ys = [p[2] for p in pts]
    columns = {_INTERCEPT: [1.0] * len(pts), _UNITS: [p[0] for p in pts], _STEPS: [p[1] for p in pts]}
    subsets = _SUBSETS["rollout" if kind == "rollout" else "other"]
    feasible: list[tuple[float, list[float]]] = []  # (residual, coefficients), in order of preference
    solved = {subset: _solve([columns[c] for c in subset], ys) for subset in subsets}
    for subset, coef in solved.items():
        if coef is None or min(coef) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for c, v in zip(subset, coef, strict=True):
            full[c] = v
        feasible.append((sum((y - full[0] - full[1] * u - full[2] * k) ** 2 for u, k, y in pts), full))
    if not feasible:  # no unit of work at all (units 0): a constant
        return (statistics.fmean(ys), 0.0, 0.0), ""
    least = min(r for r, _ in feasible)
    chosen = next(f for r, f in feasible if r <= least * (1 + 1e-9) + 1e-18 * len(pts))
    note = ""
    if kind == "rollout" and solved[subsets[0]] is None:  # every term's columns not independent
        note = ("rollout: the tokens' steps do not vary independently of their samples (or one step count), so "
                "the per-step term is not identified: fitted overhead + per sample-step only")
    return (chosen[0], chosen[1], chosen[2]), note


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
    """A cost estimate fitted to measured tokens: ``seconds = overhead + per_unit x units`` per kind, plus
    ``step_s x steps`` for a ROLLOUT token.

    ``fits["optim"]`` is one trainer's step (overhead), ``fits["publish"]`` one publication; ``dispatch_s``,
    ``allreduce`` and ``contention`` as the module docstring says (0 / ``None``: not measured, not charged).
    ``notes``: what the fit could not identify (see :meth:`fit`).
    """

    fits: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (overhead, per unit)
    dispatch_s: float = 0.0
    allreduce: AllReduce | None = None
    contention: Contention | None = None
    step_s: float = 0.0  # a ROLLOUT token's seconds per denoising step, whatever its sample count
    notes: tuple[str, ...] = ()
    # where they were measured (``from_report``): not part of the costs' values, so not compared
    device: str = field(default="", compare=False)  # the catalog device type; "" = not recorded
    source: str = field(default="", compare=False)  # the report file
    model: str = field(default="", compare=False)  # the model the bench ran, as its rows name it

    @classmethod
    def fit(cls, samples: list[tuple[Token, float]]) -> MeasuredCost:
        """Non-negative least squares per token kind: ``overhead + per_unit x units``, and for ROLLOUT
        ``+ step_s x steps`` with units = samples x steps.

        The per-step term needs tokens whose steps vary independently of their sample-steps (two step
        counts, and at one of them two sample counts); without them it is 0 and ``notes`` says so.
        """
        by: dict[str, list[tuple[float, float, float]]] = {}
        for token, secs in samples:
            by.setdefault(token.kind.value, []).append((_units(token), _steps(token), secs))
        fits, step_s, notes = {}, 0.0, []
        for kind, pts in by.items():
            (overhead, per_unit, per_step), note = _fit_kind(kind, pts)
            fits[kind] = (overhead, per_unit)
            if kind == TokenKind.ROLLOUT.value:
                step_s = per_step
            if note:
                notes.append(note)
        return cls(fits, step_s=step_s, notes=tuple(notes))

    def seconds(self, token: Token, device: Device) -> float:
        kind = token.kind
        overhead, per = self.fits.get(kind.value, (1e-3, 0.0))
        base = overhead + per * _units(token)
        if kind is TokenKind.ROLLOUT:
            base += self.step_s * _steps(token)
        base = max(1e-4, base)
        if kind in _COMPUTE:
            base += self.dispatch_s
        elif kind is TokenKind.OPTIM and self.allreduce is not None:
            base += self.allreduce.seconds(len(token.devices))
        return base / device.speed

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float:
        return 0.0  # a TAG trainer holds the newest weights already: no onload/offload on CPU

    def batch_work(self, samples: int, prompts: int, num_steps: int, trained_rows: int,
                   spec: object = None) -> tuple[float, float]:
        """Device-seconds of rollout (+reward) and of training for one logical batch, from the per-unit
        terms (``CostModel.batch_work``'s contract; token overheads left out: they depend on the token sizes)."""
        def per(kind: str) -> float:
            return self.fits.get(kind, (0.0, 0.0))[1]

        roll = per("rollout") * samples * num_steps + self.step_s * num_steps + per("reward") * samples
        return roll, per("train") * trained_rows

    def check_fleet(self, device_types: list[str] | set[str], what: str) -> None:
        """Refuse a fleet these costs do not price: more than one device type, or another type than the
        one they were measured on.

        Raises:
            ConfigError: naming the costs file, the device type it measured and the fleet's.
        """
        types = sorted(set(device_types))
        src = f"--costs {self.source}" if self.source else "--costs"
        on = f"measured on {self.device} devices" if self.device else "measured on one device type"
        if len(types) > 1:
            raise ConfigError(f"{src}: costs {on} price a fleet of one device type; {what} mixes "
                              f"{', '.join(types)}, whose other types' seconds were never measured. Simulate "
                              f"{self.device or 'that type'} alone with them, or drop --costs to price every type "
                              "with the fitted utilisations")
        if self.device and types and types[0].lower() != self.device.lower():
            raise ConfigError(f"{src}: costs {on} ({self.model or 'the bench'}'s tokens) do not price {types[0]}: "
                              f"simulate {what} with the fitted utilisations (drop --costs), or with costs "
                              f"`digenrl bench bubbles --real` measured on {types[0]}")

    def describe(self) -> str:
        """The cost source line: ``measured: FILE (... on measured devices)``."""
        on = f"{self.device} devices" if self.device else "one device type"
        where = f"{self.model or 'the bench'}'s tokens on {on}"
        return f"measured: {self.source or 'costs given in code'} (`bench bubbles --real` token costs, {where})"

    def scaled(self, factor: float) -> MeasuredCost:
        """Every cost ``factor`` times as long (e.g. two busy processes sharing the machine's memory)."""
        return MeasuredCost({k: (o * factor, p * factor) for k, (o, p) in self.fits.items()},
                            self.dispatch_s * factor, self.allreduce, self.contention, self.step_s * factor,
                            self.notes, self.device, self.source, self.model)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The per-kind fits (``calibration.measured_costs``; the rollout's with ``per_step_s``); see
        :meth:`to_calibration` for the rest."""
        out = {k: {"overhead_s": o, "per_unit_s": p} for k, (o, p) in self.fits.items()}
        if TokenKind.ROLLOUT.value in out:
            out[TokenKind.ROLLOUT.value]["per_step_s"] = self.step_s
        return out

    def to_calibration(self) -> dict[str, Any]:
        """Everything a plan reads back with :meth:`from_calibration`, as ``bubbles.json`` stores it."""
        out: dict[str, Any] = {"costs_version": COSTS_VERSION, "measured_costs": self.to_dict(),
                               "dispatch_s": self.dispatch_s, "fit_notes": list(self.notes)}
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
            ConfigError: a field is missing or malformed (named), or the file predates costs version 3.
        """
        version = cal.get("costs_version")
        if version is None or version < COSTS_VERSION:
            missing = ("the optimizer step, the trainer-group all-reduce, the per-token overhead, the publication "
                       "and the rollout's per-step cost" if version is None or version < 2
                       else "the rollout's per-step cost (a step of few samples priced as a fraction of a full one)")
            raise ConfigError(
                f"{where}.costs_version: {version!r}, need {COSTS_VERSION}: this report was written before `bench "
                f"bubbles --real` measured {missing}, so a plan from it favours finer tokens (and, before version "
                "2, more trainers) than this machine runs well; rerun `digenrl bench bubbles --real --out DIR` "
                "(with an actor schedule) and plan with its bubbles.json")
        try:
            costs = cal["measured_costs"]
            fits = {str(k): (float(v["overhead_s"]), float(v["per_unit_s"])) for k, v in costs.items()}
            roll = TokenKind.ROLLOUT.value
            step_s = float(costs[roll]["per_step_s"]) if roll in costs else 0.0  # no rollout: named below
            notes = tuple(str(n) for n in cal["fit_notes"])
            dispatch = float(cal["dispatch_s"])
            a = cal["allreduce"]
            allreduce = AllReduce(float(a["bytes"]), float(a["bytes_per_s"]), float(a["latency_s"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where}: measured costs malformed or incomplete ({type(exc).__name__}: {exc}); "
                              "expected measured_costs (the rollout's with per_step_s), dispatch_s, allreduce and "
                              "fit_notes as `bench bubbles --real` writes them") from exc
        need = {"rollout", "reward", "train", "optim", "publish"}
        if not fits.keys() >= need:
            raise ConfigError(f"{where}.measured_costs lacks {sorted(need - fits.keys())}")
        contention = cal.get("contention")  # reports before it: each device owns its compute
        return cls(fits, dispatch, allreduce,
                   Contention.from_dict(contention, f"{where}.contention") if contention is not None else None,
                   step_s, notes)

    @staticmethod
    def read_calibration(path: str | Path) -> dict[str, Any]:
        """The ``calibration`` table of a ``bench bubbles --real`` report (``bubbles.json``), unchecked.

        Raises:
            ConfigError: the file is missing, not JSON, or has no ``calibration`` table.
        """
        return MeasuredCost._read(path)["calibration"]  # type: ignore[no-any-return]

    @staticmethod
    def _read(path: str | Path) -> dict[str, Any]:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            cal = data["calibration"]
            if not isinstance(cal, dict):
                raise TypeError("calibration is not a table")
        except FileNotFoundError as exc:
            raise ConfigError(f"{p}: no such file; write one with `digenrl bench bubbles --real --out DIR`") from exc
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{p}: not a `digenrl bench bubbles --real` report (calibration: "
                              f"{type(exc).__name__}: {exc})") from exc
        return data  # type: ignore[no-any-return]

    @classmethod
    def from_report(cls, path: str | Path) -> MeasuredCost:
        """The calibration a ``bench bubbles --real`` report (``bubbles.json``) holds, with the device type and
        model its rows name (``testbed``, ``model``: one each, else ``""``).

        Raises:
            ConfigError: the file is missing, not JSON, has no ``calibration``, or is an old (version 1) report.
        """
        data = cls._read(path)
        cost = cls.from_calibration(data["calibration"], f"{Path(path)}: calibration")
        rows = [r for r in data.get("rows") or [] if isinstance(r, dict)]
        device = _one({r.get("testbed") for r in rows})
        if device:
            try:
                device = device_spec(device).name
            except ConfigError:
                device = ""  # a testbed that is no catalog type ("2xH800"...): not one device type
        return dataclasses.replace(cost, device=device, source=str(path), model=_one({r.get("model") for r in rows}))

    @staticmethod
    def report_error(path: str | Path) -> float | None:
        """The simulator's measured error the report states for comparing placements with these costs:
        ``calibration.placement_error`` (its error on the ratio of two splits), else ``plan_error``."""
        try:
            cal = MeasuredCost.read_calibration(path)
            value = cal.get("placement_error", cal.get("plan_error"))
        except ConfigError:
            return None
        return float(value) if isinstance(value, int | float) else None
