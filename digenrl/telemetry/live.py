"""A live table of a running job on the terminal: one row per optimizer step."""

from __future__ import annotations

from typing import Any

__all__ = ["LiveDisplay"]


class LiveDisplay:
    """A rich live table fed one metrics line per optimizer step (use as a context manager).

    Args:
        total: optimizer steps of the run.
        title: the table's title.
        history: the lines of steps done before (a resumed run shows them as an uninterrupted one would).
    """

    def __init__(self, total: int, title: str, history: list[dict[str, Any]] | None = None) -> None:
        self.total, self.title = total, title
        self._live: Any = None
        self._rows: list[dict[str, Any]] = list(history or [])

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

    @classmethod
    def show(cls, total: int, title: str, history: list[dict[str, Any]]) -> None:
        """Print the table of ``history`` once (a resumed run that has no step left)."""
        with cls(total, title, history):
            pass

    def update(self, metrics: dict[str, Any]) -> None:
        """Add one step's line."""
        self._rows.append(metrics)
        if self._live is not None:
            self._live.update(self._render())

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


def _parity(m: dict[str, Any]) -> tuple[str, str]:
    """The parity cells: mean ratio and max |dlog-prob| before the update ('-' when no row was measured)."""
    if m.get("parity_ratio") is None:
        return "-", "-"
    return f"{m['parity_ratio']:.6f}", f"{m['parity_logp_diff_max']:.1e}"
