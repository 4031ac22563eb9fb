"""The user-facing actor API: ``Actor``, ``@endpoint``, ``ActorRef`` and ``broadcast``.

An actor is an object whose ``@endpoint`` methods are called by message. Subclass ``Actor``, do
cheap work in ``__init__`` and heavy work in ``async setup()``, and mark the methods peers may call::

    class Counter(Actor):
        async def setup(self) -> None:
            self.n = 0

        @endpoint
        async def add(self, k: int) -> int:
            self.n += k
            return self.n

Endpoint kinds (all go through the actor's one FIFO mailbox unless marked ``control``):
  * ``@endpoint`` on an ``async def``: runs on the actor's event loop, one message at a time.
  * ``@endpoint(compute=True)`` on a plain ``def``: runs in the actor's own worker thread, so the
    event loop stays free for heartbeats and control endpoints while it computes. One thread per
    actor keeps thread-local state (torch grad mode, CUDA device) stable across calls.
  * ``@endpoint(control=True)``: bypasses the mailbox and runs on the event loop as soon as it
    arrives, even while a compute endpoint runs. Keep it short (set a flag, stage weights).

A spawned actor is reached through an ``ActorRef``. ``ActorSystem.spawn`` returns the ref *typed as
the actor class* (as Monarch does), so ``ref.add.call(2)`` is checked against ``add``'s signature
and its result type flows to the caller; at run time ``ref.add`` is a remote endpoint handle.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from digenrl.actors._context import NodeLink, current_node

__all__ = ["Actor", "ActorRef", "BoundEndpoint", "Endpoint", "broadcast", "endpoint"]

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A", bound="Actor")

# ActorRef attributes an endpoint name may not shadow (``ref.call`` must stay the ref's method).
_RESERVED = frozenset({"call", "tell", "name", "address", "ref", "to_dict", "from_dict", "bind", "actor_class"})


class BoundEndpoint(Protocol[P, R]):
    """What ``ref.method`` (or ``self.method`` inside the actor) gives you: the call adverbs."""

    def call(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
        """Send the call and return a future of its result (already sent, awaitable).

        Raises (from the future):
            RemoteError: the endpoint raised; carries the remote traceback.
            ActorDied: the actor's process died or stopped answering heartbeats.
        """
        ...

    def tell(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send the call without waiting for, or receiving, a reply (errors are logged remotely)."""
        ...


class Endpoint(Generic[P, R]):
    """A method of an ``Actor`` that peers may call; created by ``@endpoint``.

    Accessed on the class it is this descriptor (pass it to ``broadcast``); accessed on an actor
    instance it is a local ``BoundEndpoint`` (calls run directly, bypassing the mailbox).
    """

    def __init__(self, fn: Callable[..., Any], *, compute: bool = False, control: bool = False) -> None:
        is_async = inspect.iscoroutinefunction(fn)
        if compute and is_async:
            raise TypeError(
                f"@endpoint(compute=True) needs a plain `def` (it runs in a worker thread), "
                f"but {fn.__qualname__} is `async def`"
            )
        if compute and control:
            raise TypeError(f"{fn.__qualname__}: an endpoint is either compute=True or control=True, not both")
        self.fn = fn
        self.name: str = fn.__name__
        self.compute = compute
        self.control = control
        self.is_async = is_async
        self.signature = inspect.signature(fn)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> BoundEndpoint[P, R]: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return _LocalEndpoint(self, obj)

    def check_args(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise ``TypeError`` naming this endpoint when ``args``/``kwargs`` do not fit its signature."""
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None

    async def invoke(self, actor: object, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run the endpoint body on the calling task (non-compute endpoints only)."""
        out = self.fn(actor, *args, **kwargs)
        return await out if self.is_async else out

    def __repr__(self) -> str:
        kind = "compute" if self.compute else "control" if self.control else "async" if self.is_async else "sync"
        return f"<endpoint {self.fn.__qualname__} ({kind})>"


class _LocalEndpoint(Generic[P, R]):
    """``self.method`` inside an actor: runs the body directly, without the mailbox."""

    __slots__ = ("_ep", "_obj")

    def __init__(self, ep: Endpoint[P, R], obj: object) -> None:
        self._ep, self._obj = ep, obj

    def call(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
        self._ep.check_args(args, kwargs)
        if self._ep.compute and isinstance(self._obj, Actor):
            return asyncio.ensure_future(self._obj.in_thread(self._ep.fn, self._obj, *args, **kwargs))
        return asyncio.ensure_future(self._ep.invoke(self._obj, args, kwargs))

    def tell(self, *args: P.args, **kwargs: P.kwargs) -> None:
        fut = self.call(*args, **kwargs)
        fut.add_done_callback(_log_tell_failure)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._ep.fn(self._obj, *args, **kwargs)


def _log_tell_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        import logging

        logging.getLogger(__name__).warning("tell() failed: %s", fut.exception())


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]], /) -> Endpoint[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R], /) -> Endpoint[P, R]: ...
@overload
def endpoint(
    *, compute: bool = False, control: bool = False
) -> _EndpointDecorator: ...
def endpoint(fn: Callable[..., Any] | None = None, /, *, compute: bool = False, control: bool = False) -> Any:
    """Mark an ``Actor`` method as callable by message.

    Args:
        fn: the method (when used bare, ``@endpoint``).
        compute: run this plain ``def`` in the actor's worker thread, off the event loop.
        control: run on arrival, bypassing the FIFO mailbox (short handlers only).

    Raises:
        TypeError: ``compute=True`` on an ``async def``, or both flags set.
    """
    if fn is not None:
        return Endpoint(fn)
    return _EndpointDecorator(compute=compute, control=control)


