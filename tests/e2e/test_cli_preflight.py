"""`digenrl run` on a machine that cannot run the config fails at once, before any process starts."""

from __future__ import annotations

import socket

import pytest
import torch
from typer.testing import CliRunner

from digenrl.transport.hosts import interface_addresses
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


# The multi-node configs ship a placeholder for node 0's address: it must be set (to one of this host's).
PLACEHOLDER_CONFIGS = ["configs/wan21.toml", "configs/hunyuanvideo.toml"]


@pytest.mark.parametrize("config", [*REAL_CONFIGS, "configs/tiny-qwenimage.toml"])
def test_every_shipped_config_validates(config: str) -> None:
    extra = ["--set", "transport.address=tcp://127.0.0.1:5555"] if config in PLACEHOLDER_CONFIGS else []
    result = CliRunner().invoke(app, ["validate", config, *extra])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


@pytest.mark.parametrize("config", PLACEHOLDER_CONFIGS)
def test_validate_says_the_address_placeholder_must_be_replaced(config: str) -> None:
    result = CliRunner().invoke(app, ["validate", config])
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert "transport.address = 'tcp://NODE0_IP:5555'" in line and "placeholder" in line
    assert "127.0.0.1" in line and "--set transport.address=tcp://" in line


def test_a_bind_address_of_another_host_stops_run_and_validate_in_one_line(tmp_path) -> None:
    """TEST-NET 192.0.2.1 is no interface of any host: one line names the key and the fix, nothing starts."""
    args = ["configs/tiny-qwenimage.toml", "--set", "transport.address=tcp://192.0.2.1:5555"]
    for command in (["validate"], ["run", "--out", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 2, result.output
        line = " ".join(result.output.split())
        assert line.startswith("config error: transport.address = 'tcp://192.0.2.1:5555': this host has no "
                               "interface with address 192.0.2.1; its addresses:")
        assert "127.0.0.1" in line and "--set transport.address=tcp://" in line
        assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing was started or written


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
    # Refused before anything binds or spawns. The address must be one of this host's (any other is
    # refused earlier, by the bind-address check), off loopback.
    ips = [ip for ips in interface_addresses().values() for ip in ips if "." in ip and not ip.startswith("127.")]
    if not ips:
        pytest.skip("this host has no IPv4 address off loopback")
    result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--out", str(tmp_path),
                                      "--set", f"transport.address='tcp://{ips[0]}:0'"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "digenrl keys create PATH" in text and "transport.keys" in text


def test_keys_create_writes_private_keys_and_never_overwrites(tmp_path) -> None:
    result = CliRunner().invoke(app, ["keys", "create", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0
    again = CliRunner().invoke(app, ["keys", "create", str(tmp_path / "k")])
    assert again.exit_code == 2 and "already holds keys" in again.output


def test_a_bind_address_in_use_names_the_key(tmp_path) -> None:
    """The port is taken (here by a plain socket): the driver's bind fails with the key, not a ZMQError."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--out", str(tmp_path / "run"),
                                          "--set", f"transport.address={address}"])
    assert result.exit_code == 1, result.output
    line = " ".join(result.output.split())
    assert f"transport.address = '{address}': cannot bind (Address already in use)" in line
    assert "another process listens there" in line and "Traceback" not in result.output
