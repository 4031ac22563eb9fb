"""The host half of ``digenrl doctor``: the stack, the machine, the host lanes and the event loops.

Every figure is a ratio measured in one go, interleaved with its reference, because absolute
times on a shared machine say little: a lane's bandwidth over a memcpy of the same bytes done
between its rounds, an event-loop round trip over a raw synchronous pyzmq round trip done between
its rounds.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["check_host", "problems", "versions", "machine", "lane_bandwidth", "loop_round_trips"]

MiB = 1 << 20
_REQUIRED = ("torch", "diffusers", "transformers", "peft", "safetensors", "pyzmq", "msgpack", "typer", "rich")
_OPTIONAL = ("uvloop", "cupy", "ray")
_MIN_SHM = 1 << 30  # the shared-memory lane keeps up to 1 GiB of segments per destination


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of python and the stack (None: not installed); ``nccl`` only where CUDA is."""
    out: dict[str, str | None] = {"python": platform.python_version(), "digenrl": _dist_version("digenrl")}
    for name in (*_REQUIRED, *_OPTIONAL):
        out[name] = _dist_version(name)
    if out["cupy"] is None and importlib.util.find_spec("cupy") is not None:
        import cupy  # cupy ships as cupy-cuda12x etc.: ask the module

        out["cupy"] = str(cupy.__version__)
    if out["pyzmq"] is not None:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    out["nccl"] = None
    if out["torch"] is not None:
        import torch

        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    except OSError:
        return {}


def machine() -> dict[str, Any]:
    """Cores, RAM and shared memory of this host."""
    info = _meminfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cores_usable": cores,
                           "ram_bytes": info.get("MemTotal"), "ram_available_bytes": info.get("MemAvailable"),
                           "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    try:
        usage = shutil.disk_usage("/dev/shm")
        out["shm_bytes"], out["shm_free_bytes"] = usage.total, usage.free
    except OSError:
        out["shm_bytes"] = out["shm_free_bytes"] = None
    return out


# ------------------------------------------------------------------------------------------- lanes


async def _interleaved(nbytes: int, rounds: int, one: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    """Median seconds of ``one()`` and of a memcpy of ``nbytes`` between its rounds; the ratio."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    await one()  # warm: first segment, first pooled buffer
    lane, copy = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await one()
        lane.append(time.perf_counter() - t0)
    sec, ref = statistics.median(lane), statistics.median(copy)
    return {"size_bytes": nbytes, "gbps": nbytes / sec / 1e9, "memcpy_gbps": nbytes / ref / 1e9, "ratio": ref / sec}


async def _lanes(sizes: list[int], rounds: int) -> dict[str, list[dict[str, Any]]]:
    import torch

    from digenrl.transport.inproc import InprocTransport
    from digenrl.transport.zmq import ZmqTransport

    out: dict[str, list[dict[str, Any]]] = {}
    tmp = tempfile.gettempdir()
    pairs: list[tuple[str, Any, Any]] = [
        ("inproc", InprocTransport(), InprocTransport()),
        ("shm", ZmqTransport(f"ipc://{tmp}/digenrl-doctor-{uuid.uuid4().hex[:8]}.sock", shm=True),
         ZmqTransport(f"ipc://{tmp}/digenrl-doctor-{uuid.uuid4().hex[:8]}.sock", shm=True)),
    ]
    try:
        for name, a, b in pairs:
            rows = []
            for size in sizes:
                blob = torch.randint(0, 255, (size,), dtype=torch.uint8)

                async def one(a: Any = a, b: Any = b, blob: torch.Tensor = blob) -> None:
                    await a.send(b.address, {"op": "sink"}, {"x": blob})
                    msg = await b.recv()
                    del msg  # the receiver lets go: the segment / pooled buffer is free again

                rows.append(await _interleaved(size, rounds, one))
            out[name] = rows
    finally:
        for _, a, b in pairs:
            await a.aclose()
            await b.aclose()
    return out


def lane_bandwidth(sizes_mib: tuple[int, ...] = (16, 64), rounds: int = 6) -> dict[str, list[dict[str, Any]]]:
    """Bandwidth of the in-process lane (pooled copy) and the shared-memory lane, beside memcpy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # memcpy and the lanes' copies are single-threaded alike
    try:
        return asyncio.run(_lanes([s * MiB for s in sizes_mib], rounds))
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- event loops

_RAW_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.PAIR)
s.bind(sys.argv[1])
print("READY", flush=True)
while (m := s.recv_multipart(copy=False))[0].bytes != b"stop":
    s.send_multipart(m, copy=False)
