"""The progress of a running job: a live table on a terminal, one plain line per step elsewhere.

On a terminal (stdout and stderr both), a rich live table redrawn on stderr, one row per optimizer
step. Anywhere else (Slurm, nohup, a pipe, CI) a live table shows nothing until it ends, so each
step prints one plain line on stdout instead, flushed as it is written (ASCII: a log's locale may be
anything). ``step 3/40`` is the third step (``"step": 2`` in metrics.jsonl; checkpoint ``step-000003``)::

    step 3/40 reward 0.6116 +- 0.1930 | 71.8 samples/s | parity 1.000000 (max |dlogp| 2.4e-07) | bubbles overall 52%
    rollout-0 100% trainer-0 3% | staleness 1 | 0.89 s          (one line; wrapped here)
"""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["LiveDisplay", "step_line"]


class LiveDisplay:
    """Progress fed one metrics line per optimizer step (use as a context manager).

    Args:
        total: optimizer steps of the run.
        title: the table's title.
        history: the lines of steps done before (a resumed run's table shows them as an uninterrupted one would;
            the plain lines start where the run does).
        interactive: the live table (``True``) or plain lines (``False``); default: whether stdout and stderr
            are both terminals.
        stream: where the plain lines go (default ``sys.stdout``).
    """

    def __init__(self, total: int, title: str, history: list[dict[str, Any]] | None = None, *,
                 interactive: bool | None = None, stream: IO[str] | None = None) -> None:
        self.total, self.title = total, title
        self._live: Any = None
        self._rows: list[dict[str, Any]] = list(history or [])
        self.interactive = _terminal() if interactive is None else interactive
        self._stream = stream

    def __enter__(self) -> LiveDisplay:
        if not self.interactive:
            return self
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True, width=max(Console(stderr=True).width, 120))
        self._live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    @classmethod
    def show(cls, total: int, title: str, history: list[dict[str, Any]]) -> None:
        """Print the table of ``history`` once (a resumed run that has no step left), or its plain lines."""
        display = cls(total, title, history)
        if display.interactive:
            with display:
                pass
            return
        for m in history:
            display._print(m)

    def update(self, metrics: dict[str, Any]) -> None:
        """Add one step's line."""
        self._rows.append(metrics)
        if self._live is not None:
            self._live.update(self._render())
        elif not self.interactive:
            self._print(metrics)

    def _print(self, metrics: dict[str, Any]) -> None:
        stream = self._stream or sys.stdout
        stream.write(step_line(metrics, self.total) + "\n")
        stream.flush()  # a log file or pipe is block-buffered: without it the lines arrive at the end

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.title}  ({len(self._rows)}/{self.total} steps)")
        actors = sorted(self._rows[-1]["bubble_ratio"]) if self._rows else []
        for col in ("step", "reward", "± std", "samples/s", "staleness", "parity ratio", "max |Δlogp|",
                    *(f"bubble {a}" for a in actors), "s"):
            table.add_column(col, justify="right")
        for m in self._rows[-12:]:
            b = m["bubble_ratio"]
            table.add_row(str(m["step"]), f"{m['reward_mean']:.4f}", f"{m['reward_std']:.4f}",
                          f"{m['samples_per_s']:.1f}", str(m["max_staleness"]), *_parity(m),
                          *(f"{b.get(a, 0.0):.0%}" for a in actors), f"{m['seconds']:.2f}")
        return table


def _terminal() -> bool:
    """Both streams a person would watch are terminals (a pipe or file on either: plain lines)."""
    return all(s is not None and hasattr(s, "isatty") and s.isatty() for s in (sys.stdout, sys.stderr))


def step_line(m: dict[str, Any], total: int) -> str:
    """One step's plain line: step (1-based, of ``total``), reward, samples/s, parity, bubbles, staleness, seconds."""
    ratio, diff = _parity(m)
    bubbles = m.get("bubble_ratio", {})
    order = sorted(bubbles, key=lambda a: (a != "overall", a))  # overall first
    return (f"step {int(m['step']) + 1}/{total} reward {m['reward_mean']:.4f} +- {m['reward_std']:.4f}"
            f" | {m['samples_per_s']:.1f} samples/s | parity {ratio} (max |dlogp| {diff})"
            f" | bubbles {' '.join(f'{a} {bubbles[a]:.0%}' for a in order) or '-'}"
            f" | staleness {m['max_staleness']} | {m['seconds']:.2f} s")


def _parity(m: dict[str, Any]) -> tuple[str, str]:
    """The parity cells: mean ratio and max |dlog-prob| before the update ('-' when no row was measured)."""
    if m.get("parity_ratio") is None:
        return "-", "-"
    return f"{m['parity_ratio']:.6f}", f"{m['parity_logp_diff_max']:.1e}"
