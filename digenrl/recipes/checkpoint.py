"""Atomic checkpoints of a run (the actors' and the colocated loop's, one format), and finding the one to resume from.

Layout under ``<out>/checkpoints/``::

    step-000003/            one complete checkpoint (the optimizer step count in its name)
        trainable.safetensors   trainable weights (LoRA-only when training LoRA)
        optimizer.pt            the optimizer state (written by the lead trainer)
        previous.safetensors    one-step-stale schedules: the weights one version back, which the
                                next batch is generated with (so a resumed run continues exactly)
        coordinator.json        version, next batch (dataset position), run seed, metrics history,
                                schedule name, fragments in flight when it was taken
    latest                  a one-line file naming the newest complete checkpoint

Writing is atomic: everything goes into a hidden ``.tmp-step-*`` directory, each file and the
directory are fsynced, the directory is renamed into place, then ``latest`` is replaced by
write-temp + fsync + rename. A crash at any point leaves ``latest`` naming a complete checkpoint
(or missing, before the first); leftover temp directories are ignored and cleaned on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from digenrl.errors import ConfigError

__all__ = ["save_checkpoint", "write_checkpoint", "find_checkpoint", "run_directory", "load_state", "REQUIRED_FILES"]

REQUIRED_FILES = ("trainable.safetensors", "optimizer.pt", "coordinator.json")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def save_checkpoint(root: Path, step: int, state: dict[str, Any],
                          write_trainer: Callable[[Path], Awaitable[Any]], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically under ``root`` and point ``latest`` at it.

    Args:
        root: the checkpoints directory (created if missing).
        step: optimizer steps done (the version the weights are at).
        state: the coordinator's JSON-serialisable state.
        write_trainer: writes the trainer's files into the directory it is given.
        keep: complete checkpoints kept: the new one and the newest ``keep - 1`` others (removed after the
            new one is in place and ``latest`` names it).

    Returns:
        The checkpoint directory.
    """
    tmp = _begin(root, step)
    await write_trainer(tmp)
    return _commit(root, tmp, step, state, keep)


def write_checkpoint(root: Path, step: int, state: dict[str, Any], write_trainer: Callable[[Path], Any],
                     keep: int = 2) -> Path:
    """:func:`save_checkpoint` for a trainer in this process (the colocated loop): the same files, the same
    atomic commit."""
    tmp = _begin(root, step)
    write_trainer(tmp)
    return _commit(root, tmp, step, state, keep)


def _begin(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _commit(root: Path, tmp: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    (tmp / "coordinator.json").write_text(json.dumps(state))
    for name in REQUIRED_FILES:
        if not (tmp / name).is_file():
            raise RuntimeError(f"checkpoint {step}: {name} was not written")
        _fsync_file(tmp / name)
    _fsync_dir(tmp)
    final = root / f"step-{step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    _fsync_file(pointer)
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    _prune(root, final, keep)
    return final


def _prune(root: Path, latest: Path, keep: int) -> None:
    """Keep ``latest`` (what ``latest`` names) and the newest ``keep - 1`` others. By step number, never by
    position: a directory may hold checkpoints of higher steps than the one just written (a resume from an
    older checkpoint), and the one ``latest`` names must survive them."""
    others = sorted(p for p in root.glob("step-*") if p.is_dir() and p != latest)
    for old in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint to resume from: a ``step-*`` directory, a checkpoints root, or a run's out dir.

    Raises:
        ConfigError: nothing resumable there, or the checkpoint misses a file (named).
    """
    given = Path(path)
    if not given.exists():
        raise ConfigError(f"--resume {str(path)!r}: no such file or directory")
    p = given
    for root in (given, given / "checkpoints"):
        pointer = root / "latest"
        if pointer.is_file():
            p = root / pointer.read_text().strip()
            if not p.is_dir():
                raise ConfigError(f"--resume {str(path)!r}: {pointer} names {p.name}, which is not there")
            break
    else:
        if not given.is_dir() or not (given.name.startswith("step-") or any((given / n).exists()
                                                                            for n in REQUIRED_FILES)):
            raise ConfigError(_not_resumable(given, path))
    missing = [n for n in REQUIRED_FILES if not (p / n).is_file()]
    if missing:
        raise ConfigError(f"--resume {str(path)!r}: checkpoint {p} is incomplete, missing {missing}")
    return p


def _not_resumable(p: Path, path: str | Path) -> str:
    """Why ``p`` (no ``latest`` in it or its ``checkpoints/``) is nothing to resume from."""
    if not p.is_dir():
        return f"--resume {str(path)!r}: a file, not a run directory or checkpoint"
    if (p / "metrics.jsonl").is_file() or (p / "checkpoints").is_dir():
        return (f"--resume {str(path)!r}: a run directory without a checkpoint (it stopped before its first, or "
                f"ran with log.checkpoint_every = 0): nothing to resume; start it again with --out {str(path)!r} "
                "--overwrite")
    return (f"--resume {str(path)!r}: not a run directory (no checkpoints/latest in it) nor a checkpoint "
            "(step-*/ with trainable.safetensors, optimizer.pt, coordinator.json)")


def run_directory(checkpoint: Path) -> Path:
    """The run directory a checkpoint (``<run>/checkpoints/step-*``) belongs to: where a resumed run continues."""
    return checkpoint.parent.parent


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The coordinator state stored in ``checkpoint``.

    Raises:
        ConfigError: ``coordinator.json`` is unreadable or lacks ``version``.
    """
    try:
        state = json.loads((checkpoint / "coordinator.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"checkpoint {checkpoint}: unreadable coordinator.json: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("version"), int):
        raise ConfigError(f"checkpoint {checkpoint}: coordinator.json has no integer 'version'")
    return state
