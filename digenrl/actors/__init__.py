"""The actor runtime (generic: it never imports the RL roles).

Public API::

    from digenrl.actors import Actor, ActorRef, ActorSystem, broadcast, endpoint

See :mod:`digenrl.actors.base` for actors and endpoints, :mod:`digenrl.actors.system` for
spawning, supervision and shutdown, :mod:`digenrl.actors.worker` for ``digenrl worker --join`` and
:mod:`digenrl.actors.allowlist` for the classes a worker agrees to host.
"""

from __future__ import annotations

from digenrl.actors._context import dropped_counts
from digenrl.actors.allowlist import AllowList, register_actor_class
from digenrl.actors.base import Actor, ActorRef, BoundEndpoint, Endpoint, broadcast, endpoint
from digenrl.actors.system import ActorSystem, Worker
from digenrl.errors import ActorDied, ActorNotAllowed, RemoteError

__all__ = [
    "Actor",
    "ActorDied",
    "ActorNotAllowed",
    "AllowList",
    "ActorRef",
    "ActorSystem",
    "BoundEndpoint",
    "Endpoint",
    "RemoteError",
    "Worker",
    "broadcast",
    "dropped_counts",
    "endpoint",
    "register_actor_class",
]
