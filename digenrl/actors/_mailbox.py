"""One hosted actor: its FIFO mailbox, its compute thread and its lifecycle.

State machine::

    STARTING --setup ok--> RUNNING --stop()--> DRAINING --mailbox empty / deadline--> CLOSED
        \\--setup raised--> CLOSED (``__cleanup__(exc)`` ran, the error goes to the spawner)

* Calls that arrive while STARTING (control calls too) wait until ``setup`` succeeded, or are
  answered with an error if it failed.
* RUNNING: one consumer task takes messages in arrival order and runs them one at a time, so an
  endpoint sees the actor's state exactly as the previous message left it. ``compute`` endpoints
  run in the actor's single worker thread while the consumer awaits them, which keeps the event
  loop free: ``control`` endpoints (run on arrival, outside the mailbox) and heartbeats are
  served during long compute.
* DRAINING: calls already queued still run, new ones are rejected with an explicit error, until
  the deadline; then the consumer is cancelled. ``__cleanup__(exc)`` runs once, shielded, on what
  is left of the deadline, and the worker thread is released.

Cancellation: a caller that cancels its call sends ``cancel``; a queued call is skipped and a
running ``async`` one is cancelled (a running compute call cannot be interrupted; its result is
dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from digenrl.actors._context import NodeLink
from digenrl.actors.base import Actor, ActorRef, Endpoint

__all__ = ["ActorHost", "State"]

log = logging.getLogger(__name__)


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class ActorDraining(RuntimeError):
    """A call reached an actor that is shutting down (sent to the caller as a ``RemoteError``)."""


@dataclass(slots=True, eq=False)
class _Request:
    src: str
    call_id: int | None
    method: str
    endpoint: Endpoint[..., Any]
    args: Any
    kwargs: dict[str, Any]
    cancelled: bool = False
    task: asyncio.Task[None] | None = field(default=None)


class ActorHost:
    """Runs one actor on a node. Created by ``Node.host``; see the module docstring."""

    def __init__(self, node: NodeLink, name: str, actor: Actor) -> None:
        self.node = node
        self.name = name
        self.actor = actor
        self.state = State.STARTING
        self.ref: ActorRef[Any] = ActorRef(name, node.address, actor_class=type(actor), node=node)
        actor._digenrl_ref = self.ref
        actor._digenrl_thread = self.run_in_thread
        self._mailbox: asyncio.Queue[_Request | None] = asyncio.Queue()
        self._inflight: dict[tuple[str, int], _Request] = {}
        self._control: set[asyncio.Task[None]] = set()
        self._early_control: list[_Request] = []
        self._consumer: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cleaned = False
        self.trusted_only = False
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Run ``setup`` and start the mailbox; on failure run ``__cleanup__(exc)`` and re-raise."""
        try:
            await self.actor.setup()
        except BaseException as exc:
            self.state = State.CLOSED
            self.error = exc
            self._reject_queued(exc)
            await self._cleanup(exc, timeout=10.0)
            raise
        self.state = State.RUNNING
        self._consumer = asyncio.create_task(self._consume(), name=f"digenrl-actor-{self.name}")
        early, self._early_control = self._early_control, []
        for req in early:
            self._start_control(req)

    async def stop(self, timeout: float, exc: BaseException | None = None) -> None:
        """Drain the mailbox for up to ``timeout`` seconds, then close and run ``__cleanup__``.

        Runs to the end even if the caller is cancelled meanwhile (the cancellation is re-raised after).
        """
        if self.state is State.CLOSED:
            return
        task = asyncio.ensure_future(self._stop(timeout, exc))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise

    async def _stop(self, timeout: float, exc: BaseException | None) -> None:
        end = time.monotonic() + timeout
        queued = self._mailbox.qsize()
        level = logging.DEBUG if self.name.startswith("_") else logging.INFO  # built-in actors are noise
        log.log(level, "[shutdown] Actor %s: step=drain queued=%d deadline=%.1fs", self.name, queued, timeout)
        self.state = State.DRAINING
        if self._consumer is not None:
            self._mailbox.put_nowait(None)  # the consumer stops when it reaches this
            done, _ = await asyncio.wait({self._consumer}, timeout=max(0.0, end - time.monotonic()))
            if not done:
                log.warning("[shutdown] Actor %s: step=abort reason=drain-deadline left=%d", self.name, self._mailbox.qsize())
                self._consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._consumer
        for task in list(self._control):
            task.cancel()
        if self._control:
            await asyncio.wait(self._control, timeout=max(0.0, end - time.monotonic()) or 0.01)
        self._reject_queued(ActorDraining(f"actor {self.name!r} stopped before running this call"))
        await self._cleanup(exc, timeout=max(0.1, end - time.monotonic()))
        self.state = State.CLOSED
        self.node.hosts.pop(self.name, None)
        log.log(level, "[shutdown] Actor %s: step=closed", self.name)

    async def _cleanup(self, exc: BaseException | None, timeout: float) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        try:
            await asyncio.wait_for(self.actor.__cleanup__(exc), timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("actor %s: __cleanup__ failed", self.name)
        finally:
            if self._executor is not None:
                # A compute call still running cannot be interrupted; do not wait for it.
                self._executor.shutdown(wait=False, cancel_futures=True)

    # -- messages --------------------------------------------------------------------------------
    def deliver(self, src: str, call_id: int | None, method: str, args: Any, kwargs: dict[str, Any]) -> None:
        """Accept one call from the node's router (never blocks)."""
        where = f"{self.name}.{method}"
        ep = type(self.actor).endpoints.get(method)
        if ep is None:
            known = ", ".join(sorted(type(self.actor).endpoints)) or "none"
            self._fail(src, call_id, where, AttributeError(
                f"actor {self.name!r} ({type(self.actor).__qualname__}) has no endpoint {method!r}; endpoints: {known}"
            ))
            return
        if self.state in (State.DRAINING, State.CLOSED):
            self._fail(src, call_id, where, ActorDraining(f"actor {self.name!r} is shutting down; call to {method!r} rejected"))
            return
        try:
            ep.check_args(args, kwargs)
        except TypeError as exc:
            self._fail(src, call_id, where, exc)
            return
        req = _Request(src, call_id, method, ep, args, kwargs)
        if call_id is not None:
            self._inflight[(src, call_id)] = req
        if not ep.control:
            self._mailbox.put_nowait(req)
        elif self.state is State.STARTING:  # control code may rely on what setup builds
            self._early_control.append(req)
        else:
            self._start_control(req)

    def _start_control(self, req: _Request) -> None:
        task = asyncio.create_task(self._execute(req), name=f"digenrl-control-{self.name}.{req.method}")
        self._control.add(task)
        task.add_done_callback(self._control.discard)

    def cancel(self, src: str, call_id: int) -> None:
        """The caller gave up on call ``call_id``: skip it if queued, cancel it if running async."""
        req = self._inflight.get((src, call_id))
        if req is None:
            return
        req.cancelled = True
        if req.task is not None and not req.endpoint.compute:
            req.task.cancel()

    async def _consume(self) -> None:
        while True:
            req = await self._mailbox.get()
            if req is None:
                return
            if req.cancelled:
                self._forget(req)
                continue
            req.task = asyncio.create_task(self._execute(req), name=f"digenrl-call-{self.name}.{req.method}")
            # asyncio.wait, not await: a cancelled call must not cancel the consumer itself.
            try:
                await asyncio.wait({req.task})
            except asyncio.CancelledError:  # the drain deadline passed: abort the call too
                req.task.cancel()
                await asyncio.wait({req.task})
                raise

    async def _execute(self, req: _Request) -> None:
        where = f"{self.name}.{req.method}"
        try:
            if req.endpoint.compute:
                result = await self._run_compute(req)
            else:
                result = await req.endpoint.invoke(self.actor, req.args, req.kwargs)
        except asyncio.CancelledError:
            if not req.cancelled:
                if self.state is State.DRAINING:  # the drain deadline passed: tell the caller
                    self._fail(req.src, req.call_id, where, ActorDraining(
                        f"actor {self.name!r} shut down (drain deadline) before {req.method!r} finished"))
                raise
            log.info("actor %s: call %s cancelled by its caller", self.name, where)
        except Exception as exc:
            self._fail(req.src, req.call_id, where, exc)
        else:
            if req.call_id is not None and not req.cancelled:
                on_error = functools.partial(self._reply_unsendable, req, where)
                self.node.reply(req.src, req.call_id, result, on_error)
        finally:
            self._forget(req)

    async def _run_compute(self, req: _Request) -> Any:
        return await self.run_in_thread(functools.partial(req.endpoint.fn, self.actor, *req.args, **req.kwargs))

    async def run_in_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in this actor's single worker thread (created on first use).

        Raises:
            RuntimeError: the actor is closed (its thread is gone).
        """
        if self._cleaned:
            raise RuntimeError(f"actor {self.name!r} is closed; its worker thread is gone")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"digenrl-{self.name}")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _reply_unsendable(self, req: _Request, where: str, exc: BaseException) -> None:
        # The result could not be encoded (e.g. an unsupported type): tell the caller why.
        if req.call_id is not None:
            self.node.reply_error(req.src, req.call_id, where, TypeError(f"result of {where} could not be sent: {exc}"))

    def _fail(self, src: str, call_id: int | None, where: str, exc: BaseException) -> None:
        if call_id is not None:
            self.node.reply_error(src, call_id, where, exc)
        else:
            log.warning("actor %s: one-way call %s failed", self.name, where, exc_info=exc)

    def _forget(self, req: _Request) -> None:
        if req.call_id is not None:
            self._inflight.pop((req.src, req.call_id), None)

    def _reject_queued(self, exc: BaseException) -> None:
        early, self._early_control = self._early_control, []
        for req in early:
            self._fail(req.src, req.call_id, f"{self.name}.{req.method}", exc)
            self._forget(req)
        while not self._mailbox.empty():
            queued = self._mailbox.get_nowait()
            if queued is not None and not queued.cancelled:
                self._fail(queued.src, queued.call_id, f"{self.name}.{queued.method}", exc)
                self._forget(queued)
