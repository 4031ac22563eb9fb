"""Where the shared-memory lane's time goes at one size (default 16 MiB): its parts, measured interleaved.

    python bench/shm_profile.py                     # 16 MiB, rich table
    python bench/shm_profile.py --mib 64 --json out.json

One ``bench/transport.py`` bandwidth round (send a tensor over ``ZmqTransport`` to a sink in a child
process, which drops it and acknowledges) is, in series:

* ``copy``: the sender copies the tensor into a reused, pre-faulted segment (``ShmPool.write``);
* ``encode``: the header with the segment handle (codec + offload bookkeeping);
* ``round trip``: the handle message to the child and its ack (the header round trip, ``rtt``);
* ``decode``: the child maps/views the segment (``ShmReader``; measured here in-process, cached map).

Each part is timed in the same loop as the full round and as the reference memcpy (``dst.copy_(src)``
into a warm buffer, as ``bench/transport.py``), so ratios compare like with like on a loaded machine;
libc ``memmove`` is shown beside it, into a warm buffer and into the lane's kind of segment (it was
tried as the lane's copy: no faster there). ``fresh segment`` is the copy into a segment created for
the message (what the lane would pay without its pool of reused, pre-faulted segments); the pool's
segment count after the rounds says whether the rounds really reused one segment. The ceilings are
what the lane could reach with a free encode and decode: the copy and a round trip in series.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from digenrl.actors.loop import run as run_loop
from digenrl.transport import _shm, codec

HERE = Path(__file__).resolve().parent


def _bench_transport() -> Any:
    """bench/transport.py as a module (its RawEcho: a bare synchronous pyzmq echo, the machine's floor)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digenrl_bench_transport", HERE / "transport.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def profile(size: int, iters: int, loop: str) -> dict[str, Any]:
    from digenrl.transport.zmq import ZmqTransport

    torch.set_num_threads(1)
    address = f"ipc://{tempfile.gettempdir()}/digenrl-shmprof-{uuid.uuid4().hex[:8]}.sock"
    child = subprocess.Popen([sys.executable, str(HERE / "transport.py"), "--child", "zmq", address, "1", loop],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().startswith("READY")
    a = ZmqTransport(address.replace(".sock", "-p.sock"), shm="auto")
    blob = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(blob)
    dst.copy_(blob)
    pool = _shm.ShmPool(1 << 30)  # a private pool: the copy alone, into a warm reused segment
    coded = _shm.ShmPool(1 << 30)  # another, announced to `reader` by its first decode
    reader = _shm.ShmReader()
    raw = _bench_transport().RawEcho(f"ipc://{tempfile.gettempdir()}/digenrl-shmprof-raw-{uuid.uuid4().hex[:8]}.sock")

    async def round_(op: str, payload: Any) -> float:
        t0 = time.perf_counter()
        await a.send(address, {"op": op}, payload)
        await a.recv()
        return time.perf_counter() - t0

    def copy_into_pool(how: str) -> float:
        seg = pool.acquire(size)
        assert seg is not None
        t0 = time.perf_counter()
        if how == "torch":
            pool.write(seg, [blob])  # the lane's copy
        else:
            address = ctypes.addressof(ctypes.c_char.from_buffer(seg.mm))  # (the view dies at once)
            ctypes.memmove(address + 64, blob.data_ptr(), size)
        dt = time.perf_counter() - t0
        pool.release(seg)
        return dt

    def encode_decode() -> tuple[float, float]:
        seg = coded.acquire(size)
        assert seg is not None
        handles = coded.write(seg, [blob])
        t0 = time.perf_counter()
        frames = codec.encode({"op": "sink"}, {"x": blob}, offload=lambda t: handles[0] if t is blob else None)
        t1 = time.perf_counter()
        _, payload = codec.decode(frames, resolve=reader.resolver("me"))
        t2 = time.perf_counter()
        del payload  # its finalizer marks the segment FREE again
        return t1 - t0, t2 - t1

    def fresh_segment() -> float:
        fresh = _shm.ShmPool(1 << 30)
        t0 = time.perf_counter()
        seg = fresh.acquire(size)
        assert seg is not None
        fresh.write(seg, [blob])
        dt = time.perf_counter() - t0
        fresh.close(unlink=True)
        return dt

    keys = ("memcpy", "libc", "copy_torch", "copy_memmove", "encode", "decode", "rtt", "raw_rtt", "round", "fresh")
    parts: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for _ in range(5):  # warm everything: segments mapped on both sides, sockets connected
            await round_("sink", {"x": blob})
            for how in ("torch", "memmove"):
                copy_into_pool(how)
            await round_("echo", None)
            encode_decode()
        lane = a._peers[address].pool  # noqa: SLF001 (a benchmark looks inside)
        assert lane is not None
        for i in range(iters):
            parts["memcpy"].append(_time(lambda: dst.copy_(blob)))
            parts["libc"].append(_time(lambda: ctypes.memmove(dst.data_ptr(), blob.data_ptr(), size)))
            for how in ("torch", "memmove") if i % 2 else ("memmove", "torch"):
                parts[f"copy_{how}"].append(copy_into_pool(how))
            parts["round"].append(await round_("sink", {"x": blob}))
            enc, dec = encode_decode()
            parts["encode"].append(enc)
            parts["decode"].append(dec)
            parts["rtt"].append(await round_("echo", None))
            parts["raw_rtt"].append(raw([b"h" * 16]))
            if i % 4 == 0:
                parts["fresh"].append(fresh_segment())
        segments = lane.next_id
        fallbacks = a.stats["shm_fallback"]
    finally:
        await a.send(address, {"op": "stop"})
        await a.aclose()
        child.wait(30)
        raw.close()
        pool.close(unlink=True)
        coded.close(unlink=True)
        reader.clear()
    med = {k: statistics.median(v) for k, v in parts.items()}
    memcpy = med["memcpy"]
    return {"size_bytes": size, "iters": iters, "loop": loop, "seconds": med,
            "ratio_of_memcpy": {k: memcpy / v for k, v in med.items() if v > 0},
            "sum_of_parts": med["copy_torch"] + med["encode"] + med["rtt"] + med["decode"],
            # What the lane could reach with a free encode and decode: the copy and a header round trip in series,
            "ceiling": memcpy / (med["copy_torch"] + med["rtt"]),
            # ... and with a round trip as fast as bare synchronous pyzmq (no event loop at all).
            "ceiling_raw": memcpy / (med["copy_torch"] + med["raw_rtt"]),
            "segments_created": segments, "shm_fallback": fallbacks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=16.0, help="message size in MiB")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--loop", default="uvloop", help="uvloop or asyncio (both processes)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    out = run_loop(profile(int(args.mib * (1 << 20)), args.iters, args.loop), args.loop)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shm lane at {args.mib:g} MiB: medians over {args.iters} interleaved rounds ({args.loop})")
    for col in ("part", "ms", "memcpy / part"):
        table.add_column(col, justify="right" if col != "part" else "left")
    names = {"memcpy": "memcpy: torch copy_ (the reference)", "libc": "memcpy: libc memmove",
             "copy_torch": "copy into a reused segment (the lane's)", "copy_memmove": "libc memmove into it",
             "encode": "encode (handle)", "decode": "decode (cached map)", "rtt": "header round trip (digenrl zmq)",
             "raw_rtt": "header round trip (raw sync pyzmq)", "round": "full round (the lane)",
             "fresh": "copy into a fresh segment"}
    for key, label in names.items():
        sec = out["seconds"][key]
        table.add_row(label, f"{sec * 1e3:.3f}", f"{out['ratio_of_memcpy'][key]:.2f}")
    table.add_row("copy + encode + rtt + decode", f"{out['sum_of_parts'] * 1e3:.3f}",
                  f"{out['seconds']['memcpy'] / out['sum_of_parts']:.2f}")
    table.add_row("ceiling: copy + rtt only", "", f"{out['ceiling']:.2f}")
    table.add_row("ceiling: copy + raw rtt only", "", f"{out['ceiling_raw']:.2f}")
    Console().print(table)
    print(f"segments created by the lane's pool: {out['segments_created']}, frame fallbacks: {out['shm_fallback']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
