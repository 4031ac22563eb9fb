"""A cost model measured on this machine: seconds per token fitted to real runs' tokens.

``digenrl bench bubbles --real`` fits it (and calibrates the simulator with it, see
``recipes/bench_real.py``); ``digenrl plan --fleet --costs bubbles.json`` plans with it, so a split
for the machine the bench ran on is chosen from what that machine measured, not from a GPU profile.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Token, TokenKind

__all__ = ["MeasuredCost"]


def _units(token: Token) -> float:
    if token.kind is TokenKind.ROLLOUT:
        return float(token.num_samples * (token.step_end - token.step_start))
    if token.kind is TokenKind.REWARD:
        return float(token.num_samples)
    if token.kind is TokenKind.TRAIN:
        return float(token.transitions)
    return 1.0


@dataclass(frozen=True)
class MeasuredCost:
    """A cost estimate fitted to measured tokens: ``seconds = overhead + per_unit x units`` per kind."""

    fits: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (overhead, per unit)

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
        overhead, per = self.fits.get(token.kind.value, (1e-3, 0.0))
        return max(1e-4, overhead + per * _units(token)) / device.speed

    def tag_switch_seconds(self, name: str, to_helper: bool = True) -> float:
        return 0.0  # a TAG trainer holds the newest weights already: no onload/offload on CPU

    def scaled(self, factor: float) -> MeasuredCost:
        """Every cost ``factor`` times as long (e.g. two busy processes sharing the machine's memory)."""
        return MeasuredCost({k: (o * factor, p * factor) for k, (o, p) in self.fits.items()})

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {k: {"overhead_s": o, "per_unit_s": p} for k, (o, p) in self.fits.items()}

    @classmethod
    def from_report(cls, path: str | Path) -> MeasuredCost:
        """The calibration a ``bench bubbles --real`` report (``bubbles.json``) holds.

        Raises:
            ConfigError: the file is missing, not JSON, or has no ``calibration.measured_costs``.
        """
        p = Path(path)
        try:
            costs = json.loads(p.read_text())["calibration"]["measured_costs"]
            fits = {str(k): (float(v["overhead_s"]), float(v["per_unit_s"])) for k, v in costs.items()}
        except FileNotFoundError as exc:
            raise ConfigError(f"{p}: no such file; write one with `digenrl bench bubbles --real --out DIR`") from exc
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{p}: not a `digenrl bench bubbles --real` report (calibration.measured_costs: "
                              f"{type(exc).__name__}: {exc})") from exc
        if not fits.keys() >= {"rollout", "reward", "train"}:
            raise ConfigError(f"{p}: calibration.measured_costs lacks {sorted({'rollout', 'reward', 'train'} - fits.keys())}")
        return cls(fits)
