"""The runtime's message vocabulary on top of a transport, and its validation.

Every runtime message is one transport message whose header is a small map with a kind ``k``:

=========  ===========================================  ===================================
kind       header fields                                payload
=========  ===========================================  ===================================
``call``   ``i`` call id (int), ``to`` actor, ``m``     ``[args, kwargs]``
``tell``   ``to`` actor, ``m`` method                   ``[args, kwargs]``
``ok``     ``i`` call id                                the result
``err``    ``i``, ``w`` where, ``t`` type, ``e`` text,  none
           ``tb`` remote traceback
``cancel`` ``i`` call id, ``to`` actor                  none
``ping``   ``i`` sequence number                        none
``pong``   ``i`` sequence number                        none
``dead``   ``a`` address, ``why`` reason                none
=========  ===========================================  ===================================

Replies go to the transport-level sender address (``Message.src``). Anything that does not fit
this table is bad input: :func:`parse` raises ``ProtocolError`` naming the field.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from digenrl.errors import ProtocolError, RemoteError

__all__ = ["Parsed", "error_fields", "parse", "remote_error"]

_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "call": {"i": int, "to": str, "m": str},
    "tell": {"to": str, "m": str},
    "ok": {"i": int},
    "err": {"i": int, "w": str, "t": str, "e": str, "tb": str},
    "cancel": {"i": int, "to": str},
    "ping": {"i": int},
    "pong": {"i": int},
    "dead": {"a": str, "why": str},
}
_MAX_NAME = 256


@dataclass(slots=True)
class Parsed:
    """A validated runtime message."""

    kind: str
    header: dict[str, Any]
    args: tuple[Any, ...] | list[Any] = ()
    kwargs: dict[str, Any] | None = None


def parse(header: Any, payload: Any) -> Parsed:
    """Validate one received message against the table in the module docstring.

    Raises:
        ProtocolError: an unknown kind, a missing or mistyped field, or a malformed call payload;
            the message names the kind and the field.
    """
    if not isinstance(header, dict):
        raise ProtocolError(f"runtime header must be a map, got {type(header).__name__}")
    kind = header.get("k")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None or not isinstance(kind, str):
        raise ProtocolError(f"unknown runtime message kind {kind!r:.40}; expected one of {sorted(_FIELDS)}")
    for key, typ in fields.items():
        value = header.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ProtocolError(
                f"{kind} message field {key!r} must be {getattr(typ, '__name__', typ)}, got {type(value).__name__}"
            )
        if isinstance(value, str) and key in ("to", "m") and not 0 < len(value) <= _MAX_NAME:
            raise ProtocolError(f"{kind} message field {key!r} must be 1..{_MAX_NAME} characters long")
    if kind not in ("call", "tell"):
        return Parsed(kind, header)
    if not (isinstance(payload, (list, tuple)) and len(payload) == 2):
        raise ProtocolError(f"{kind} payload for {header['m']!r:.60} must be [args, kwargs], got {type(payload).__name__}")
    args, kwargs = payload
    if not isinstance(args, (list, tuple)):
        raise ProtocolError(f"{kind} args for {header['m']!r:.60} must be an array, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ProtocolError(f"{kind} kwargs for {header['m']!r:.60} must be a map with str keys")
    return Parsed(kind, header, args, kwargs)


def error_fields(where: str, exc: BaseException) -> dict[str, str]:
    """The ``err`` header fields for ``exc``: its type, message and traceback as text.

    The traceback is stringified here, at capture time, because exceptions never cross the wire.
    """
    where = getattr(exc, "_digenrl_where", where)  # set by the agent: "<actor>.setup()"
    typ = type(exc)
    name = typ.__qualname__ if typ.__module__ in ("builtins", "__main__") else f"{typ.__module__}.{typ.__qualname__}"
    if isinstance(exc, RemoteError):  # re-raised remote error: keep the original type and traceback
        return {"w": where, "t": exc.exc_type, "e": f"{exc.where}: {exc.message}", "tb": exc.remote_traceback}
    return {"w": where, "t": name, "e": str(exc), "tb": "".join(traceback.format_exception(exc))}


def remote_error(header: dict[str, Any]) -> RemoteError:
    """Rebuild the caller-side ``RemoteError`` from an ``err`` header."""
    return RemoteError(header["w"], header["t"], header["e"], header["tb"])
