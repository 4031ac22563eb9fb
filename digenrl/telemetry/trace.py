"""Pictures of a run: a Chrome-trace/Perfetto JSON and a Gantt PNG of device activity.

The trace uses the Chrome trace event format: one complete ("X") event per span with ``pid`` = the
device's role pool, ``tid`` = the device, ``ts``/``dur`` in microseconds, plus "M" metadata events that
name the processes and threads. It opens in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from digenrl.telemetry.spans import Timeline

__all__ = ["chrome_trace", "write_trace", "write_gantt", "write_artifacts", "KIND_COLORS"]

log = logging.getLogger(__name__)

KIND_COLORS: dict[str, str] = {
    "rollout": "#4C72B0",
    "reward": "#55A868",
    "train": "#DD8452",
    "optim": "#C44E52",
    "publish": "#8172B3",
    "switch": "#937860",
    "abort": "#7F7F7F",  # a peer's rollout work thrown away on a weight sync (sim/peers.py)
    "link": "#BCBD22",  # waiting for a version or a fragment to cross a slow link (sim/link_traffic.py)
}
_HELPER_COLOR = "#64B5CD"  # TAG: a trainer generating


def chrome_trace(result: Timeline) -> dict[str, Any]:
    """The run as a Chrome trace object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    pools = sorted({str(d.role) for d in result.devices})
    pid = {p: i + 1 for i, p in enumerate(pools)}
    tid = {d.name: i + 1 for i, d in enumerate(result.devices)}
    role = {d.name: str(d.role) for d in result.devices}
    events: list[dict[str, Any]] = []
    for p, i in pid.items():
        events.append({"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": p}})
    for d in result.devices:
        events.append({"name": "thread_name", "ph": "M", "pid": pid[role[d.name]], "tid": tid[d.name],
                       "args": {"name": d.name}})
    for s in result.spans:
        name = f"{s.kind}{' (TAG)' if s.helper else ''} b{s.batch}"
        events.append({
            "name": name, "cat": str(s.kind), "ph": "X",
            "pid": pid[role[s.device]], "tid": tid[s.device],
            "ts": round(s.start * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
            "args": {"batch": s.batch, "fragment": s.fragment, "policy_version": s.version,
                     "samples": s.samples, "token": s.token},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": result.schedule, "wall_s": result.wall}}


def write_trace(result: Timeline, path: Path) -> Path:
    """Write ``chrome_trace(result)`` to ``path``."""
    path.write_text(json.dumps(chrome_trace(result)))
    return path


def write_gantt(results: list[Timeline], path: Path, title: str, until: float | None = None,
                max_rows: int = 48) -> Path:
    """One panel per schedule: devices on y, time on x, one colour per token kind, shared legend.

    Args:
        results: the runs of one scenario, one per schedule.
        path: the PNG to write.
        title: figure title.
        until: only draw ``[0, until]`` seconds (e.g. the first few batches) so spans stay legible;
            ``None`` draws each run whole.
        max_rows: larger testbeds show this many devices, spread evenly over the device list
            (every role keeps its share of rows).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_all = len(results[0].devices)
    n_dev = min(n_all, max_rows)
    height = max(3.0, (0.11 * n_dev + 0.9) * len(results) + 0.8)  # below 3 in, tight_layout gives up
    fig, axes = plt.subplots(len(results), 1, figsize=(14, height), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        shown = [res.devices[round(i * (n_all - 1) / max(1, n_dev - 1))] for i in range(n_dev)] if n_all > n_dev else res.devices
        row = {d.name: i for i, d in enumerate(shown)}
        # One broken_barh per (device, colour): a few hundred artists instead of one per span.
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for s in res.spans:
            if (until is not None and s.start >= until) or s.device not in row:
                continue
            color = _HELPER_COLOR if s.helper and s.kind in ("rollout", "reward") else KIND_COLORS[s.kind]
            bars.setdefault((row[s.device], color), []).append((s.start, s.end - s.start))
        for (y, color), segs in bars.items():
            ax.broken_barh(segs, (y - 0.4, 0.8), facecolors=color, edgecolors="none")
        ax.set_ylim(-0.6, n_dev - 0.4)
        ax.invert_yaxis()
        step = max(1, n_dev // 16)
        ticks = list(range(0, n_dev, step))
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"{shown[i].name} ({str(shown[i].role)[0].upper()})" for i in ticks], fontsize=7)
        # Real runs spend their first seconds spawning processes: start the axis at the first span.
        first = min((s.start for s in res.spans), default=0.0)
        ax.set_xlim(first if until is None else 0.0, until if until is not None else res.wall)
        note = f", {n_dev} of {n_all} devices shown" if n_all > n_dev else ""
        ax.set_title(f"{res.schedule}  (wall {res.wall:.0f} s{note})", fontsize=9, loc="left")
        ax.set_xlabel("seconds", fontsize=8)
    legend = [Patch(color=c, label=k) for k, c in KIND_COLORS.items()]
    legend.append(Patch(color=_HELPER_COLOR, label="rollout (TAG helper)"))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1 - 0.3 / height))
    # Below the figure (bbox_inches="tight" keeps it), so it never covers the last axis label.
    fig.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(legend), fontsize=8,
               frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_artifacts(out: Path, result: Timeline, trace: bool = True, gantt: bool = True) -> list[Path]:
    """A real run's ``trace.json`` (every actor's spans) and ``gantt.png``; returns the files written."""
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
