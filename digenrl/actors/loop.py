"""The event loop every digenrl process runs on: uvloop when installed, else asyncio's own.

One entry point, :func:`run`, used by the driver (recipes, cli), every actor process
(``digenrl.actors._child``) and ``digenrl worker``: ``run(main(), "uvloop")`` is
``asyncio.run(main())`` on a uvloop loop. The name comes from ``runtime.event_loop`` in the run
config; an actor process gets its driver's choice on its command line (``--event-loop``).

Why uvloop: the header round trip between two actor processes is mostly event-loop work (a
reader callback, a future, a task wake-up per message), which uvloop does in C.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EVENT_LOOPS", "resolve_event_loop", "run", "running_loop_name"]

log = logging.getLogger(__name__)

T = TypeVar("T")

EVENT_LOOPS = ("uvloop", "asyncio")
_warned = False


def resolve_event_loop(name: str | None = None) -> str:
    """The loop that will really run for ``name`` (None: the default, uvloop when installed).

    ``"uvloop"`` on a machine without it falls back to ``"asyncio"`` with one info line.

    Raises:
        ValueError: ``name`` is not one of ``EVENT_LOOPS``.
    """
    global _warned
    name = name or "uvloop"
    if name not in EVENT_LOOPS:
        raise ValueError(f"event loop {name!r} is not one of {', '.join(EVENT_LOOPS)}")
    if name == "uvloop" and importlib.util.find_spec("uvloop") is None:
        if not _warned:
            log.info("uvloop is not installed; running on the asyncio event loop (pip install uvloop)")
            _warned = True
        return "asyncio"
    return name


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None  # asyncio.Runner's default


def run(main: Coroutine[Any, Any, T], event_loop: str | None = None, *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh loop of kind ``event_loop`` and close it (``asyncio.run``).

    Raises:
        ValueError: unknown ``event_loop`` (``main`` is closed, never started).
        BaseException: whatever ``main`` raised.
    """
    try:
        name = resolve_event_loop(event_loop)
    except ValueError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=_loop_factory(name), debug=debug) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the kind of the loop running now (for logs and reports)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
