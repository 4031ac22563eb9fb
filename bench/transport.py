"""Transport benchmark: round-trip latency and bandwidth per transport, beside memcpy.

    python bench/transport.py                       # all transports, rich table
    python bench/transport.py --json out.json       # also write {"rows": [...]}
    python bench/transport.py --transports zmq-ipc,zmq-tcp --sizes-mib 16,64

For each transport (inproc, zmq-ipc, zmq-tcp, comm-gloo = the gloo communicator of the weight lane): the round trip of a header-only
message and of a 16 KiB latent ([4,16,8,8] fp32), then bandwidth at 1, 16 and 64 MiB. Bandwidth is
one message of that size to a sink that acknowledges it (time = send + delivery + ack), and beside
each row an in-process memcpy (``dst.copy_(src)`` into a warm buffer) of the same bytes measured in
the same run; ratio = gbps / memcpy_gbps. zmq and gloo use two processes (echo/sink in a child);
inproc runs both ends on one event loop. Medians over the iterations; 1 torch thread per process.
A ``raw-pyzmq-sync-ipc`` row (bare sync pyzmq echo, no digenrl) gives the machine's floor for
round trips in the same run, so latency can be judged under contention. ``loop-floor/<loop>`` is the
floor of any event-loop design: bare pyzmq on both sides driven by the loop (a reader callback on
``ZMQ_FD`` echoes in the child, the parent awaits a future the callback resolves), no digenrl code,
interleaved with the raw sync round trip like the zmq rows; digenrl's zmq rows over it are what
digenrl itself costs.
zmq runs with its defaults, so on one host the large tensors take the shared-memory lane
(``--no-shm`` measures the chunked-frame path instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from digenrl.actors.loop import run as run_loop

LATENT = (4, 16, 8, 8)


# ------------------------------------------------------------------------------------------- child

# Reference echo with bare pyzmq (sync PAIR, no digenrl, no torch): what the machine gives right now.
_RAW_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.PAIR)
s.bind(sys.argv[1])
print("READY", flush=True)
while (m := s.recv_multipart(copy=False))[0].bytes != b"stop":
    s.send_multipart(m, copy=False)
s.close(linger=0)
"""


# The event-loop floor's child: a bare ROUTER echoing from a reader callback on ZMQ_FD.
_LOOP_ECHO = """
import asyncio, sys, zmq
from digenrl.actors.loop import run
async def main():
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(sys.argv[1])
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    def readable():
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            m = s.recv_multipart(copy=False)
            if m[1].bytes == b"stop":
                return done.set_result(None)
            s.send_multipart(m, copy=False)
    loop.add_reader(s.getsockopt(zmq.FD), readable)
    print("READY", flush=True)
    loop.call_soon(readable)
    await done
run(main(), sys.argv[2])
"""


async def zmq_child(address: str, shm: bool) -> None:
    from digenrl.transport.zmq import ZmqTransport

    t = ZmqTransport(address, shm="auto" if shm else False)
    print("READY", flush=True)
    try:
        while True:
            msg = await t.recv()
            op = msg.header["op"]
            if op == "stop":
                break
            if op == "echo":
                await t.send(msg.src, msg.header, msg.payload)
            else:  # sink: let go of the payload, then acknowledge
                src = msg.src
                del msg
                await t.send(src, {"op": "ack"})
    finally:
        await t.aclose()


def gloo_child(address: str, uid: str) -> None:
    from digenrl.transport.communicator import GroupSpec, join_group

    comm = join_group(GroupSpec("gloo", 0, 2, bytes.fromhex(uid), address, 60.0), 1)
    cmd = torch.zeros(3, dtype=torch.int64)
    while True:
        comm.broadcast([cmd], 0)
        op, size, iters = (int(x) for x in cmd)
        if op == 0:
            break
        buf = torch.empty(size, dtype=torch.uint8)
        for _ in range(iters):
            if op == 1:  # ping-pong
                comm.recv([buf], 0)
                comm.send([buf], 0)
            else:  # broadcast sink + ack
                comm.broadcast([buf], 0)
                comm.send([cmd], 0)
    comm.close()


# ------------------------------------------------------------------------------------------ parent


