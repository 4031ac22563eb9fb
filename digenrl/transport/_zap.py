"""The ZAP handler of a CURVE endpoint: pyzmq's thread authenticator, admitting one cluster's client keys.

ZAP is the one place where ZeroMQ names a refused peer: each request carries the peer's IP. The
CURVE credentials callback gets only the key, so :meth:`ClusterAuthenticator.handle_zap_message`
keeps the request's address for it (the ZAP thread answers one request at a time), and a refused
key is logged with the IP it came from. Peers that fail before ZAP is asked (no keys, another
cluster's server key) are counted and logged by the endpoint's socket monitor, which knows no address.
"""

from __future__ import annotations

import logging
from typing import Any

from zmq.auth.thread import ThreadAuthenticator

__all__ = ["ClusterAuthenticator"]

log = logging.getLogger(__name__)


class ClusterAuthenticator(ThreadAuthenticator):
    """Admits the client keys in ``allowed``; logs each refused one with the peer's IP.

    ``endpoint``: the address of the socket it guards (set once bound), named in the log line.
    """

    def __init__(self, ctx: Any, allowed: frozenset[bytes]) -> None:
        super().__init__(ctx)
        self.allowed = allowed
        self.endpoint = "?"
        self._peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # Request frames: version, request id, domain, address (the peer's IP), identity, mechanism, credentials.
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """The CURVE credentials check (pyzmq's ``credentials_provider`` protocol)."""
        if key in self.allowed:
            return True
        log.warning("zmq endpoint %s refused a peer at %s: its client key is not the cluster's (both sides need "
                    "the same keys: transport.keys, digenrl worker --keys)", self.endpoint, self._peer)
        return False