"""


def _start(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"echo process {argv[-1]!r} did not start (said {line!r})")
    return proc


async def _round_trips(loop: str, rounds: int) -> dict[str, Any]:
    import zmq

    from digenrl.transport.zmq import ZmqTransport

    tmp = tempfile.gettempdir()
    raw_addr = f"ipc://{tmp}/digenrl-doctor-raw-{uuid.uuid4().hex[:8]}.sock"
    echo_addr = f"ipc://{tmp}/digenrl-doctor-echo-{uuid.uuid4().hex[:8]}.sock"
    raw_proc = _start([sys.executable, "-c", _RAW_ECHO, raw_addr])
    echo_proc = _start([sys.executable, "-m", "digenrl.doctor._echo", echo_addr, loop])
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PAIR)
    raw.connect(raw_addr)
    t = ZmqTransport(f"ipc://{tmp}/digenrl-doctor-me-{uuid.uuid4().hex[:8]}.sock")
    try:
        ours, theirs = [], []
        for i in range(rounds + 20):
            t0 = time.perf_counter()
            raw.send(b"h" * 16)
            raw.recv()
            t1 = time.perf_counter()
            await t.send(echo_addr, {"op": "echo"})
            await t.recv()
            t2 = time.perf_counter()
            if i >= 20:  # the first rounds connect and warm up
                theirs.append(t1 - t0)
                ours.append(t2 - t1)
        sec, ref = statistics.median(ours), statistics.median(theirs)
        return {"loop": loop, "rtt_us": sec * 1e6, "raw_pyzmq_rtt_us": ref * 1e6, "vs_raw": sec / ref}
    finally:
        raw.send(b"stop")
        await t.send(echo_addr, {"op": "stop"})
        await t.aclose()
        raw.close(linger=0)
        ctx.term()
        for proc in (raw_proc, echo_proc):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def loop_round_trips(rounds: int = 300) -> list[dict[str, Any]]:
    """Header round trip to an echo process per available event loop, over raw sync pyzmq."""
    from digenrl.actors.loop import EVENT_LOOPS, resolve_event_loop, run

    kinds = [k for k in EVENT_LOOPS if resolve_event_loop(k) == k]
    return [run(_round_trips(kind, rounds), kind) for kind in kinds]


# ---------------------------------------------------------------------------------------- report


def check_host() -> dict[str, Any]:
    """Everything above, in one dict."""
    return {"versions": versions(), "machine": machine(), "lanes": lane_bandwidth(), "event_loops": loop_round_trips()}


def problems(host: dict[str, Any]) -> list[str]:
    """What stops digenrl (or its fast paths) from working on this host."""
    out = []
    v = host["versions"]
    major, minor = (int(x) for x in v["python"].split(".")[:2])
    if (major, minor) < (3, 11):
        out.append(f"python {v['python']} is too old: digenrl needs 3.11+")
    out += [f"{name} is not installed (pip install -e .)" for name in _REQUIRED if v.get(name) is None]
    shm = host["machine"].get("shm_bytes")
    if shm is not None and shm < _MIN_SHM:
        out.append(f"/dev/shm holds only {shm / MiB:.0f} MiB: large tensors between processes fall back to "
                   "zmq frames (docker: --shm-size=8g)")
    return out
