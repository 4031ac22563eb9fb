"""Bind addresses this host cannot serve fail early, in one line that names the key and the fix.

192.0.2.1 is TEST-NET-1 (RFC 5737): no host has it, and nothing here ever sends to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.errors import ConfigError
from digenrl.transport import make_transport
from digenrl.transport.curve import create_keys, load_keys
from digenrl.transport.hosts import check_bind_address, interface_addresses
from digenrl.transport.zmq import ZmqTransport

TEST_NET = "tcp://192.0.2.1:5555"


def test_interface_addresses_include_loopback() -> None:
    ips = {ip for ips in interface_addresses().values() for ip in ips}
    assert "127.0.0.1" in ips


def test_an_address_of_another_host_names_the_key_the_host_addresses_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        check_bind_address(TEST_NET, "transport.address")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"transport.address = '{TEST_NET}': this host has no interface with address 192.0.2.1")
    assert "127.0.0.1" in msg  # the host's addresses are listed
    assert "--set transport.address=tcp://" in msg and msg.endswith(":5555")


def test_a_placeholder_is_called_one() -> None:
    with pytest.raises(ConfigError, match=r"no interface named 'NODE0_IP' \(a placeholder"):
        check_bind_address("tcp://NODE0_IP:5555", "transport.address")


@pytest.mark.parametrize("address", ["", "tcp://127.0.0.1:0", "tcp://localhost:5555", "tcp://0.0.0.0:5555",
                                     "tcp://*:5555", "ipc:///tmp/x.sock", "inproc://system"])
def test_local_wildcard_and_non_tcp_addresses_pass(address: str) -> None:
    check_bind_address(address, "transport.address")


def test_interface_names_pass() -> None:
    name = next(iter(interface_addresses()))
    check_bind_address(f"tcp://{name}:5555", "transport.address")


def test_the_zmq_bind_names_the_key_instead_of_a_raw_zmq_error(tmp_path: Path) -> None:
    keys = load_keys(create_keys(tmp_path / "keys"))  # an address off loopback needs them, or it is refused first
    with pytest.raises(ConfigError, match=r"^transport\.address = 'tcp://192\.0\.2\.1:5555': cannot bind "
                                          r"\(.*\): this host has no such interface; its addresses: .*127\.0\.0\.1"):
        ZmqTransport(TEST_NET, address_key="transport.address", curve=keys)


async def test_an_address_in_use_is_named() -> None:
    first = make_transport("zmq", "tcp://127.0.0.1:0")
    try:
        with pytest.raises(ConfigError, match="another process listens there"):
            make_transport("zmq", first.address, address_key="transport.address")
    finally:
        await first.aclose()
