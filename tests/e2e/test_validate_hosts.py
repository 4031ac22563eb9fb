"""`digenrl validate` on a config spanning hosts: which interface each role's gloo groups will use, and the
warning that the torch.distributed links (plain TCP) need a trusted network (docs/machines.md, Security)."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.recipes.preflight import gloo_interfaces, untrusted_links

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"


def test_gloo_groups_on_joined_workers_are_decided_on_their_hosts_and_plain_tcp_is_flagged() -> None:
    cfg = load_config(CONFIG, ["placement.trainer=2", "placement.workers=3", "transport.weights=gloo",
                               "transport.address=tcp://198.18.0.1:5555"])
    trainers, lane = gloo_interfaces(cfg)
    assert trainers.startswith("gloo: the trainer group (placement.trainer = 2): trainer-0, trainer-1 run on joined "
                               "workers (placement.workers = 3); each decides on its own host: GLOO_SOCKET_IFNAME")
    assert "the weight lane (transport.weights = 'gloo'): trainer-0, rollout-0 run on joined workers" in lane
    [warning] = untrusted_links(cfg)
    assert warning.startswith("placement.trainer = 2 (gradients) and transport.weights = 'gloo' (the weights) with "
                              "transport.address = 'tcp://198.18.0.1:5555' off loopback")
    assert "neither encrypted nor authenticated" in warning and "(docs/machines.md, Security)" in warning


def test_one_host_says_its_interface_and_warns_of_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    cfg = load_config(CONFIG, ["placement.trainer=2", "transport.weights=gloo"])
    assert gloo_interfaces(cfg)[0].endswith("trainer-0, trainer-1 run on this host and listen on lo 127.0.0.1 "
                                            "(route to 127.0.0.1)")
    assert untrusted_links(cfg) == []
    # One trainer and the zmq lane across hosts: everything is CURVE, nothing to warn of, no gloo group.
    across = load_config(CONFIG, ["placement.workers=2", "transport.address=tcp://198.18.0.1:5555"])
    assert untrusted_links(across) == [] and gloo_interfaces(across) == []


def test_validate_prints_the_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from digenrl_cli.main import app

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    result = CliRunner().invoke(app, ["validate", str(CONFIG), "--set", "placement.trainer=2"])
    assert result.exit_code == 0, result.output
    assert ("\n  gloo: the trainer group (placement.trainer = 2): trainer-0, trainer-1 run on this host and listen on "
            "lo 127.0.0.1 (route to 127.0.0.1)\n") in result.output
    assert "warning:" not in result.output