class _EndpointDecorator:
    __slots__ = ("compute", "control")

    def __init__(self, *, compute: bool, control: bool) -> None:
        self.compute, self.control = compute, control

    @overload
    def __call__(self, fn: Callable[Concatenate[Any, P], Awaitable[R]], /) -> Endpoint[P, R]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[Any, P], R], /) -> Endpoint[P, R]: ...
    def __call__(self, fn: Callable[..., Any], /) -> Any:
        return Endpoint(fn, compute=self.compute, control=self.control)


class Actor:
    """Base class of every actor.

    Lifecycle: ``__init__`` (cheap, with the spawn arguments) → ``await setup()`` (heavy init;
    an exception here reaches the spawner as ``RemoteError``) → endpoint calls in FIFO order →
    ``await __cleanup__(exc)`` once at the end (``exc`` is the error that ended the actor, or
    ``None`` on a graceful stop; it also runs after a failed ``setup``).
    """

    endpoints: ClassVar[dict[str, Endpoint[..., Any]]] = {}
    _digenrl_ref: ActorRef[Any] | None = None
    _digenrl_thread: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None  # set by the host

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, Endpoint[..., Any]] = {}
        for klass in reversed(cls.__mro__):
            for key, value in vars(klass).items():
                if isinstance(value, Endpoint):
                    found[key] = value
                elif key in found:  # overridden by a non-endpoint attribute
                    del found[key]
        clash = sorted(set(found) & _RESERVED)
        if clash:
            raise TypeError(
                f"{cls.__qualname__}: endpoint name(s) {clash} clash with ActorRef attributes; rename them"
            )
        cls.endpoints = found

    async def setup(self) -> None:
        """Heavy initialisation (load models, open files). Runs once before the first call."""

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Release what ``setup`` acquired. Runs once, also after a failed ``setup``."""

    async def in_thread(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn(*args, **kwargs)`` in this actor's worker thread (the one compute endpoints use).

        For an ``async`` endpoint that interleaves awaits (fetching inputs, calling peers) with
        heavy steps: the heavy steps run off the event loop, always on the same thread, so torch's
        thread-local state stays put. Outside a host (plain unit tests) it uses ``asyncio.to_thread``.
        """
        call = functools.partial(fn, *args, **kwargs)
        if self._digenrl_thread is None:
            return await asyncio.to_thread(call)
        return await self._digenrl_thread(call)  # type: ignore[no-any-return]

    @property
    def ref(self) -> ActorRef[Self]:
        """This actor's own ref, to hand to peers (available from ``setup`` on).

        Raises:
            RuntimeError: the actor is not hosted yet (e.g. inside ``__init__``).
        """
        if self._digenrl_ref is None:
            raise RuntimeError(f"{type(self).__qualname__} is not hosted yet; self.ref is available from setup() on")
        return self._digenrl_ref