class Memcpy:
    """The reference copy: ``dst.copy_(src)`` into a warm buffer of the same size, 1 torch thread."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


def memcpy_gbps(nbytes: int, iters: int) -> float:
    copy = Memcpy(nbytes)
    return nbytes / statistics.median(copy() for _ in range(iters)) / 1e9


def row(name: str, kind: str, nbytes: int, seconds: float, memcpy: float | None,
        raw_seconds: float | None = None) -> dict[str, Any]:
    gbps = nbytes / seconds / 1e9 if nbytes else 0.0
    return {"transport": name, "kind": kind, "size_bytes": nbytes, "seconds": seconds, "gbps": gbps,
            "memcpy_gbps": memcpy, "ratio": gbps / memcpy if memcpy else None,
            "raw_seconds": raw_seconds, "vs_raw": seconds / raw_seconds if raw_seconds else None}


async def measure_pair(name: str, send: Any, sizes: list[int], iters: int,
                       raw: Any = None) -> list[dict[str, Any]]:
    """``send(op, payload)`` performs one round: a message and its echo or ack.

    Under contention (a shared 2-core VM) conditions drift within seconds, so every reference is
    measured *interleaved* with the rounds it is compared to: bandwidth rounds alternate with a
    memcpy of the same bytes, and header round trips with ``raw(frames)``, a bare synchronous
    pyzmq round trip (when given). Ratios therefore compare like with like.
    """
    rows = []
    latent = torch.randn(LATENT)
    for label, payload in (("rtt-header", None), ("rtt-latent", {"x": latent})):
        raw_frames = [b"h" * 16] if payload is None else [b"h" * 16, memoryview(latent.numpy())]
        for _ in range(20):
            await send("echo", payload)
        times, raw_times = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            await send("echo", payload)
            times.append(time.perf_counter() - t0)
            if raw is not None:
                raw_times.append(raw(raw_frames))
        nbytes = 0 if payload is None else latent.numel() * 4
        rows.append(row(name, label, nbytes, statistics.median(times), memcpy_gbps(nbytes, 50) if nbytes else None,
                        statistics.median(raw_times) if raw_times else None))
    for size in sizes:
        blob = torch.randint(0, 255, (size,), dtype=torch.uint8)
        copy = Memcpy(size)
        n = max(8, min(40, (512 << 20) // size))
        await send("sink", {"x": blob})
        times, copies = [], []
        for _ in range(n):
            copies.append(copy())
            t0 = time.perf_counter()
            await send("sink", {"x": blob})
            times.append(time.perf_counter() - t0)
        rows.append(row(name, "bandwidth", size, statistics.median(times), size / statistics.median(copies) / 1e9))
    return rows


class RawEcho:
    """A bare synchronous pyzmq PAIR echo in a child (no digenrl, no torch): the machine's floor."""

    def __init__(self, address: str) -> None:
        import zmq

        self.child = subprocess.Popen([sys.executable, "-c", _RAW_ECHO, address], stdout=subprocess.PIPE, text=True)
        assert self.child.stdout is not None and self.child.stdout.readline().startswith("READY")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.connect(address)
        for _ in range(20):
            self([b"warm"])

    def __call__(self, frames: list[Any]) -> float:
        t0 = time.perf_counter()
        self.sock.send_multipart(frames)
        self.sock.recv_multipart()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.send(b"stop")
        self.child.wait(30)
        self.sock.close(linger=0)
        self.ctx.term()


async def bench_inproc(name: str, sizes: list[int], iters: int, copy: bool) -> list[dict[str, Any]]:
    from digenrl.transport.inproc import InprocTransport

    a, b = InprocTransport(copy=copy), InprocTransport(copy=copy)

    async def send(op: str, payload: Any) -> None:
        await a.send(b.address, {"op": op}, payload)
        msg = await b.recv()
        if op == "echo":
            await b.send(a.address, msg.header, msg.payload)
        else:
            del msg
            await b.send(a.address, {"op": "ack"})
        await a.recv()

    try:
        return await measure_pair(name, send, sizes, iters)
    finally:
        await a.aclose()
        await b.aclose()


