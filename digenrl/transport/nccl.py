"""The NCCL communicator: :class:`~digenrl.transport.communicator.Communicator` over ``cupy.cuda.nccl``.

No torch.distributed world and no environment variables: the root makes a unique id
(``cupy.cuda.nccl.get_unique_id()``, 128 bytes that hold its bootstrap address), the bytes ride in
the group spec over the actor control channel (msgpack keeps bytes as bytes), and each member calls
``NcclCommunicator(world, uid, rank)`` on its own device. A new generation is a new unique id.

Checked line by line against cupy's documented API (``cupy_backends/cuda/libs/nccl.pyx`` / ``.pxd``
of cupy 13 and the cupy 14 reference):

* ``get_unique_id()`` returns a tuple of 128 ints in cupy <= 13 (each a C ``char``: -128..127 where
  char is signed, x86-64; 0..255 where it is unsigned, aarch64 / ppc64le) and ``bytes`` from cupy
  14 ("Changed in version 14.0: Previously this returned a tuple of integers"). The constructor
  takes the same form back (``tuple commId`` copied into ``char internal[128]``, or ``bytes``).
  :func:`unique_id_bytes` / :func:`unique_id_arg` convert; both are tested here on the CPU.
* ``NcclCommunicator(int ndev, commId, int rank)`` is ``ncclCommInitRank``: it blocks until all
  ``ndev`` ranks joined and binds the *current* CUDA device, hence the ``cupy.cuda.Device`` scope.
* ``bcast(intptr_t buff, count, int datatype, int root, intptr_t stream)``,
  ``send(intptr_t sendbuf, size_t count, int datatype, int peer, intptr_t stream)`` and
  ``recv(intptr_t recvbuf, size_t count, int datatype, int peer, intptr_t stream)`` (NCCL >= 2.7)
  take raw pointers and a raw stream handle: ``tensor.data_ptr()`` and ``torch.cuda.Stream.cuda_stream``.
* ``groupStart()`` / ``groupEnd()`` fuse the calls of one operation (every bucket; send and recv
  need a group to avoid deadlocks between peers); ``check_async_error()`` raises ``NcclError`` (a
  ``RuntimeError``) when a peer failed; ``abort()`` / ``destroy()`` free the communicator.
* dtypes (``nccl.pxd``): NCCL_INT8 0, UINT8 1, INT32 2, UINT32 3, INT64 4, UINT64 5, FLOAT16 6,
  FLOAT32 7, FLOAT64 8, BFLOAT16 9 (the last only with NCCL >= 2.10). Broadcast, send and recv
  move bits without arithmetic, so bf16 (and int16) travel as raw bytes: NCCL_UINT8 with twice the
  count, bit-exact on every NCCL version; bool (one byte in torch) as NCCL_UINT8.

Streams: operations run on a communication stream of their own. Before issuing, it waits for the
caller's current stream (the buckets were just written there); afterwards the host waits for the
communication stream (polling ``query()`` and ``check_async_error()``, aborting after the spec's
timeout, as torch's NCCL watchdog does), so a returned buffer is complete for every stream.

NEVER RUN ON A GPU (this project's machines have none): everything below that touches ``cupy`` or
CUDA — ``NcclCommunicator.__init__`` from the ``cupy.cuda.Device`` scope on, ``_issue``, ``_wait``,
``close``, and :func:`new_unique_id`. What runs in the CPU tests: the dtype mapping
(:func:`nccl_args`), the unique-id conversions, the missing-cupy error, and everything around this
class (group formation, generations, ordering, versioned buckets) through the gloo twin, which
shares all code but this file. ``pytest -m gpu tests/transport/test_communicator.py`` runs the
same conformance suite on NCCL (one GPU per member, so 3-4 GPUs) the first day one is there.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from digenrl.errors import ConfigError, ProtocolError, TransportBroken
from digenrl.transport.group import Communicator, GroupSpec

__all__ = ["NCCL_TYPES", "NcclCommunicator", "nccl_args", "new_unique_id", "unique_id_arg", "unique_id_bytes"]

log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

# cupy.cuda.nccl's ncclDataType_t constants (nccl.pxd), mirrored so the mapping is testable without
# cupy; NcclCommunicator checks them against the installed cupy.
NCCL_TYPES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
              "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}

# torch dtype -> (NCCL type, NCCL elements per torch element). 16-bit types without an NCCL type on
# every version go as raw bytes (bit-exact: nothing here does arithmetic).
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("NCCL_FLOAT32", 1), torch.float64: ("NCCL_FLOAT64", 1), torch.float16: ("NCCL_FLOAT16", 1),
    torch.bfloat16: ("NCCL_UINT8", 2), torch.int64: ("NCCL_INT64", 1), torch.int32: ("NCCL_INT32", 1),
    torch.int16: ("NCCL_UINT8", 2), torch.int8: ("NCCL_INT8", 1), torch.uint8: ("NCCL_UINT8", 1),
    torch.bool: ("NCCL_UINT8", 1),
}

# Architectures whose C `char` is unsigned (cupy <= 13 hands the unique id out as C chars).
_UNSIGNED_CHAR = ("aarch64", "arm64", "armv7l", "ppc64le", "ppc64", "s390x")


def nccl_args(t: torch.Tensor) -> tuple[int, int]:
    """``(datatype, count)`` for moving all of ``t``'s bytes with one NCCL call.

    Raises:
        TypeError: a dtype NCCL cannot carry (names it).
    """
    entry = _DTYPES.get(t.dtype)
    if entry is None:
        raise TypeError(f"nccl: no mapping for {t.dtype}; supported: {sorted(str(d) for d in _DTYPES)}")
    name, per = entry
    return NCCL_TYPES[name], t.numel() * per


def unique_id_bytes(uid: Any) -> bytes:
    """The 128 bytes of a unique id as ``get_unique_id()`` returns it (cupy >= 14 bytes, or <= 13 a tuple of C chars).

    Raises:
        ProtocolError: not 128 bytes / ints in -128..255.
    """
    if isinstance(uid, bytes | bytearray):
        raw = bytes(uid)
    elif isinstance(uid, tuple | list) and all(isinstance(x, int) and -128 <= x <= 255 for x in uid):
        raw = bytes(x & 0xFF for x in uid)
    else:
        raise ProtocolError(f"nccl unique id must be bytes or a tuple of ints, got {type(uid).__name__}")
    if len(raw) != UNIQUE_ID_BYTES:
        raise ProtocolError(f"nccl unique id has {len(raw)} bytes, expected {UNIQUE_ID_BYTES}")
    return raw


def unique_id_arg(raw: bytes, cupy_major: int, machine: str | None = None) -> bytes | tuple[int, ...]:
    """What this cupy's ``NcclCommunicator`` takes: the bytes (cupy >= 14) or a tuple of C chars."""
    if cupy_major >= 14:
        return raw
    if (machine or platform.machine()).lower() in _UNSIGNED_CHAR:
        return tuple(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


def _cupy_nccl() -> Any:
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        import torch

        # cupy ships one wheel per CUDA major; the one to install is torch's (setup.sh installs it on a GPU machine)
        wheel = f"cupy-cuda{torch.version.cuda.split('.')[0]}x" if torch.version.cuda else "a cupy-cudaNNx wheel"
        raise ConfigError(f"transport.weights = 'nccl' needs cupy with NCCL: pip install {wheel} (torch's CUDA "
                          f"{torch.version.cuda}), or use 'gloo' / 'zmq' ({exc})") from None
    if not getattr(nccl, "available", True):
        raise ConfigError("transport.weights = 'nccl': this cupy was built without NCCL; use 'gloo' or 'zmq'")
    return nccl


def _cupy_major() -> int:
    import cupy

    return int(cupy.__version__.split(".")[0])


def new_unique_id() -> bytes:
    """A fresh NCCL unique id as 128 bytes (the root calls it once per generation)."""
    return unique_id_bytes(_cupy_nccl().get_unique_id())


class NcclCommunicator(Communicator):
    """A member of one generation of an NCCL group, bound to one CUDA device.

    Args:
        spec: the generation's spec (``kind == "nccl"``; ``uid`` from :func:`new_unique_id`).
        rank: this member's rank.
        device: its CUDA device (default: the current one).

    Raises:
        ConfigError: cupy (with NCCL) or CUDA is missing here.
        TransportBroken: the group did not form (a member never joined, NCCL error).
    """

    kind = "nccl"

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device | str | int | None = None) -> None:
        super().__init__(spec, rank)
        nccl = _cupy_nccl()
        if not torch.cuda.is_available():
            raise ConfigError("transport.weights = 'nccl' needs CUDA; torch.cuda.is_available() is False here")
        chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self._device = torch.device("cuda", torch.cuda.current_device() if chosen.index is None else chosen.index)
        for name, value in NCCL_TYPES.items():  # our mirror of the dtype enum must be this cupy's
            if name != "NCCL_BFLOAT16" and getattr(nccl, name) != value:
                raise ConfigError(f"cupy.cuda.nccl.{name} = {getattr(nccl, name)}, expected {value}: unknown cupy")
        import cupy

        self._nccl = nccl
        self._inflight = 0
        self._broken = False
        uid = unique_id_arg(unique_id_bytes(spec.uid), _cupy_major())
        with cupy.cuda.Device(self._device.index), torch.cuda.device(self._device):
            self._stream = torch.cuda.Stream(self._device)  # communication apart from compute
            try:
                self._comm: Any = nccl.NcclCommunicator(spec.world, uid, rank)
            except RuntimeError as exc:  # NcclError
                raise TransportBroken(f"nccl group generation {spec.generation}: rank {rank} could not join: {exc}") from exc
        log.info("nccl: rank %d of %d joined generation %d on %s", rank, spec.world, spec.generation, self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    def broadcast(self, buffers: Sequence[torch.Tensor], root: int = 0) -> None:
        self._check(buffers, root, "root")
        self._issue(buffers, lambda c, ptr, dt, n, s: c.bcast(ptr, n, dt, root, s), f"broadcast from {root}")

    def send(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        self._check(buffers, peer, "peer")
        self._issue(buffers, lambda c, ptr, dt, n, s: c.send(ptr, n, dt, peer, s), f"send to {peer}")

    def recv(self, buffers: Sequence[torch.Tensor], peer: int) -> None:
        self._check(buffers, peer, "peer")
        self._issue(buffers, lambda c, ptr, dt, n, s: c.recv(ptr, n, dt, peer, s), f"recv from {peer}")

    def _issue(self, buffers: Sequence[torch.Tensor], call: Callable[[Any, int, int, int, int], None], what: str) -> None:
        comm = self._comm
        if self._broken or comm is None:
            raise TransportBroken(f"nccl group generation {self.generation} was aborted or closed")
        self._inflight += 1
        try:
            with torch.cuda.device(self._device):
                # The buffers were written on the caller's current stream: wait for that work first.
                self._stream.wait_stream(torch.cuda.current_stream(self._device))
                handle = self._stream.cuda_stream
                self._nccl.groupStart()
                try:
                    for b in buffers:
                        if b.numel():
                            datatype, count = nccl_args(b)
                            call(comm, b.data_ptr(), datatype, count, handle)
                finally:
                    self._nccl.groupEnd()  # always paired, even when a call raised
                self._wait(what)
        except RuntimeError as exc:  # NcclError, CUDA errors
            raise TransportBroken(f"nccl group generation {self.generation} rank {self.rank}: {what} failed: {exc}") from exc
        finally:
            self._inflight -= 1

    def _wait(self, what: str) -> None:
        # Host-side wait with a deadline: a dead peer would otherwise hang the stream forever.
        deadline = time.monotonic() + self.spec.timeout_s
        pause = 1e-5
        while not self._stream.query():
            comm = self._comm
            if comm is None:  # closed (aborted) from another thread while we waited
                raise TransportBroken(f"nccl group generation {self.generation}: closed during {what}")
            comm.check_async_error()
            if time.monotonic() > deadline:
                self._abort()
                raise TransportBroken(f"nccl group generation {self.generation} rank {self.rank}: {what} did not "
                                      f"finish within {self.spec.timeout_s:g} s (a peer died?); communicator aborted")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _abort(self) -> None:
        self._broken = True
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        # destroy() waits for pending operations; abort() does not (and is the only way out after a
        # peer died). Both are idempotent in cupy (they check the handle).
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is None:
            return
        if self._inflight or self._broken:
            comm.abort()  # (NCCL allows it from another thread: it ends the operation stuck there)
        else:
            comm.destroy()
