"""Atomic checkpoints: a crash while writing never leaves a broken latest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.errors import ConfigError
from digenrl.recipes.checkpoint import find_checkpoint, load_state, save_checkpoint


async def _trainer_files(d: Path) -> None:
    (d / "trainable.safetensors").write_bytes(b"w")
    (d / "optimizer.pt").write_bytes(b"o")


async def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    await save_checkpoint(root, 1, {"version": 1, "history": [{"step": 0}]}, _trainer_files)

    async def crash(d: Path) -> None:
        (d / "trainable.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        await save_checkpoint(root, 2, {"version": 2}, crash)
    ckpt = find_checkpoint(tmp_path)  # a run directory resolves through checkpoints/latest
    assert ckpt.name == "step-000001"
    assert load_state(ckpt)["version"] == 1
    await save_checkpoint(root, 2, {"version": 2}, _trainer_files)
    await save_checkpoint(root, 3, {"version": 3}, _trainer_files, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert json.loads((find_checkpoint(root) / "coordinator.json").read_text())["version"] == 3


async def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path: Path) -> None:
    """Issue 37: a new run's step 1 among an older run's steps 7 and 8 was pruned as the oldest, leaving
    ``latest`` naming a deleted directory."""
    root = tmp_path / "checkpoints"
    for step in (7, 8, 1):
        await save_checkpoint(root, step, {"version": step}, _trainer_files, keep=2)
    assert (root / "latest").read_text().strip() == "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000008"]
    assert load_state(find_checkpoint(tmp_path))["version"] == 1
    await save_checkpoint(root, 2, {"version": 2}, _trainer_files, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]


def test_incomplete_or_missing_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'.*nope': no such file or directory"):
        find_checkpoint(tmp_path / "nope")
    plain = tmp_path / "photos"
    plain.mkdir()
    (plain / "cat.png").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a run directory .* nor a checkpoint"):
        find_checkpoint(plain)
    (plain / "metrics.jsonl").write_text("{}\n")  # a run stopped before its first checkpoint
    with pytest.raises(ConfigError, match="a run directory without a checkpoint.*--overwrite"):
        find_checkpoint(plain)
    bad = tmp_path / "step-000004"
    bad.mkdir()
    (bad / "coordinator.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"missing \['trainable.safetensors', 'optimizer.pt'\]"):
        find_checkpoint(bad)
