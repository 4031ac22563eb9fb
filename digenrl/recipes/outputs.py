"""A run's output directory: what a run writes there, and taking one without overwriting another run.

Both recipes (the colocated loop and the actors) write the same entries (see :data:`RUN_OUTPUTS`). A
directory that holds any of them belongs to an earlier run: :func:`claim_out_dir` refuses it unless the
new run continues it (``--resume`` of that directory) or replaces it (``--overwrite``, which removes
those entries and nothing else, so a Slurm log or notes kept beside them stay).
"""

from __future__ import annotations

import logging
import shutil
from datetime import datetime
from pathlib import Path

from digenrl.errors import ConfigError

__all__ = ["RUN_OUTPUTS", "run_outputs", "check_out_dir", "claim_out_dir", "fresh_out_dir"]

log = logging.getLogger(__name__)

# Every entry a run writes in its directory (metrics.jsonl's TensorBoard twin is tb/, its W&B run wandb/).
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "summary.json", "trace.json", "gantt.png", "samples",
               "trainable.safetensors", "tb", "wandb", "config.json")


def run_outputs(out: Path) -> list[Path]:
    """The entries of ``out`` that a run wrote (none when ``out`` does not exist)."""
    return [out / name for name in RUN_OUTPUTS if (out / name).exists()]


def fresh_out_dir(root: Path = Path("runs")) -> Path:
    """``runs/<timestamp>``, with ``-2``, ``-3``... when a run started in the same second already took it."""
    base = root / datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def check_out_dir(out: Path, *, resumes: Path | None = None, overwrite: bool = False) -> list[Path]:
    """What :func:`claim_out_dir` would remove from ``out`` (nothing is touched: a check before the config is).

    Args:
        out: the run's output directory.
        resumes: the run directory the run resumes from (``None``: a new run). A run continues in its own
            directory; into another one only as a new run would.
        overwrite: an earlier run's outputs in ``out`` are to be removed.

    Raises:
        ConfigError: ``out`` holds an earlier run's outputs (the message says how to continue or replace it),
            or ``overwrite`` would remove the checkpoint the run resumes from.
    """
    if resumes is not None and resumes.resolve() == out.resolve():
        if overwrite:
            raise ConfigError(f"--overwrite with --resume {out}: it would delete the checkpoint the run resumes "
                              "from; leave out --overwrite to continue that run, or give another --out")
        return []
    found = run_outputs(out)
    if found and not overwrite:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found[:4]) + (", ..." if len(found) > 4 else "")
        cont = f"continue it with --resume {out}, " if (out / "checkpoints" / "latest").is_file() else ""
        raise ConfigError(f"--out {out} holds an earlier run ({names}); {cont}replace it with --overwrite, or "
                          "choose another --out")
    return found


def claim_out_dir(out: Path, *, resumes: Path | None = None, overwrite: bool = False) -> None:
    """Make ``out`` the new run's directory: refuse another run's outputs there, or remove them (``overwrite``).

    Args and Raises: as :func:`check_out_dir`.
    """
    found = check_out_dir(out, resumes=resumes, overwrite=overwrite)
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if found:
        log.info("--overwrite: removed %s from %s", ", ".join(p.name for p in found), out)
