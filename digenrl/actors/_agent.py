"""The two built-in actors that let a system grow across processes and hosts.

* ``Registry`` (name ``_registry``) runs in the driver's ``ActorSystem``. A new process (a local
  actor process or a ``digenrl worker --join`` from another host) calls ``join`` on it to
  register its address; the system then supervises it (heartbeats, process sentinel).
* ``NodeAgent`` (name ``_agent``) runs in every worker process. The system calls
  ``spawn_actor`` to build and host an actor there, ``stop_actor`` and ``shutdown``. It answers
  only the system that the worker joined (``Node.trusted``), and only classes on its
  :class:`~digenrl.actors.allowlist.AllowList`, because ``spawn_actor`` imports code.

Actor classes travel by import path (``module:qualname``), never pickled. A class defined in the
script being run (``__main__``) travels with the script's path and is loaded in the worker as
module ``__digenrl_main__`` (as multiprocessing's spawn does with ``__mp_main__``), so guard
scripts with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from digenrl.actors.allowlist import AllowList
from digenrl.actors.base import Actor, endpoint

if TYPE_CHECKING:
    from digenrl.actors._node import Node

__all__ = ["NodeAgent", "Registry", "class_spec", "resolve_class"]

AGENT = "_agent"
REGISTRY = "_registry"


def class_spec(cls: type[Actor]) -> dict[str, str]:
    """The import path of ``cls`` as a msgpack-able dict.

    Raises:
        TypeError: ``cls`` is not an importable ``Actor`` subclass (local class, interactive session).
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn needs an Actor subclass, got {cls!r}")
    if "<locals>" in cls.__qualname__:
        raise TypeError(
            f"{cls.__qualname__} is defined inside a function; an actor that runs in another process "
            "must be a module-level class so the process can import it"
        )
    spec = {"mod": cls.__module__, "qual": cls.__qualname__}
    if cls.__module__ == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise TypeError(f"{cls.__qualname__} is defined in an interactive session; put it in a module or script")
        spec["file"] = os.path.abspath(path)
    return spec


def resolve_class(spec: Any) -> type[Actor]:
    """Import the class named by ``class_spec`` output.

    Raises:
        ValueError: the spec is malformed.
        ImportError | AttributeError: the module or class cannot be found here.
        TypeError: the named object is not an ``Actor`` subclass.
    """
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) for k in ("mod", "qual")):
        raise ValueError(f"class spec must be {{'mod': str, 'qual': str[, 'file': str]}}, got {spec!r:.200}")
    if spec["mod"] == "__main__":
        module = _load_main(spec.get("file"))
    else:
        module = importlib.import_module(spec["mod"])
    obj: Any = module
    for part in spec["qual"].split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{spec['mod']}:{spec['qual']} is not an Actor subclass")
    return obj


_MAIN = "__digenrl_main__"


def _load_main(path: Any) -> Any:
    module = sys.modules.get(_MAIN)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ImportError(f"the driver's script {path!r} is not readable on this host")
    if module is not None:
        raise ImportError(f"this worker already loaded the script {module.__file__!r}; cannot also load {path!r}")
    spec = importlib.util.spec_from_file_location(_MAIN, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the driver's script {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MAIN] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MAIN]
        raise
    return module


class Registry(Actor):
    """Where processes join a running system. ``on_join`` returns the settings the worker must use."""

    def __init__(self, on_join: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        self._on_join = on_join

    @endpoint(control=True)
    async def join(self, address: str, name: str, pid: int, host: str, token: str | None = None) -> dict[str, Any]:
        """Register a worker process reachable at ``address``.

        Raises:
            ValueError: a field has the wrong type.
        """
        if not (isinstance(address, str) and isinstance(name, str) and isinstance(pid, int) and isinstance(host, str)):
            raise ValueError("join needs address: str, name: str, pid: int, host: str")
        info = {"address": address, "name": name, "pid": pid, "host": host, "token": token}
        return await self._on_join(info)


class NodeAgent(Actor):
    """A worker process's agent: hosts actors on the system's behalf."""

    def __init__(self, node: Node, stop: asyncio.Event, allow: AllowList) -> None:
        self._node = node
        self._stop = stop
        self._allow = allow
        self.shutting_down = False  # the system asked us to go: silence from it is expected now

    @endpoint
    async def spawn_actor(self, spec: dict[str, Any], name: str, args: list[Any], kwargs: dict[str, Any]) -> int:
        """Import the class, construct it, run its ``setup`` and host it as ``name``; returns this pid.

        Raises:
            ActorNotAllowed: the class is not on this worker's allow-list (nothing was imported).
            Exception: whatever the import, the constructor or ``setup`` raised (its ``where`` names
                ``<name>.__init__()`` or ``<name>.setup()``).
        """
        self._allow.check(spec, self._node.name)
        cls = resolve_class(spec)
        try:
            actor = cls(*args, **kwargs)
        except Exception as exc:
            exc._digenrl_where = f"{name}.__init__()"  # type: ignore[attr-defined]
            raise
        try:
            await self._node.host(actor, name)
        except Exception as exc:
            exc._digenrl_where = f"{name}.setup()"  # type: ignore[attr-defined]
            raise
        return os.getpid()

    @endpoint(control=True)
    async def stop_actor(self, name: str, timeout: float) -> bool:
        """Drain and close actor ``name``; False when no such actor runs here."""
        host = self._node.hosts.get(name)
        if host is None or name == AGENT:
            return False
        await host.stop(timeout)
        return True

    @endpoint(control=True)
    async def shutdown(self, timeout: float) -> list[str]:
        """Drain and close every hosted actor, then let the worker process exit; returns their names."""
        self.shutting_down = True
        names = [n for n in self._node.hosts if n != AGENT]
        await asyncio.gather(*(self._node.hosts[n].stop(timeout) for n in names if n in self._node.hosts))
        asyncio.get_running_loop().call_soon(self._stop.set)  # after this reply is queued
        return names
