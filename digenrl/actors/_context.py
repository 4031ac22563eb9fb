"""What refs and hosted actors need from the node they live on, and which node the current code uses.

The runtime's rooms stack without a loop: ``base`` (the user API: actors, endpoints, refs) →
``_mailbox`` (one hosted actor) → ``_node`` (a transport endpoint hosting actors and routing
messages) → ``system`` / ``worker``. Refs and hosts reach their node only through the small
:class:`NodeLink` protocol below, which ``_node.Node`` implements, so the lower rooms never import
the higher ones.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["NodeLink", "current_node", "dropped_counts"]


class NodeLink(Protocol):
    """The node as seen by an ``ActorRef`` (send calls) and an ``ActorHost`` (send replies)."""

    address: str
    hosts: dict[str, Any]

    @property
    def closed(self) -> bool: ...

    def call(self, ref: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Queue a call to ``ref.method`` and return the future of its reply."""
        ...

    def tell(self, ref: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Queue a one-way call to ``ref.method``."""
        ...

    def reply(self, dst: str, call_id: int, result: Any, on_error: Callable[[BaseException], None]) -> None:
        """Queue the ``ok`` reply of call ``call_id``."""
        ...

    def reply_error(self, dst: str, call_id: int, where: str, exc: BaseException) -> None:
        """Queue the ``err`` reply of call ``call_id``."""
        ...


#: The node that refs created or decoded in this context send through.
current_node: contextvars.ContextVar[NodeLink | None] = contextvars.ContextVar("digenrl_node", default=None)


def dropped_counts() -> dict[str, dict[str, int]]:
    """The current node's dropped-input counters, keyed by its address (``{}`` outside a node).

    ``{address: {"dropped": n, "dropped/<reason>": k, ...}}``, cumulative: an actor returns them
    with its results so a driver can add up every endpoint's drops without a call of its own
    (several actors of one node report the same address, so nothing counts twice).
    """
    node = current_node.get()
    stats = getattr(getattr(node, "transport", None), "stats", None)
    if node is None or stats is None:
        return {}
    return {node.address: {k: v for k, v in stats.items() if k.startswith("dropped")}}
