"""ZeroMQ CURVE keys of a cluster: who may talk to a digenrl endpoint over the network.

One shared key set per cluster (``digenrl keys create PATH``), a directory readable only by its
owner::

    PATH/server.key  PATH/server.key_secret    every endpoint's ROUTER serves with this keypair
    PATH/client.key  PATH/client.key_secret    every endpoint's DEALERs connect with this one

Every process of a run (driver, actor processes, ``digenrl worker --keys PATH``, Ray workers) loads
the same directory. A connecting peer must know the server's public key to finish the CURVE
handshake, and ZeroMQ's ZAP handler (pyzmq's ``zmq.auth.ThreadAuthenticator``) then admits only the
allowed client public keys; a peer that fails either check never gets a message through, and the
endpoint counts it in ``stats["auth_failed"]``. Over ``tcp://`` off loopback an endpoint without
keys refuses to start (:func:`require_keys`).

Only ZAP learns a refused peer's address (the IP in its request); ZeroMQ's socket monitor reports
the endpoint's own. So the ZAP handler logs the key refusals with the peer's IP, and a peer that
fails earlier (no keys, or another cluster's server key: ZAP is never asked) is logged without one.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from digenrl.errors import ConfigError

__all__ = ["ClusterKeys", "create_keys", "load_keys", "is_loopback", "require_keys", "start_authenticator"]

_NAMES = ("server", "client")


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE keypairs of a cluster (z85 bytes) and the client public keys its servers admit."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed_clients: frozenset[bytes]
    path: str = ""

    def __repr__(self) -> str:  # never print secrets into logs
        return f"ClusterKeys({self.path!r})"

    def serve(self, sock: Any) -> None:
        """Make ``sock`` (a ROUTER) a CURVE server."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect(self, sock: Any) -> None:
        """Make ``sock`` (a DEALER) a CURVE client of servers holding this cluster's server key."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def _keys_hint(path: str) -> str:
    return f"create them with `digenrl keys create {path}` and set `transport.keys = \"{path}\"` in the config"


def create_keys(path: str | Path) -> Path:
    """Create the cluster's keypairs in the new (or empty) directory ``path``, owner-only (0700/0600).

    Raises:
        ConfigError: ``path`` already holds keys (never overwritten) or is not a directory.
    """
    import zmq.auth

    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"keys: {str(root)!r} exists and is not a directory")
    if any((root / f"{n}.key_secret").exists() for n in _NAMES):
        raise ConfigError(f"keys: {str(root)!r} already holds keys; delete them first to make new ones")
    old = os.umask(0o077)  # the secret files are born private, never briefly world-readable
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        for name in _NAMES:
            for file in zmq.auth.create_certificates(root, name):
                os.chmod(file, 0o600)
    finally:
        os.umask(old)
    return root


def load_keys(path: str | Path) -> ClusterKeys:
    """Load the keys ``create_keys`` wrote.

    Raises:
        ConfigError: the directory or a key file is missing or garbled, or a secret file is readable
            by others than its owner.
    """
    import zmq
    import zmq.auth

    root = Path(path)
    if not zmq.has("curve"):
        raise ConfigError("transport.keys: this pyzmq/libzmq was built without CURVE support")
    pairs: dict[str, tuple[bytes, bytes]] = {}
    for name in _NAMES:
        file = root / f"{name}.key_secret"
        if not file.is_file():
            raise ConfigError(f"transport.keys: {str(file)!r} does not exist; {_keys_hint(str(root))}")
        mode = stat.S_IMODE(file.stat().st_mode)
        if mode & 0o077:
            raise ConfigError(f"transport.keys: {str(file)!r} is readable by others (mode {mode:o}); "
                              f"run `chmod 600 {file}`")
        try:
            public, secret = zmq.auth.load_certificate(file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"transport.keys: cannot read {str(file)!r}: {exc}") from None
        if secret is None or len(public) != 40 or len(secret) != 40:
            raise ConfigError(f"transport.keys: {str(file)!r} holds no CURVE keypair; {_keys_hint(str(root))}")
        pairs[name] = (public, secret)
    return ClusterKeys(pairs["server"][0], pairs["server"][1], pairs["client"][0], pairs["client"][1],
                       frozenset({pairs["client"][0]}), str(root))


def is_loopback(address: str) -> bool:
    """True for ``ipc://`` paths and ``tcp://`` addresses on 127.0.0.0/8, ::1 or ``localhost``."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or a wildcard ('*'): reachable from elsewhere
        return False


def require_keys(address: str, keys: ClusterKeys | None, key: str | None = None) -> None:
    """Refuse an endpoint reachable from other hosts that has no keys.

    ``key``: the config key that holds ``address`` (e.g. ``transport.address``), named first in the error.

    Raises:
        ConfigError: ``address`` is a ``tcp://`` address off loopback and ``keys`` is None.
    """
    if keys is None and not is_loopback(address):
        where = f"{key} = {address!r}" if key else address
        raise ConfigError(f"{where} is reachable from other hosts, and an endpoint there must authenticate its "
                          f"peers (ZeroMQ CURVE): {_keys_hint('PATH')} (or `digenrl worker --keys PATH`)")


def start_authenticator(ctx: Any, keys: ClusterKeys) -> Any:
    """Start the ZAP handler of ``ctx`` admitting ``keys.allowed_clients``; returns it (``.stop()`` it).

    Must run before a CURVE server socket of ``ctx`` binds (ZeroMQ admits everyone without one). Set
    its ``endpoint`` to the socket's address once bound: its refusal log lines name it.
    """
    from digenrl.transport._zap import ClusterAuthenticator  # pyzmq: imported only where CURVE is on

    auth = ClusterAuthenticator(ctx, keys.allowed_clients)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=auth)
    return auth
