"""Which interface a gloo group member listens on, so that peers on other hosts reach it.

gloo's own default binds the address this host's *name* resolves to, which on many machines (and in
every container whose ``/etc/hosts`` maps the name to 127.0.0.1) is loopback: every peer on another
host is then told to dial 127.0.0.1 and the group never forms (``Gloo connectFullMesh failed``).

The rule here, for every gloo group of a run (the trainer group and the weight lane's communicator):

1. ``GLOO_SOCKET_IFNAME`` set (gloo's own variable, e.g. ``eth1``): that interface, as gloo does.
2. Otherwise the address this process reaches the group's rendezvous from (the lead trainer's store,
   which that trainer opens on its own actor address): the kernel's source address for a route to
   it (a connected UDP socket sends nothing). For the lead that is its own zmq address; for a
   member it is the interface on the path to the lead: the one its own zmq address is on, on any
   host whose peers share one network.

A member that would listen on loopback while the rendezvous is on another host can never be
reached: :func:`check_reachable` says so in one line before gloo is asked.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from digenrl.errors import TransportBroken
from digenrl.transport.hosts import interface_addresses

__all__ = ["GlooInterface", "gloo_interface", "gloo_device", "gloo_env", "check_reachable"]

ENV = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class GlooInterface:
    """The interface a member listens on: its ``name`` (``None``: none of this host's has ``address``),
    ``address`` and ``why`` (``GLOO_SOCKET_IFNAME`` or the route to the rendezvous)."""

    name: str | None
    address: str
    why: str

    def __str__(self) -> str:
        return f"{self.name or '?'} {self.address} ({self.why})"


def _route_source(peer: str) -> str:
    """The local address the kernel sends from to reach ``peer`` (nothing is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except OSError as exc:
            raise TransportBroken(f"gloo: no route from this host to the group's rendezvous {peer}: {exc}") from None
        return str(probe.getsockname()[0])


def gloo_interface(rendezvous_host: str) -> GlooInterface:
    """The interface this process's gloo members listen on for a group whose store is at ``rendezvous_host``."""
    interfaces = interface_addresses()
    named = os.environ.get(ENV, "").split(",")[0].strip()
    if named:
        ips = interfaces.get(named, [])
        return GlooInterface(named, next((ip for ip in ips if "." in ip), ips[0] if ips else "?"), ENV)
    address = _route_source(rendezvous_host.strip("[]"))
    name = next((n for n, ips in interfaces.items() if address in ips), None)
    return GlooInterface(name, address, f"route to {rendezvous_host}")


def check_reachable(chosen: GlooInterface, rendezvous_host: str, what: str) -> None:
    """Refuse at once a member on loopback when the rendezvous is on another host (it could never be reached).

    Raises:
        TransportBroken: one line naming both addresses and the way out.
    """
    if _loopback(chosen.address) and not _loopback(rendezvous_host.strip("[]")):
        raise TransportBroken(f"{what}: this process would listen on {chosen}, which members on other hosts "
                              f"cannot reach (the rendezvous is at {rendezvous_host}); set {ENV} to the interface "
                              "they reach this host on")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def gloo_device(rendezvous_host: str, what: str) -> Any:
    """A ``ProcessGroupGloo.Device`` on :func:`gloo_interface`'s interface (checked by :func:`check_reachable`)."""
    import torch.distributed as dist

    chosen = gloo_interface(rendezvous_host)
    check_reachable(chosen, rendezvous_host, what)
    if chosen.why == ENV:
        return dist.ProcessGroupGloo.create_device(interface=chosen.name)
    return dist.ProcessGroupGloo.create_device(hostname=chosen.address)


@contextlib.contextmanager
def gloo_env(rendezvous_host: str, what: str) -> Iterator[GlooInterface]:
    """``GLOO_SOCKET_IFNAME`` set to :func:`gloo_interface`'s interface while the block runs (unless already set).

    For ``init_process_group``, which builds its gloo devices from that variable and takes none from us.
    """
    chosen = gloo_interface(rendezvous_host)
    check_reachable(chosen, rendezvous_host, what)
    if chosen.why == ENV or chosen.name is None:
        yield chosen
        return
    os.environ[ENV] = chosen.name
    try:
        yield chosen
    finally:
        os.environ.pop(ENV, None)
