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


@pytest.mark.parametrize("command", [[], ["run"], ["validate"], ["worker"], ["bench"], ["bench", "bubbles"]])
def test_help_prints_config_tables_literally(command: list[str]) -> None:
    """Help texts name config tables such as [schedule]; no markup may eat them."""
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    if command == ["run"]:
        assert "[schedule] name picks the single-process colocated loop" in " ".join(result.output.split())
    assert "[/" not in result.output  # no stray rich markup
