"""`digenrl run` on a machine that cannot run the config fails at once, before any process starts, and
`digenrl validate` refuses exactly what run would (the same checks, the same line)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.rewards import make_reward
from digenrl.rewards.server import RewardServer
from digenrl.transport.curve import create_keys
from digenrl.transport.hosts import interface_addresses
from digenrl_cli.main import app

REAL_CONFIGS = ["configs/qwenimage.toml", "configs/flux.toml", "configs/wan21.toml", "configs/hunyuanvideo.toml",
                "configs/wan22.toml", "configs/sd3.toml", "configs/qwenimage_edit.toml"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_real_model_configs_fail_fast_without_gpu_pointing_to_tiny(config: str) -> None:
    result = CliRunner().invoke(app, ["run", config])
    assert result.exit_code == 2
    assert "model.device" in result.output and "no CUDA device" in result.output
    assert "configs/tiny-qwenimage.toml" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without the config's GPUs")
@pytest.mark.parametrize("config", [c if c in ("configs/sd3.toml", "configs/wan22.toml") else  # (each plans ~10 s)
                                    pytest.param(c, marks=pytest.mark.slow) for c in REAL_CONFIGS])
def test_validate_checks_a_gpu_config_off_its_host_and_says_what_it_left(config: str) -> None:
    """A login node: keys, values, rewards and the memory plan checked; the device, weights, bind address and
    served rewards left for the host that runs it, by name."""
    result = CliRunner().invoke(app, ["validate", config])
    assert result.exit_code == 0, result.output
    assert "ok (" in result.output and "left for the host that runs it" in result.output
    assert "left: model.device = 'cuda'" in result.output and "left: model.path" in result.output


def test_validate_lists_every_problem_at_once() -> None:
    result = CliRunner().invoke(app, ["validate", "configs/qwenimage.toml", "--set", "train.lr=-1", "--set",
                                      "rollout.num_steps=1", "--set", "placement.rollout=2x"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("config error:")]
    assert [line.split(":")[1].strip() for line in lines] == ["rollout.num_steps", "train.lr", "placement.rollout"]
    memory = CliRunner().invoke(app, ["validate", "configs/sd3.toml", "--set", "train.rows_per_pass=256",
                                      "--set", "placement.actors_per_gpu=2"])  # (off its host: planned all the same)
    assert memory.exit_code == 2
    assert [line.split(" role ")[0] for line in memory.output.splitlines() if "role needs" in line] == [
        "config error: memory: the trainer"]
    assert memory.output.count("placement.actors_per_gpu = 2 puts trainer + rollout on one H100") == 1


@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_missing_weights_directory_is_named(config: str, tmp_path) -> None:
    missing = tmp_path / "nowhere"
    result = CliRunner().invoke(app, ["run", config, "--set", "model.device='cpu'", "--set", f"model.path='{missing}'"])
    assert result.exit_code == 2
    assert "model.path" in result.output and str(missing) in result.output


# The multi-node configs ship a placeholder for node 0's address: it must be set (to one of this host's).
PLACEHOLDER_CONFIGS = ["configs/wan21.toml", "configs/hunyuanvideo.toml", "configs/wan22.toml"]


@pytest.fixture(scope="module")
def reward_server() -> Iterator[RewardServer]:
    """A reward service on a loopback port, as `python -m digenrl.rewards.server` serves one."""
    with RewardServer(make_reward("jpeg_compressibility")) as server:
        yield server


@pytest.fixture
def reward_url(reward_server: RewardServer) -> str:
    return reward_server.url


def _ready(config: str, tmp_path: Path, reward_url: str, *, address: bool = True) -> list[str]:
    """``--set`` arguments giving this host what ``config`` needs from the machine it runs on (validate,
    like run, checks them): a weights directory, CURVE keys, the reward service, node 0's address, and
    on a CPU-only machine the Ray launcher (Ray places the actors on GPU nodes; the driver needs none)."""
    cfg = load_config(config)
    sets: list[str] = []
    if cfg.model.preset == "pretrained":
        (tmp_path / "weights").mkdir()
        (tmp_path / "weights" / "model_index.json").write_text("{}")
        sets.append(f"model.path='{tmp_path / 'weights'}'")
    if cfg.model.device.startswith("cuda") and not torch.cuda.is_available():
        if importlib.util.find_spec("ray") is None:
            pytest.skip("neither a GPU nor Ray here: this config cannot run on this machine")
        sets += ["cluster.launcher=ray", "placement.workers=0"]
    if cfg.transport.keys:
        sets.append(f"transport.keys='{create_keys(tmp_path / 'keys')}'")
    if "remote" in cfg.reward.weights:
        sets.append(f"reward.url='{reward_url}'")
    for name in ("clipscore", "pickscore"):  # a tiny CLIPModel with its processor, as the learned rewards' tests make
        if name in cfg.reward.weights:
            from tests.rewards._learned_fixtures import tiny_clip_dir

            d = tiny_clip_dir(tmp_path / name)
            sets += [f"reward.models.{name}.path='{d}'", f"reward.models.{name}.processor_path='{d}'"]
    if address and config in PLACEHOLDER_CONFIGS:
        sets.append("transport.address=tcp://127.0.0.1:5555")
    return [arg for s in sets for arg in ("--set", s)]


@pytest.mark.parametrize("config", [*REAL_CONFIGS, "configs/tiny-qwenimage.toml"])
def test_every_shipped_config_validates(config: str, tmp_path: Path, reward_url: str) -> None:
    result = CliRunner().invoke(app, ["validate", config, *_ready(config, tmp_path, reward_url)])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


@pytest.mark.parametrize("config", PLACEHOLDER_CONFIGS)
def test_validate_says_the_address_placeholder_must_be_replaced(config: str, tmp_path: Path, reward_url: str) -> None:
    result = CliRunner().invoke(app, ["validate", config, *_ready(config, tmp_path, reward_url, address=False)])
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


@pytest.mark.parametrize("schedule", ["colocated", "async1"])
def test_resume_from_a_path_without_a_checkpoint_is_refused(schedule: str, tmp_path) -> None:
    """Every schedule resumes (the colocated loop too, since issue 29 item 4); a path holding no checkpoint is
    named at once, before anything starts or is written."""
    missing = tmp_path / "[x]"
    result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--set", f"schedule.name={schedule}",
                                      "--resume", str(missing)])
    assert result.exit_code == 2, result.output
    assert f"config error: --resume '{missing}': no such file or directory" in " ".join(result.output.split())
    assert not missing.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [[], ["run"], ["validate"], ["worker"], ["keys"], ["keys", "create"], ["bench"], ["bench", "bubbles"]])
def test_help_prints_config_tables_literally(command: list[str]) -> None:
    """Help texts name config tables such as [schedule]; no markup may eat them."""
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    if command == ["run"]:
        assert "[schedule] name picks the single-process colocated loop" in " ".join(result.output.split())
    assert "[/" not in result.output  # no stray rich markup


def _loopback_interface() -> str:
    names = [name for name, ips in interface_addresses().items() if "127.0.0.1" in ips]
    if not names:
        pytest.skip("no interface holds 127.0.0.1")
    return names[0]


def test_a_run_reachable_from_other_hosts_without_keys_refuses_to_start(tmp_path) -> None:
    # Refused before anything binds or spawns. The address must be one of this host's (any other is
    # refused earlier, by the bind-address check) and count as reachable from other hosts: an interface
    # *name* does (the CURVE rule never resolves names), so the loopback interface by name meets the rule
    # while nothing here could ever listen off loopback.
    address = f"tcp://{_loopback_interface()}:5555"
    for command in (["validate"], ["run", "--out", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, [*command, "configs/tiny-qwenimage.toml", "--set", f"transport.address='{address}'"])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert text.startswith(f"config error: transport.address = '{address}' is reachable from other hosts")
        assert "digenrl keys create PATH" in text and "transport.keys" in text
    assert not (tmp_path / "run").exists()


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


def _closed_port() -> int:
    with socket.socket() as s:  # a loopback port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys_readable_by_others(tmp: Path) -> Path:
    root = create_keys(tmp / "keys")
    os.chmod(root / "client.key_secret", 0o644)
    return root


# Issue 29 items 2 and 6a: each of these passed `digenrl validate` (ok) and then stopped `digenrl run` in its
# transport, its Ray launcher or an actor process (a remote traceback). Per case, from (tmp_path, a closed
# loopback port): the --set arguments, and the start of the one line both commands print.
REFUSED = {
    "keys-missing": (
        lambda tmp, port: [f"transport.keys='{tmp / 'nowhere'}'"],
        lambda tmp, port: f"transport.keys: '{tmp / 'nowhere' / 'server.key_secret'}' does not exist; create them "
                          f"with `digenrl keys create {tmp / 'nowhere'}`"),
    "keys-readable-by-others": (
        lambda tmp, port: [f"transport.keys='{_keys_readable_by_others(tmp)}'"],
        lambda tmp, port: f"transport.keys: '{tmp / 'keys' / 'client.key_secret'}' is readable by others (mode 644); "
                          "run `chmod 600"),
    "ray-missing": (
        lambda tmp, port: ["cluster.launcher=ray"],
        lambda tmp, port: "cluster.launcher = 'ray' needs Ray, which is not installed; install it with "
                          "`pip install 'digenrl[ray]'`"),
    "init-of-another-preset": (
        lambda tmp, port: ["model.preset=tiny"],
        lambda tmp, port: "model.init: 'checkpoints/tiny4x-shapes/model.safetensors' does not fit the qwenimage "
                          "model's vae: missing ['decoder.up_blocks.1."),
    "reward-nobody-answers": (
        lambda tmp, port: ["reward.weights={remote = 1.0}", "reward.retries=0", f"reward.url='http://127.0.0.1:{port}'"],
        lambda tmp, port: f"reward.url: reward 'remote' at http://127.0.0.1:{port}: failed after 1 attempt: URLError: "
                          "[Errno 111] Connection refused; is the reward server running? `python -m "
                          f"digenrl.rewards.server --reward NAME --port {port}`"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_validate_refuses_what_run_refuses_in_the_same_line(case: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "ray-missing":
        monkeypatch.setitem(sys.modules, "ray", None)  # as if the [ray] extra were not installed
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # what the launcher sets before importing it
    port = _closed_port()
    sets, expected = REFUSED[case]
    args = ["configs/tiny-qwenimage.toml", *(a for s in sets(tmp_path, port) for a in ("--set", s))]
    lines = []
    for command in (["validate"], ["run", "--out", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 2, result.output  # refused by the config checks, before anything starts
        assert "Traceback" not in result.output
        lines.append(" ".join(result.output.split()))
    assert lines[0].startswith(f"config error: {expected(tmp_path, port)}"), lines[0]
    assert lines[1] == lines[0], "run says something else than validate"
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_reward_url_without_a_scoring_endpoint_is_refused_before_the_run(tmp_path: Path, reward_server) -> None:
    """The server answers, but not on that path (HTTP 404): one line naming reward.url, nothing started."""
    wrong = reward_server.url.replace("/score", "/v1/reward")
    result = CliRunner().invoke(app, ["run", "configs/tiny-qwenimage.toml", "--out", str(tmp_path / "run"),
                                      "--set", "reward.weights={remote = 1.0}", "--set", f"reward.url='{wrong}'"])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert line.startswith(f"config error: reward.url: reward 'remote' at {wrong}: HTTP 404")
    assert f"`python -m digenrl.rewards.server` scores on {reward_server.url}" in line
    assert not (tmp_path / "run").exists()


def test_a_reward_service_that_answers_passes_and_scores_nothing(reward_server) -> None:
    scored = reward_server.requests
    result = CliRunner().invoke(app, ["validate", "configs/tiny-qwenimage.toml", "--set", "reward.weights={remote = 1.0}",
                                      "--set", f"reward.url='{reward_server.url}'"])
    assert result.exit_code == 0, result.output
    assert reward_server.requests == scored  # the probe's empty batch reaches no reward


def test_a_reward_whose_failures_never_stop_the_run_is_not_probed() -> None:
    """on_error = "penalty" with max_failure_fraction = 1: the run goes on whatever the service does (every
    failed sample is penalised), so a service that is down now is no reason to refuse it."""
    result = CliRunner().invoke(app, ["validate", "configs/tiny-qwenimage.toml", "--set", "reward.weights={remote = 1.0}",
                                      "--set", f"reward.url='http://127.0.0.1:{_closed_port()}/score'",
                                      "--set", "reward.on_error=penalty", "--set", "reward.max_failure_fraction=1.0"])
    assert result.exit_code == 0, result.output


def test_an_edit_run_against_an_edit_reward_server_needs_remote_sources(tmp_path: Path) -> None:
    """configs/qwenimage_edit.toml weights a served reward; served edit_consistency needs the input images:
    validate refuses in one line naming reward.remote_sources until the run sends them."""
    from digenrl.rewards.edit import EditConsistencyReward

    with RewardServer(EditConsistencyReward()) as server:
        ready = _ready("configs/qwenimage_edit.toml", tmp_path, server.url)
        result = CliRunner().invoke(app, ["validate", "configs/qwenimage_edit.toml", *ready])
        assert result.exit_code == 2, result.output
        line = " ".join(result.output.split())
        assert line.startswith("config error: reward.url: ") and "set reward.remote_sources = true" in line, line
        result = CliRunner().invoke(app, ["validate", "configs/qwenimage_edit.toml", *ready,
                                          "--set", "reward.remote_sources=true"])
        assert result.exit_code == 0, result.output
