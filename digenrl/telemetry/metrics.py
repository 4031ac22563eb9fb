"""What a disaggregated run shows while it runs and leaves behind.

* :class:`SpanLog`: every executed token as a span ``(device, kind, batch, fragment, version, start,
  end)`` in seconds since the run started, measured by the actor that ran it. Spans are the
  simulator's :class:`~digenrl.sim.engine.Span`, so the simulator's metrics (``summarize``), Chrome
  trace and Gantt writers (:mod:`digenrl.sim.trace`) apply to real runs unchanged.
* :func:`window_bubbles`: bubble ratio per device over a window (1 - compute time / window),
  counting tokens still running up to "now" as busy.
* :class:`MetricsLog`: ``metrics.jsonl``, one line per optimizer step, plus TensorBoard scalars
  when ``tensorboard`` is installed and enabled.
* :func:`write_artifacts`: ``trace.json`` (Chrome/Perfetto, all actors) and ``gantt.png``.
* :class:`LiveDisplay`: a rich live table (iteration, reward, samples/s, bubble per actor, staleness).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from digenrl.schedule.base import Device, TokenKind, Workload
from digenrl.sim.engine import SimResult, Span
from digenrl.sim.metrics import COMPUTE_KINDS, busy_seconds, summarize

__all__ = ["SpanLog", "window_bubbles", "MetricsLog", "write_artifacts", "LiveDisplay", "METRIC_KEYS", "run_stats"]

log = logging.getLogger(__name__)

#: Keys every ``metrics.jsonl`` line has (more may follow).
METRIC_KEYS = ("step", "reward_mean", "reward_std", "samples_per_s", "bubble_ratio", "max_staleness", "clipfrac",
               "approx_kl", "kl", "zero_std_ratio", "seconds")


class SpanLog:
    """Spans of all actors, in seconds since ``t0`` (a ``time.time()`` value shared by all processes)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.spans: list[Span] = []
        self.optim_end: dict[int, float] = {}

    def add(self, device: str, kind: TokenKind, batch: int, fragment: int, version: int, start: float, end: float,
            samples: int = 0, helper: bool = False, token: int = -1) -> Span:
        span = Span(device, kind, batch, fragment, version, start - self.t0, max(end, start) - self.t0, samples,
                    helper, token)
        self.spans.append(span)
        if kind is TokenKind.OPTIM:
            self.optim_end[batch] = max(self.optim_end.get(batch, 0.0), span.end)
        return span

    def result(self, schedule: str, devices: list[Device], workload: Workload, wall: float) -> SimResult:
        return SimResult(schedule, list(devices), workload, list(self.spans), wall, len(self.spans),
                         dict(self.optim_end))


def window_bubbles(spans: list[Span], devices: list[str], start: float, end: float,
                   running: dict[str, float] | None = None) -> dict[str, float]:
    """Bubble ratio per device over ``[start, end)``; ``running[device]`` = start of a still-running compute token."""
    length = max(end - start, 1e-9)
    by: dict[str, list[Span]] = {d: [] for d in devices}
    for s in spans:
        if s.device in by and s.end > start:
            by[s.device].append(s)
    out = {}
    for d in devices:
        busy = busy_seconds(by[d], start, end, COMPUTE_KINDS)
        if running and d in running:
            busy += max(0.0, end - max(start, running[d]))
        out[d] = max(0.0, min(1.0, 1.0 - busy / length))
    return out


def run_stats(result: SimResult) -> dict[str, Any]:
    """The simulator's summary (steady and full windows) of a real run."""
    return summarize(result).to_dict()


class MetricsLog:
    """``metrics.jsonl`` (appended and flushed per step) and optional TensorBoard scalars."""

    def __init__(self, out: Path | None, tensorboard: bool = False, history: list[dict[str, Any]] | None = None) -> None:
        self.path = out / "metrics.jsonl" if out is not None else None
        self._tb: Any = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run rewrites the lines it already has, so the file never holds a step twice.
            with self.path.open("w") as f:
                for line in history or []:
                    f.write(json.dumps(line) + "\n")
        if tensorboard and out is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / "tb"))
            except ImportError:
                log.info("tensorboard is not installed; skipping TensorBoard logs")

    def write(self, metrics: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            step = int(metrics["step"])
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, int | float):
                            self._tb.add_scalar(f"{key}/{sub}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def write_artifacts(out: Path, result: SimResult, trace: bool = True, gantt: bool = True) -> list[Path]:
    """``trace.json`` (Chrome trace of every actor's spans) and ``gantt.png``; returns the files written."""
    from digenrl.sim.trace import write_gantt, write_trace

    files = []
    if trace:
        files.append(write_trace(result, out / "trace.json"))
    if gantt and result.spans:
        try:
            files.append(write_gantt([result], out / "gantt.png", f"{result.schedule}: real run, "
                                     f"{len(result.devices)} actors"))
        except Exception as exc:  # a picture must never fail a finished run
            log.warning("could not draw the Gantt chart: %s", exc)
    return files


class LiveDisplay:
    """A rich live table fed one metrics dict per optimizer step (use as a context manager)."""

    def __init__(self, total: int, title: str) -> None:
        self.total, self.title = total, title
        self._live: Any = None
        self._rows: list[dict[str, Any]] = []

    def __enter__(self) -> LiveDisplay:
        from rich.console import Console
        from rich.live import Live

        # Wide enough for every column even when stderr is a log file or a pipe (80 columns by default).
        console = Console(stderr=True, width=max(Console(stderr=True).width, 120))
        self._live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            if not self._live.console.is_terminal:  # the last frame ends without a newline there
                self._live.console.line()

    def update(self, metrics: dict[str, Any]) -> None:
        self._rows.append(metrics)
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.title}  ({len(self._rows)}/{self.total} steps)")
        actors = sorted(self._rows[-1]["bubble_ratio"]) if self._rows else []
        for col in ("step", "reward", "± std", "samples/s", "staleness", *(f"bubble {a}" for a in actors), "s"):
            table.add_column(col, justify="right")
        for m in self._rows[-12:]:
            b = m["bubble_ratio"]
            table.add_row(str(m["step"]), f"{m['reward_mean']:.4f}", f"{m['reward_std']:.4f}",
                          f"{m['samples_per_s']:.1f}", str(m["max_staleness"]),
                          *(f"{b.get(a, 0.0):.0%}" for a in actors), f"{m['seconds']:.2f}")
        return table
