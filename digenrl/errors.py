"""The error taxonomy of digenrl, in one place at the bottom of the layer stack.

Every layer raises these (and only these, plus the builtin ``ValueError``/``TypeError`` for plain
programming errors), so a user can catch one name whatever transport or role raised it.
"""

from __future__ import annotations

__all__ = [
    "DigenrlError",
    "ProtocolError",
    "TransportClosed",
    "TransportBroken",
    "KeysRefused",
    "ActorDied",
    "RemoteError",
    "StalenessViolation",
    "ConfigError",
    "ActorNotAllowed",
    "JoinRefused",
]


class DigenrlError(Exception):
    """Base class of every error digenrl raises on purpose."""


class ProtocolError(DigenrlError):
    """A message on the wire is malformed, truncated, oversized or of another protocol version.

    ``reason`` is a short word for counting drops by kind: ``garbage`` (not a digenrl envelope),
    ``version``, ``oversized``, ``header`` (a valid envelope with a bad actor-protocol header), or
    ``malformed`` when nothing more specific applies.
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class TransportClosed(DigenrlError):
    """This endpoint was closed locally; nothing more can be sent or received on it."""


class TransportBroken(DigenrlError):
    """The peer went away (died, or the link failed) while a send or receive was pending."""


class KeysRefused(TransportBroken):
    """The peer refused this endpoint's CURVE keys (none, or another cluster's): trying again cannot help."""


class ActorDied(DigenrlError):
    """An actor is gone for good: its dead sentinel was seen or its heartbeats stopped."""

    def __init__(self, actor: str, reason: str) -> None:
        super().__init__(f"actor {actor!r} died: {reason}")
        self.actor = actor
        self.reason = reason


class RemoteError(DigenrlError):
    """An endpoint raised on the remote side; ``remote_traceback`` holds its traceback as text.

    Remote exceptions are never re-created from the wire (that would need unpickling); the
    exception's type name, message and formatted traceback travel as strings.
    """

    def __init__(self, where: str, exc_type: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{where} raised {exc_type}: {message}\n--- remote traceback ---\n{remote_traceback}")
        self.where = where
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback


class StalenessViolation(DigenrlError):
    """A sample would be trained with more staleness than configured. This is a bug: fail loudly."""


class ConfigError(DigenrlError):
    """A configuration key or value is invalid; the message names the key and the allowed values."""


class ActorNotAllowed(DigenrlError):
    """A worker was asked to host an actor class that is not on its allow-list (the message says how to add it)."""


class JoinRefused(DigenrlError):
    """A running system turned down a worker that asked to join (the message says why and what to change)."""