class ActorRef(Generic[A]):
    """A serialisable handle to an actor: its name and the transport address of its node.

    ``ref.<endpoint>.call(...)``/``.tell(...)`` send to the actor; ``ref.call("name", ...)`` is the
    untyped form. A ref travels inside call arguments and results (it is encoded as a small dict and
    rebound to the receiving node), and ``to_dict``/``from_dict`` give the same form explicitly.
    """

    __slots__ = ("name", "address", "actor_class", "_node")

    def __init__(self, name: str, address: str, *, actor_class: type[A] | None = None, node: NodeLink | None = None) -> None:
        self.name = name
        self.address = address
        self.actor_class = actor_class
        self._node = node

    # -- adverbs ---------------------------------------------------------------------------
    def call(self, method: str, /, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Call endpoint ``method`` and return a future of its result (the message is already queued).

        Arguments are encoded when the node's sender takes the message, an instant later, and
        tensors are sent zero-copy: do not modify argument tensors in place before the reply
        arrives (for ``tell``, pass tensors you will not modify, or a clone). In-process actors
        receive the very objects passed, without a copy.

        Raises:
            AttributeError: the actor class is known and has no such endpoint.
            RuntimeError: no ActorSystem or worker node is running in this context.
        """
        self._check_method(method)
        return self._bound_node().call(self, method, args, kwargs)

    def tell(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        """Send a one-way call to ``method`` (no reply; a remote error is logged by the actor).

        Raises:
            AttributeError: the actor class is known and has no such endpoint.
            RuntimeError: no ActorSystem or worker node is running in this context.
            ActorDied: the actor is already known to be dead.
        """
        self._check_method(method)
        self._bound_node().tell(self, method, args, kwargs)

    def __getattr__(self, method: str) -> BoundEndpoint[..., Any]:
        if method.startswith("__"):
            raise AttributeError(method)
        self._check_method(method, AttributeError)
        return _RemoteEndpoint(self, method)

    @property
    def ref(self) -> ActorRef[A]:
        """The ref itself (so ``x.ref`` works whether ``x`` is an actor or a ref to one)."""
        return self

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, str]:
        """The msgpack-able form ``{"name": ..., "address": ...}``."""
        return {"name": self.name, "address": self.address}

    @classmethod
    def from_dict(cls, data: object, *, node: NodeLink | None = None) -> ActorRef[Any]:
        """Rebuild a ref from ``to_dict()`` output.

        Raises:
            ValueError: ``data`` is not a dict with string ``name`` and ``address`` (names the field).
        """
        if not isinstance(data, dict):
            raise ValueError(f"actor ref must be a dict with 'name' and 'address', got {type(data).__name__}")
        for key in ("name", "address"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ValueError(f"actor ref field {key!r} must be a non-empty string, got {data.get(key)!r}")
        return cls(data["name"], data["address"], node=node)

    def bind(self, node: NodeLink) -> ActorRef[A]:
        """A copy of this ref that sends through ``node``."""
        return ActorRef(self.name, self.address, actor_class=self.actor_class, node=node)

    # -- plumbing --------------------------------------------------------------------------
    def _check_method(self, method: str, exc: type[Exception] = AttributeError) -> None:
        if self.actor_class is not None and method not in self.actor_class.endpoints:
            known = ", ".join(sorted(self.actor_class.endpoints)) or "none"
            raise exc(f"{self.actor_class.__qualname__} has no endpoint {method!r} (endpoints: {known})")

    def _bound_node(self) -> NodeLink:
        node = self._node if self._node is not None and not self._node.closed else current_node.get()
        if node is None or node.closed:
            raise RuntimeError(
                f"cannot reach actor {self.name!r}: no running ActorSystem or worker node in this context "
                "(use the ref inside `async with ActorSystem()` or inside an actor)"
            )
        return node

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and (self.name, self.address) == (other.name, other.address)

    def __hash__(self) -> int:
        return hash((self.name, self.address))

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r} @ {self.address})"


class _RemoteEndpoint:
    """``ref.method``: the adverbs for one endpoint of a remote (or in-process) actor."""

    __slots__ = ("_ref", "_method")

    def __init__(self, ref: ActorRef[Any], method: str) -> None:
        self._ref, self._method = ref, method

    def call(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self._ref.call(self._method, *args, **kwargs)

    def tell(self, *args: Any, **kwargs: Any) -> None:
        self._ref.tell(self._method, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<endpoint {self._method} of {self._ref!r}>"


@overload
async def broadcast(refs: Iterable[Any], method: Endpoint[P, R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]: ...
@overload
async def broadcast(refs: Iterable[Any], method: str, /, *args: Any, **kwargs: Any) -> list[Any]: ...
async def broadcast(refs: Iterable[Any], method: Endpoint[..., Any] | str, /, *args: Any, **kwargs: Any) -> list[Any]:
    """Call ``method`` on every ref with the same arguments; return the results in ref order.

    All calls are sent before any reply is awaited, so the actors work concurrently.
    ``method`` is an endpoint name or the class attribute (``Counter.add``, which types the result).

    Raises:
        RemoteError | ActorDied: the first failure in ref order, after every call has finished
            (the other failures are attached as notes).
    """
    name = method if isinstance(method, str) else method.name
    futures = [ActorRef.call(r.ref, name, *args, **kwargs) for r in refs]
    results = await asyncio.gather(*futures, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also failed: {other!r}")
        raise first
    return list(results)


# -- refs inside payloads ------------------------------------------------------------------------
_REF_KEY = "__digenrl_ref__"


def encode_refs(obj: Any) -> Any:
    """Replace every ``ActorRef`` inside lists/tuples/dicts by its marker dict (for the wire)."""
    if isinstance(obj, ActorRef):
        return {_REF_KEY: obj.to_dict()}
    if isinstance(obj, Actor):
        return {_REF_KEY: obj.ref.to_dict()}
    if isinstance(obj, dict):
        return {k: encode_refs(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_refs(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(encode_refs(v) for v in obj)
    return obj


def decode_refs(obj: Any, node: NodeLink) -> Any:
    """Turn marker dicts back into ``ActorRef``s bound to ``node``.

    Raises:
        ValueError: a marker dict is malformed (names the field).
    """
    if isinstance(obj, dict):
        if len(obj) == 1 and _REF_KEY in obj:
            return ActorRef.from_dict(obj[_REF_KEY], node=node)
        return {k: decode_refs(v, node) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_refs(v, node) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode_refs(v, node) for v in obj)
    return obj
