"""Which actor classes a worker process will import and construct when the system asks.

``spawn_actor`` names a class by import path (``module:Qualname``); importing it runs that module's
code, so a worker takes only classes on its :class:`AllowList`:

* a process ``ActorSystem.spawn(process=True)`` launches allows exactly the class it was launched for;
* ``digenrl worker --join`` allows digenrl's roles, the classes given with ``--allow module:Class``
  and those its program registered with :func:`register_actor_class`.

The check happens on the path, before anything is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from digenrl.errors import ActorNotAllowed

__all__ = ["AllowList", "register_actor_class", "registered", "class_path"]

_REGISTERED: set[str] = set()


def class_path(cls: type) -> str:
    """``module:Qualname`` of ``cls``, the form allow-lists hold."""
    return f"{cls.__module__}:{cls.__qualname__}"


def register_actor_class(cls: type) -> type:
    """Let workers of this program host ``cls`` (usable as a class decorator); returns ``cls``."""
    _REGISTERED.add(class_path(cls))
    return cls


def registered() -> frozenset[str]:
    """The class paths registered in this process so far."""
    return frozenset(_REGISTERED)


class AllowList:
    """A set of ``module:Qualname`` paths; ``check`` refuses any other class."""

    def __init__(self, paths: Iterable[str | type] = ()) -> None:
        self.paths: set[str] = set()
        for p in paths:
            self.add(p)

    def add(self, entry: str | type) -> None:
        """Allow ``entry`` (a class or ``module:Qualname``).

        Raises:
            ValueError: a string that is not ``module:Qualname``.
        """
        path = entry if isinstance(entry, str) else class_path(entry)
        mod, _, qual = path.partition(":")
        if not mod or not qual:
            raise ValueError(f"allowed actor class {path!r} must be written module:Class (e.g. mypkg.actors:Greeter)")
        self.paths.add(path)

    def check(self, spec: Any, worker: str) -> None:
        """Refuse the class named by ``spec`` (``{"mod", "qual"}``) unless it is allowed.

        Raises:
            ActorNotAllowed: naming the class and how to allow it.
        """
        path = f"{spec.get('mod')}:{spec.get('qual')}" if isinstance(spec, dict) else repr(spec)
        if path in self.paths or path in _REGISTERED:
            return
        raise ActorNotAllowed(
            f"worker {worker} does not host actor class {path}: it is not on the worker's allow-list "
            f"(allowed: {', '.join(sorted(self.paths | _REGISTERED)) or 'none'}); start the worker with "
            f"`digenrl worker --allow {path}` or call digenrl.actors.register_actor_class(<class>) in the "
            "worker's program")
