"""Actors used by the runtime tests. Module-level and torch-free, so actor processes import them fast."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from digenrl.actors import Actor, ActorRef, endpoint


class Counter(Actor):
    """State that only FIFO, one-at-a-time processing keeps consistent."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.log: list[int] = []

    async def setup(self) -> None:
        self.n = self.start

    @endpoint
    async def add(self, k: int) -> int:
        # Yield between read and write: concurrent processing would lose updates.
        n = self.n
        await asyncio.sleep(0)
        self.n = n + k
        self.log.append(k)
        return self.n

    @endpoint
    async def history(self) -> list[int]:
        return list(self.log)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def getenv(self, key: str) -> str | None:
        return os.environ.get(key)

    @endpoint
    async def fail(self, message: str) -> None:
        _helper_that_raises(message)

    @endpoint
    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    @endpoint
    async def echo(self, value: Any) -> Any:
        return value

    @endpoint
    async def loop_kind(self) -> str:
        from digenrl.actors.loop import running_loop_name

        return running_loop_name()

    @endpoint
    async def call_peer(self, peer: ActorRef[Counter], k: int) -> int:
        """Call another actor through a ref that arrived inside this message."""
        return await peer.add.call(k)

    @endpoint
    async def me(self) -> ActorRef[Any]:
        return self.ref


def _helper_that_raises(message: str) -> None:
    raise ValueError(message)


class Cruncher(Actor):
    """A compute endpoint that blocks its worker thread until a control endpoint releases it.

    With ``marker``, ``__cleanup__`` records its call in that file (visible after the process is gone).
    """

    def __init__(self, marker: str | None = None) -> None:
        self.marker = marker

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self.marker is not None:
            with open(self.marker, "w") as f:
                f.write(f"cleanup exc={exc!r}")

    async def setup(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.controls = 0

    @endpoint(compute=True)
    def crunch(self, n: int, timeout: float = 30.0) -> int:
        self.started.set()
        if not self.release.wait(timeout):
            raise TimeoutError("never released")
        return n * 2

    @endpoint(compute=True)
    def busy(self, seconds: float) -> str:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # hold the thread (and, in turns, the GIL)
            sum(range(1000))
        return threading.current_thread().name

    @endpoint
    async def staged(self) -> list[str]:
        """An async endpoint that offloads its heavy part to the actor's worker thread."""
        first = await self.in_thread(lambda: threading.current_thread().name)
        await asyncio.sleep(0)
        second = await self.in_thread(lambda: threading.current_thread().name)
        return [first, second, threading.current_thread().name]

    @endpoint(control=True)
    async def poke(self) -> int:
        self.controls += 1
        self.release.set()
        return self.controls

    @endpoint(control=True)
    async def is_started(self) -> bool:
        return self.started.is_set()


class BadSetup(Actor):
    async def setup(self) -> None:
        _load_weights_that_are_missing()


def _load_weights_that_are_missing() -> None:
    raise FileNotFoundError("weights.safetensors not found")


class Lingers(Counter):
    """A Counter whose ``__cleanup__`` takes ``linger`` seconds: its process outlives the others' at shutdown."""

    def __init__(self, linger: float = 1.0) -> None:
        super().__init__()
        self.linger = linger
        self.dozing = False

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await asyncio.sleep(self.linger)

    @endpoint
    async def doze(self, seconds: float) -> str:
        self.dozing = True
        await asyncio.sleep(seconds)
        return "awake"

    @endpoint(control=True)
    async def is_dozing(self) -> bool:
        return self.dozing

    @endpoint
    async def ask_to_doze(self, peer: ActorRef[Lingers], seconds: float) -> str:
        """Call ``peer.doze``: a call of this actor's process pending on the peer's."""
        return await peer.doze.call(seconds)