async def bench_zmq(name: str, address: str, sizes: list[int], iters: int, shm: bool,
                    loop: str) -> list[dict[str, Any]]:
    from digenrl.transport.zmq import ZmqTransport

    child = subprocess.Popen([sys.executable, __file__, "--child", "zmq", address, str(int(shm)), loop],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().startswith("READY")
    local = "tcp://127.0.0.1:0" if address.startswith("tcp") else address.replace(".sock", "-p.sock")
    a = ZmqTransport(local, shm="auto" if shm else False)
    raw = RawEcho(f"ipc://{tempfile.gettempdir()}/digenrl-bench-raw-{uuid.uuid4().hex[:8]}.sock")

    async def send(op: str, payload: Any) -> None:
        await a.send(address, {"op": op}, payload)
        await a.recv()

    try:
        return await measure_pair(name, send, sizes, iters, raw)
    finally:
        raw.close()
        await a.send(address, {"op": "stop"})
        await a.aclose()
        child.wait(30)


async def bench_loop_floor(address: str, iters: int, loop_name: str) -> list[dict[str, Any]]:
    """Round trips of bare pyzmq on the event loop (both sides), interleaved with raw sync pyzmq."""
    import zmq

    child = subprocess.Popen([sys.executable, "-c", _LOOP_ECHO, address, loop_name], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().startswith("READY")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    loop = asyncio.get_running_loop()
    replies: list[Any] = []
    waiter: list[asyncio.Future[None]] = []

    def readable() -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            replies.append(sock.recv_multipart(copy=False))
            if waiter and not waiter[0].done():
                waiter[0].set_result(None)

    loop.add_reader(sock.getsockopt(zmq.FD), readable)

    async def send(op: str, payload: Any) -> None:
        frames = [b"h" * 16] if payload is None else [b"h" * 16, memoryview(payload["x"].numpy())]
        sock.send_multipart(frames, copy=False)
        readable()  # a send processes ZeroMQ's commands and may take the edge of ZMQ_FD
        while not replies:
            waiter[:] = [loop.create_future()]
            await waiter[0]
        replies.pop()

    raw = RawEcho(f"ipc://{tempfile.gettempdir()}/digenrl-bench-raw-{uuid.uuid4().hex[:8]}.sock")
    try:
        return await measure_pair(f"loop-floor/{loop_name}", send, [], iters, raw)
    finally:
        raw.close()
        loop.remove_reader(sock.getsockopt(zmq.FD))
        sock.send_multipart([b"stop"])
        child.wait(30)
        sock.close(linger=0)


def bench_gloo(sizes: list[int], iters: int) -> list[dict[str, Any]]:
    """The gloo communicator (the CPU weight lane): send/recv round trips and a one-bucket broadcast + ack."""
    from digenrl.transport.communicator import GroupHost, join_group

    host = GroupHost("gloo", timeout_s=60.0)
    spec = host.new_group(2)
    child = subprocess.Popen([sys.executable, __file__, "--child", "gloo", spec.address, spec.uid.hex()])
    comm = join_group(spec, 0)
    rows = []

    def run(op: int, size: int, n: int, body: Any) -> float:
        comm.broadcast([torch.tensor([op, size, n], dtype=torch.int64)], 0)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            body()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[len(times) // 5:])

    try:
        ack = torch.zeros(3, dtype=torch.int64)
        for label, nbytes in (("rtt-header", 8), ("rtt-latent", int(torch.Size(LATENT).numel()) * 4)):
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            sec = run(1, nbytes, iters, lambda b=buf: (comm.send([b], 1), comm.recv([b], 1)))
            size = 0 if label == "rtt-header" else nbytes
            rows.append(row("comm-gloo", label, size, sec, memcpy_gbps(size, 50) if size else None))
        for size in sizes:
            blob = torch.randint(0, 255, (size,), dtype=torch.uint8)
            n = max(5, min(30, (256 << 20) // size))
            sec = run(2, size, n, lambda b=blob: (comm.broadcast([b], 0), comm.recv([ack], 1)))
            rows.append(row("comm-gloo", "bandwidth", size, sec, memcpy_gbps(size, n)))
        comm.broadcast([torch.zeros(3, dtype=torch.int64)], 0)
    finally:
        child.wait(30)
        comm.close()
        host.close()
    return rows


def bench_raw(address: str, iters: int) -> list[dict[str, Any]]:
    raw = RawEcho(address)
    rows = []
    try:
        latent = torch.randn(LATENT)
        for label, frames in (("rtt-header", [b"h" * 16]), ("rtt-latent", [b"h" * 16, memoryview(latent.numpy())])):
            sec = statistics.median(raw(frames) for _ in range(iters))
            nbytes = 0 if len(frames) == 1 else latent.numel() * 4
            rows.append(row("raw-pyzmq-sync-ipc", label, nbytes, sec, memcpy_gbps(nbytes, 50) if nbytes else None))
    finally:
        raw.close()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"transport benchmark ({os.cpu_count()} cores, medians; ratio: GB/s over an interleaved "
                        "memcpy; vs raw: time over an interleaved raw sync pyzmq round trip)")
    for col in ("transport", "what", "size", "time", "GB/s", "memcpy GB/s", "ratio", "vs raw"):
        table.add_column(col, justify="left" if col in ("transport", "what") else "right", no_wrap=True)
    for r in rows:
        size = r["size_bytes"]
        human = "0" if not size else (f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB")
        t = r["seconds"]
        table.add_row(r["transport"], r["kind"], human, f"{t * 1e6:.0f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms",
                      f"{r['gbps']:.2f}" if size else "-", f"{r['memcpy_gbps']:.2f}" if r["memcpy_gbps"] else "-",
                      f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
                      f"{r['vs_raw']:.2f}x" if r.get("vs_raw") is not None else "-")
    Console(width=160).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="raw-zmq,loop-floor,inproc,inproc-handoff,zmq-ipc,zmq-tcp,comm-gloo",
                   help="raw-zmq is a bare-pyzmq RTT reference for the machine's current state; loop-floor "
                        "the same echo driven by each event loop without digenrl")
    p.add_argument("--loops", default="uvloop,asyncio",
                   help="event loops for the zmq rows (each side of the pair runs the same kind)")
    p.add_argument("--sizes-mib", default="1,16,64")
    p.add_argument("--iters", type=int, default=200, help="round trips per latency row")
    p.add_argument("--no-shm", action="store_true", help="zmq: chunked frames instead of shared memory")
    p.add_argument("--json", default=None, help="write {'rows': [...]} here")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.child:
        if args.child[0] == "zmq":
            run_loop(zmq_child(args.child[1], args.child[2] == "1"), args.child[3])
        else:
            gloo_child(args.child[1], args.child[2])
        return
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    tmp = tempfile.gettempdir()
    rows: list[dict[str, Any]] = []
    for name in args.transports.split(","):
        if name == "raw-zmq":
            rows += bench_raw(f"ipc://{tmp}/digenrl-bench-raw-{uuid.uuid4().hex[:8]}.sock", args.iters)
        elif name == "loop-floor":
            for loop in args.loops.split(","):
                rows += run_loop(bench_loop_floor(f"ipc://{tmp}/digenrl-bench-floor-{uuid.uuid4().hex[:8]}.sock",
                                                  args.iters, loop), loop)
        elif name in ("inproc", "inproc-handoff"):
            rows += run_loop(bench_inproc(name, sizes, args.iters, copy=name == "inproc"), args.loops.split(",")[0])
        elif name in ("zmq-ipc", "zmq-tcp"):
            for loop in args.loops.split(","):
                if name == "zmq-ipc":
                    address = f"ipc://{tmp}/digenrl-bench-{uuid.uuid4().hex[:8]}.sock"
                else:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
                # bandwidth does not depend on the loop: measure it once, on the first one
                rows += run_loop(bench_zmq(f"{name}/{loop}", address, sizes if loop == args.loops.split(",")[0] else [],
                                           args.iters, not args.no_shm, loop), loop)
        elif name == "comm-gloo":
            rows += bench_gloo(sizes, args.iters)
        else:
            raise SystemExit(f"unknown transport {name!r}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:], "no_shm": args.no_shm}, f, indent=1)


if __name__ == "__main__":
    main()
