"""`digenrl run` on a machine that cannot run the config fails at once, before any process starts."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from digenrl_cli.main import app

REAL_CONFIGS = ["configs/qwenimage.toml", "configs/flux.toml", "configs/wan21.toml", "configs/hunyuanvideo.toml"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_real_model_configs_fail_fast_without_gpu_pointing_to_tiny(config: str) -> None:
    result = CliRunner().invoke(app, ["run", config])
    assert result.exit_code == 2
    assert "model.device" in result.output and "no CUDA device" in result.output
    assert "configs/tiny-qwenimage.toml" in result.output


@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_missing_weights_directory_is_named(config: str, tmp_path) -> None:
    missing = tmp_path / "nowhere"
    result = CliRunner().invoke(app, ["run", config, "--set", "model.device='cpu'", "--set", f"model.path='{missing}'"])
    assert result.exit_code == 2
    assert "model.path" in result.output and str(missing) in result.output


@pytest.mark.parametrize("config", [*REAL_CONFIGS, "configs/tiny-qwenimage.toml"])
def test_every_shipped_config_validates(config: str) -> None:
    result = CliRunner().invoke(app, ["validate", config])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


def test_resume_with_the_colocated_loop_is_refused() -> None:
    result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--set", "schedule.name=colocated", "--resume", "runs/x"])
    assert result.exit_code == 2
    assert "--resume needs an actor schedule" in result.output


@pytest.mark.parametrize("command", [[], ["run"], ["validate"], ["worker"], ["keys"], ["keys", "create"], ["bench"], ["bench", "bubbles"]])
def test_help_prints_config_tables_literally(command: list[str]) -> None:
    """Help texts name config tables such as [schedule]; no markup may eat them."""
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    if command == ["run"]:
        assert "[schedule] name picks the single-process colocated loop" in " ".join(result.output.split())
    assert "[/" not in result.output  # no stray rich markup


def test_a_run_reachable_from_other_hosts_without_keys_refuses_to_start(tmp_path) -> None:
    # Refused before anything binds or spawns (no address outside loopback is contacted).
    result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--out", str(tmp_path),
                                      "--set", "transport.address='tcp://10.0.0.1:0'"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "digenrl keys create PATH" in text and "transport.keys" in text


def test_keys_create_writes_private_keys_and_never_overwrites(tmp_path) -> None:
    result = CliRunner().invoke(app, ["keys", "create", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0
    again = CliRunner().invoke(app, ["keys", "create", str(tmp_path / "k")])
    assert again.exit_code == 2 and "already holds keys" in again.output
