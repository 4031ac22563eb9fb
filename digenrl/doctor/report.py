"""``digenrl doctor``'s report as readable tables (rich when the terminal has it, plain text otherwise)."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["render"]

GiB = 1 << 30


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _sections(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    host, gpu = report["host"], report["gpu"]
    m = host["machine"]
    out = [
        ("stack", ["package", "version"], [[k, v or "not installed"] for k, v in host["versions"].items()]),
        ("machine", ["what", "value"], [
            ["cores (usable / all)", f"{m['cores_usable']} / {m['cpu_count']}"],
            ["RAM (available / total)", f"{_gib(m['ram_available_bytes'])} / {_gib(m['ram_bytes'])}"],
            ["/dev/shm (free / size)", f"{_gib(m['shm_free_bytes'])} / {_gib(m['shm_bytes'])}"],
            ["load (1 min)", f"{m['load_avg_1m']:.1f}" if m["load_avg_1m"] is not None else "?"],
        ]),
        ("host lanes (ratio = lane GB/s over an interleaved memcpy)", ["lane", "size", "GB/s", "memcpy GB/s", "ratio"],
         [[lane, f"{r['size_bytes'] >> 20} MiB", f"{r['gbps']:.2f}", f"{r['memcpy_gbps']:.2f}", f"{r['ratio']:.2f}"]
          for lane, rows in host["lanes"].items() for r in rows]),
        ("event loops (header round trip to another process)", ["loop", "digenrl zmq", "raw sync pyzmq", "ratio"],
         [[r["loop"], f"{r['rtt_us']:.0f} µs", f"{r['raw_pyzmq_rtt_us']:.0f} µs", f"{r['vs_raw']:.2f}x"]
          for r in host["event_loops"]]),
        ("rollout/train parity (tiny fp32 CPU runs, trainer recompute vs rollout, before each update)",
         ["schedule", "rows", "mean ratio", "max |ratio-1|", "max |Δlog-prob|", "wall"],
         [[r["schedule"], "error", r["error"][:60], "", "", ""] if "error" in r else
          [r["schedule"], str(r["rows"]), _num(r["ratio"], ".6f"), _num(r["ratio_dev_max"], ".1e"),
           _num(r["logp_diff_max"], ".1e"), f"{r['wall_s']:.1f} s"] for r in report.get("cpu_parity", [])]),
    ]
    if "all_to_all" in report:  # sequence parallelism's exchange on gloo (doctor/all_to_all.py)
        a2a = report["all_to_all"]
        out.append(("sequence-parallel all-to-all (2 gloo processes; ratio = exchange time over a memcpy)",
                    ["size", "GB/s sent a rank", "memcpy GB/s", "ratio"],
                    [["error", a2a["error"][:60], "", ""]] if "error" in a2a else
                    [[f"{a2a['size_bytes'] >> 20} MiB", f"{a2a['gbps']:.2f}", f"{a2a['memcpy_gbps']:.2f}",
                      f"{a2a['ratio']:.1f}"]]))
    if not gpu.get("available"):
        why = gpu.get("reason", "not requested")
        out.append(("gpu: skipped", ["check", "why skipped"], [[name, why] for name in gpu.get("skipped", [])]))
        return out
    rows = [[name, _gpu_result(value)] for name, value in gpu.items()
            if name not in ("available", "count", "blocks")]
    out.append((f"gpu ({gpu['count']} devices)", ["check", "result"], rows))
    if "blocks" in gpu:
        out.append(_blocks_section(gpu["blocks"]))
    return out


def _gpu_result(value: Any) -> str:
    """A check's cell: its error, its skip reason, cupy's verdict, else the figures."""
    if isinstance(value, dict):
        if "error" in value:
            return str(value["error"])
        if "skipped" in value:
            return f"skipped: {value['skipped']}"
        for key in ("problem", "note"):  # cupy against torch's CUDA
            if value.get(key):
                return f"{key}: {value[key]}"
        if value.get("ok") is True and "torch_cuda" in value:
            return (f"ok: torch on CUDA {value['torch_cuda']}, cupy ({', '.join(value['cupy_packages'])}) on "
                    f"CUDA {value['cupy_cuda']}")
    return _short(value)


def _blocks_section(blocks: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    title = "gpu: one transformer block per family at its published width (forward, forward + backward)"
    columns = ["family", "width", "tokens (B x (image + text))", "dtype", "forward", "train", "result"]
    if "error" in blocks:
        return title, columns, [["all", "", "", "", "", "", str(blocks["error"])]]
    rows = []
    for family, r in blocks.items():
        s = r.get("shape")
        tokens = f"{s['batch']} x ({s['frames'] * s['height'] * s['width']} + {s['text_tokens']})" if s else "?"
        result = "ok" if r.get("ok") else f"{r.get('phase')} failed: {_short(r.get('error'), 120)}"
        rows.append([family, str(r.get("dim", "?")), tokens, str(r.get("dtype", "?")),
                     _ms(r.get("forward_ms")), _ms(r.get("train_ms")), result])
    return title, columns, rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _short(value: Any, limit: int = 300) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render(report: dict[str, Any]) -> str:
    """The whole report as text: one table per section, then the verdict."""
    verdict = ("ready: nothing stops digenrl here" if not report["problems"]
               else "problems:\n" + "\n".join(f"  - {p}" for p in report["problems"]))
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        return _plain(report) + "\n" + verdict
    console = Console(file=io.StringIO(), record=True, width=110, force_terminal=False)
    for title, columns, rows in _sections(report):
        table = Table(title=escape(title), title_justify="left")
        for col in columns:
            table.add_column(escape(col))
        for r in rows:
            table.add_row(*(escape(c) for c in r))
        console.print(table)
    console.print(escape(verdict))
    return console.export_text()


def _plain(report: dict[str, Any]) -> str:
    lines = []
    for title, columns, rows in _sections(report):
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        lines += ["", title, "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
