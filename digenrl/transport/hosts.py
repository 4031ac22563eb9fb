"""This host's network interfaces, and whether an address can be bound here.

A ``tcp://HOST:PORT`` bind only works when HOST is one of this host's interface addresses (or an
interface name, ``localhost``, or a wildcard). Shipped cluster configs name another machine's
address or a placeholder; without this check a run dies with ZeroMQ's bare "Cannot assign
requested address". :func:`check_bind_address` names the config key, this host's addresses and the
``--set`` that fixes it, before anything is spawned (``digenrl validate`` and ``digenrl run``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

from digenrl.errors import ConfigError

__all__ = ["WILDCARDS", "interface_addresses", "split_tcp", "check_bind_address", "bind_error"]

#: Hosts that bind every interface.
WILDCARDS = ("0.0.0.0", "::", "*")


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4 and IPv6 addresses (link-local scope suffixes removed), via psutil."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        if ips:
            out[name] = ips
    return out


def split_tcp(address: str) -> tuple[str, str]:
    """``tcp://host:port`` (``[v6]:port`` too) -> ``(host, port)``; the port is left as written."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _suggestion(interfaces: dict[str, list[str]]) -> str:
    """The address to suggest: the first non-loopback IPv4, else loopback."""
    for ips in interfaces.values():
        for ip in ips:
            if "." in ip and not ip.startswith("127."):
                return ip
    return "127.0.0.1"


def _listing(interfaces: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} {ip}" for name, ips in interfaces.items() for ip in ips) or "none found"


def check_bind_address(address: str, key: str = "transport.address") -> None:
    """Fail early when ``address`` is a ``tcp://`` address this host cannot bind.

    ``ipc://``, ``inproc://``, empty addresses and wildcards always pass; interface names and
    ``localhost`` pass when this host has them. Names are never looked up in DNS.

    Raises:
        ConfigError: one line naming ``key``, the missing interface, this host's addresses and the
            ``--set`` that fixes it.
    """
    if not address.startswith("tcp://"):
        return
    host, port = split_tcp(address)
    if host in WILDCARDS:
        return
    interfaces = interface_addresses()
    local = {ip for ips in interfaces.values() for ip in ips}
    if host in local or host in interfaces or host == "localhost":
        return
    if _is_ip(host):
        what = f"this host has no interface with address {host}"
    else:
        what = f"this host has no interface named {host!r} (a placeholder? put this node's address there)"
    raise ConfigError(f"{key} = {address!r}: {what}; its addresses: {_listing(interfaces)}; set one of them, "
                      f"e.g. --set {key}=tcp://{_suggestion(interfaces)}:{port or 5555}")


def bind_error(address: str, key: str, err: int) -> ConfigError:
    """The ``ConfigError`` for a failed bind of ``address`` (held by config ``key``) with errno ``err``."""
    if err == errno.EADDRINUSE:
        hint = "another process listens there: stop it or choose another port"
    elif err in (errno.EADDRNOTAVAIL, errno.ENODEV):
        interfaces = interface_addresses()
        hint = (f"this host has no such interface; its addresses: {_listing(interfaces)}; e.g. "
                f"--set {key}=tcp://{_suggestion(interfaces)}:{split_tcp(address)[1] or 5555}")
    else:
        hint = "check the address"
    return ConfigError(f"{key} = {address!r}: cannot bind ({os.strerror(err)}): {hint}")
