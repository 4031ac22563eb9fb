"""CURVE authentication of the zmq transport: keys on disk stay private, only the cluster's keys get a
message through, refused peers are counted, and nothing binds off loopback without keys."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from digenrl.errors import ConfigError, TransportBroken
from digenrl.transport.curve import create_keys, is_loopback, load_keys
from digenrl.transport.zmq import ZmqTransport

pytestmark = pytest.mark.timeout(60)


async def _until(cond, what: str, timeout: float = 20.0) -> None:
    """Wait for a condition the event loop makes true (a counter a monitor task bumps)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_keys_are_owner_only_and_round_trip(tmp_path: Path) -> None:
    root = create_keys(tmp_path / "keys")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o600
    keys = load_keys(root)
    assert keys.server_public != keys.client_public and len(keys.server_secret) == 40
    assert keys.allowed_clients == {keys.client_public}
    assert "secret" not in repr(keys) and keys.server_secret.decode() not in repr(keys)
    with pytest.raises(ConfigError, match="already holds keys"):
        create_keys(root)  # never overwrites a cluster's keys


def test_bad_key_directories_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"digenrl keys create .*transport.keys"):
        load_keys(tmp_path / "missing")
    root = create_keys(tmp_path / "keys")
    os.chmod(root / "client.key_secret", 0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        load_keys(root)


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:0", True), ("tcp://[::1]:5555", True),
    ("tcp://localhost:1", True), ("ipc:///tmp/x.sock", True), ("tcp://10.0.0.1:5555", False),
    ("tcp://0.0.0.0:0", False), ("tcp://*:5555", False), ("tcp://node7:5555", False),
])
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


@pytest.mark.parametrize("address", ["tcp://10.0.0.1:0", "tcp://0.0.0.0:0", "tcp://node7:5555"])
def test_no_bind_off_loopback_without_keys(address: str) -> None:
    # Refused before any socket binds (nothing is contacted).
    with pytest.raises(ConfigError, match=r"digenrl keys create PATH.*transport.keys = "):
        ZmqTransport(address)


async def test_only_the_clusters_keys_get_through_and_refusals_are_counted(tmp_path: Path) -> None:
    keys = load_keys(create_keys(tmp_path / "cluster"))
    other = load_keys(create_keys(tmp_path / "other"))
    server = ZmqTransport("tcp://127.0.0.1:0", curve=keys)
    good = ZmqTransport("tcp://127.0.0.1:0", curve=keys)
    plain = ZmqTransport("tcp://127.0.0.1:0", connect_timeout_s=5)  # no keys at all
    stranger = ZmqTransport("tcp://127.0.0.1:0", curve=other, connect_timeout_s=5)  # another cluster's keys
    try:
        receiving = asyncio.ensure_future(server.recv())  # starts the reader and the refusal counter
        for intruder in (plain, stranger):
            with pytest.raises(TransportBroken):
                await intruder.send(server.address, {"op": "let me in"})
        await _until(lambda: server.stats["auth_failed"] >= 2, "two refused handshakes")
        await good.send(server.address, {"op": "hello"})
        msg = await asyncio.wait_for(receiving, 20)
        assert msg.header["op"] == "hello" and msg.src == good.address
        await server.send(msg.src, {"op": "reply"})  # the server's own DEALER authenticates too
        assert (await good.recv()).header["op"] == "reply"
        assert server.stats["received"] == 1  # nothing of the intruders reached recv
    finally:
        for t in (server, good, plain, stranger):
            await t.aclose()


async def test_a_client_with_a_foreign_client_key_is_refused_by_zap(tmp_path: Path) -> None:
    # Knows the server's public key (the handshake can start) but holds an unlisted client key.
    keys = load_keys(create_keys(tmp_path / "cluster"))
    other = load_keys(create_keys(tmp_path / "other"))
    from dataclasses import replace

    forged = replace(keys, client_public=other.client_public, client_secret=other.client_secret)
    server = ZmqTransport("tcp://127.0.0.1:0", curve=keys)
    client = ZmqTransport("tcp://127.0.0.1:0", curve=forged, connect_timeout_s=5)
    try:
        receiving = asyncio.ensure_future(server.recv())
        with pytest.raises(TransportBroken, match="CURVE handshake failed|did not accept"):
            await client.send(server.address, {"op": "forged"})
        await _until(lambda: server.stats["auth_failed"] >= 1, "a refused handshake")
        assert not receiving.done()
        receiving.cancel()
    finally:
        await server.aclose()
        await client.aclose()


def _without_keys(line: str) -> bool:
    """A keyless peer's refusal: ZeroMQ reports a mechanism mismatch, or (when the peer hung up before its
    greeting arrived, a race seen in CI) a broken handshake; both name the missing keys."""
    return "without CURVE keys" in line and "client key" not in line


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a peer" in r.getMessage()]


async def test_a_refusal_names_the_peers_address_never_the_endpoints_own(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Issue 29 item 6b: the log said `tcp://127.0.0.1:5558 refused a peer at tcp://127.0.0.1:5558`. The
    server listens on 127.0.0.2 and the peers dial it from 127.0.0.1 (loopback's source address), so the
    peer's address and the endpoint's differ. ZAP names the peer whose client key it refused; a peer
    without keys fails before ZAP is asked, and ZeroMQ reports no address for it."""
    from dataclasses import replace

    caplog.set_level(logging.WARNING, logger="digenrl.transport")
    keys = load_keys(create_keys(tmp_path / "cluster"))
    other = load_keys(create_keys(tmp_path / "other"))
    forged = replace(keys, client_public=other.client_public, client_secret=other.client_secret)
    try:
        server = ZmqTransport("tcp://127.0.0.2:0", curve=keys)
    except ConfigError:
        pytest.skip("this host cannot bind 127.0.0.2")
    forger = ZmqTransport("tcp://127.0.0.1:0", curve=forged, connect_timeout_s=5)
    plain = ZmqTransport("tcp://127.0.0.1:0", connect_timeout_s=5)
    try:
        receiving = asyncio.ensure_future(server.recv())  # starts the refusal monitor
        for intruder in (forger, plain):
            with pytest.raises(TransportBroken):
                await intruder.send(server.address, {"op": "let me in"})
        # the forger may be refused more than once (it retries) before the plain peer's refusal is logged
        await _until(lambda: any(_without_keys(ln) for ln in _refusals(caplog)), "the keyless peer's refusal")
        receiving.cancel()
    finally:
        for t in (server, forger, plain):
            await t.aclose()
    lines = _refusals(caplog)
    assert f"zmq endpoint {server.address} refused a peer at 127.0.0.1: its client key is not the cluster's" \
           in "\n".join(lines), lines
    assert any(_without_keys(line) and line.startswith(f"zmq endpoint {server.address} refused a peer ")
               for line in lines), lines
    assert not any(f"at {server.address}" in line for line in lines), lines


def test_a_keyless_peer_that_hangs_up_mid_handshake_is_still_named_keyless() -> None:
    """The race CI met: the keyless peer read this endpoint's CURVE greeting and hung up before its own
    arrived, so ZeroMQ reported a broken handshake (EPIPE) instead of a mechanism mismatch."""
    import errno

    import zmq

    from digenrl.transport.zmq import _handshake_failure

    broken = _handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.EPIPE)
    mismatch = _handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    assert _without_keys(broken) and "EPIPE" in broken, broken
    assert _without_keys(mismatch), mismatch
