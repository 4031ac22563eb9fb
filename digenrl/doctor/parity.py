"""Rollout/train parity on this machine's CPU: two tiny fp32 runs (``colocated`` and ``async1``).

Why on CPU too: parity (the trainer's log-probs of a row, recomputed with the weights that sampled
it, against the rollout's) is the first thing that breaks when a kernel, dtype or LoRA merge
differs between the two sides, and a user should see it before a long run, GPU or not. The runs
report it on every step (``parity_*`` in the metrics, :mod:`digenrl.telemetry.metrics`); here they
are as small as the tiny model allows (2 steps, 4 prompts x 4 samples, 4 denoising steps, actors in
this process), and ``async1``'s one-step-stale batch is recomputed under the version that sampled
it (``train.check_parity``), so both schedules compare like with like. A few seconds.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

__all__ = ["cpu_parity", "problems"]

# The tiny default with the smallest work that still runs a stale async1 batch (step 1).
_TINY = {
    "model": {"device": "cpu", "dtype": "float32"},
    "rollout": {"prompts_per_batch": 4, "group_size": 4, "num_steps": 4},
    "train": {"iterations": 2, "check_parity": True},
    "schedule": {"fragment_groups": 2, "train_pack": 8},
    "transport": {"actors": "inproc"},
    "placement": {"threads": 1},
}


def _run(schedule: str) -> dict[str, Any]:
    from digenrl.config import config_from_dict
    from digenrl.recipes.disaggregated import run_disaggregated

    with tempfile.TemporaryDirectory(prefix="digenrl-doctor-") as out:
        cfg = config_from_dict({**_TINY, "schedule": {**_TINY["schedule"], "name": schedule},
                                "log": {"out": out, "image_every": 0, "checkpoint_every": 0, "trace": False,
                                        "gantt": False, "live": False}})
        start = time.perf_counter()
        lines = run_disaggregated(cfg, out, write_files=False)
        wall = time.perf_counter() - start
    measured = [m for m in lines if m["parity_rows"]]
    return {
        "schedule": schedule, "dtype": "float32", "steps": len(lines), "wall_s": wall,
        "tolerance": cfg.train.parity_tolerance,
        "rows": sum(m["parity_rows"] for m in measured),
        "ratio": sum(m["parity_ratio"] * m["parity_rows"] for m in measured) / max(1, sum(m["parity_rows"] for m in measured))
        if measured else None,
        "ratio_dev_max": max((m["parity_ratio_dev_max"] for m in measured), default=None),
        "logp_diff_max": max((m["parity_logp_diff_max"] for m in measured), default=None),
    }


def cpu_parity(schedules: tuple[str, ...] = ("colocated", "async1")) -> list[dict[str, Any]]:
    """One tiny CPU run per schedule, with its parity figures over every step (or the error)."""
    out = []
    for schedule in schedules:
        try:
            out.append(_run(schedule))
        except Exception as exc:  # a report, not a crash: the error is the finding
            out.append({"schedule": schedule, "error": f"{type(exc).__name__}: {exc}"})
    return out


def problems(runs: list[dict[str, Any]]) -> list[str]:
    """A line per run that failed or whose parity is off by more than ``train.parity_tolerance``."""
    out = []
    for r in runs:
        if "error" in r:
            out.append(f"tiny CPU {r['schedule']} run failed: {r['error']}")
        elif not r["rows"]:
            out.append(f"tiny CPU {r['schedule']} run measured no parity rows")
        elif r["ratio_dev_max"] > r["tolerance"] or r["logp_diff_max"] > r["tolerance"]:
            out.append(f"rollout/train parity on CPU ({r['schedule']}): max |ratio - 1| {r['ratio_dev_max']:.3g}, "
                       f"max |dlog-prob| {r['logp_diff_max']:.3g} > train.parity_tolerance {r['tolerance']:g}")
    return out
