"""The actor runtime (generic: it never imports the RL roles).

Public API::

    from digenrl.actors import Actor, ActorRef, ActorSystem, broadcast, endpoint

See :mod:`digenrl.actors.base` for actors and endpoints, :mod:`digenrl.actors.system` for
spawning, supervision and shutdown, and :mod:`digenrl.actors.worker` for ``digenrl worker --join``.
"""

from __future__ import annotations

from digenrl.actors.base import Actor, ActorRef, BoundEndpoint, Endpoint, broadcast, endpoint
from digenrl.actors.system import ActorSystem, Worker
from digenrl.errors import ActorDied, RemoteError

__all__ = [
    "Actor",
    "ActorDied",
    "ActorRef",
    "ActorSystem",
    "BoundEndpoint",
    "Endpoint",
    "RemoteError",
    "Worker",
    "broadcast",
    "endpoint",
]
