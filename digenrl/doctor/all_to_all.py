"""The all-to-all a sequence-parallel group runs around every attention layer (Ulysses), measured on this machine.

``check_gloo()`` (host, always, a few seconds): ``torch.distributed.all_to_all_single`` between 2 local processes on
gloo (127.0.0.1), beside a memcpy of the same bytes in the same process: what an SP group of CPU processes pays.
``check_nccl(count)`` (GPU, with 2+ GPUs): the same over every visible GPU with NCCL, one process per GPU, beside a
device-to-device copy; with fewer than 2 it is skipped with the reason (an all-to-all with oneself moves nothing).

Each figure is ``gbps`` = bytes each rank sends to the others / seconds (the cost model's ``link`` in
``sim/sequence.py``: ``bytes * (k-1)/k`` over it), the median of a few rounds after a warm-up. The NCCL half has
never run on a GPU (this project is built without one); it is written against torch's documented API and its test
is marked ``gpu``.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

__all__ = ["check_gloo", "check_nccl", "all_to_all_member"]

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def all_to_all_member(rank: int, world: int, port: int, backend: str, nbytes: int, rounds: int, results: Any) -> None:
    """One rank: ``rounds`` all-to-alls of ``nbytes`` (fp32) after one warm-up; rank 0 puts its median seconds and,
    on CPU, a memcpy of the same bytes (on GPU: ``None``; ``gpu.copy_bandwidth`` is the reference)."""
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        numel = nbytes // 4 // world * world
        src = torch.randn(numel, device=device)
        dst = torch.empty_like(src)

        def median(fn: Any) -> float:
            times = []
            for _ in range(rounds + 1):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            times = sorted(times[1:])
            return times[len(times) // 2]

        a2a = median(lambda: dist.all_to_all_single(dst, src))
        copy = median(lambda: dst.copy_(src)) if device.type == "cpu" else None
        if rank == 0:
            results.put((a2a, copy, numel * 4))
    finally:
        dist.destroy_process_group()


def _measure(world: int, backend: str, nbytes: int, rounds: int) -> tuple[float, float | None, int]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(all_to_all_member, args=(world, _free_port(), backend, nbytes, rounds, results),
                       nprocs=world, start_method="spawn")
    return results.get()


def _row(world: int, backend: str, seconds: float, nbytes: int) -> dict[str, Any]:
    sent = nbytes * (world - 1) / world  # what each rank sends to the others
    return {"backend": backend, "gpus" if backend == "nccl" else "processes": world, "size_bytes": nbytes,
            "seconds": seconds, "gbps": sent / seconds / 1e9}


def check_gloo(nbytes: int = 16 * MiB, rounds: int = 5) -> dict[str, Any]:
    """The gloo all-to-all between 2 local processes beside a memcpy of the same bytes (``ratio``: memcpys per
    exchange); a failure is an ``error`` entry (sequence parallelism on CPU needs it; nothing else does)."""
    try:
        return _gloo(nbytes, rounds)
    except Exception as exc:  # noqa: BLE001 - the report says what failed, the other checks go on
        return {"error": f"{type(exc).__name__}: {exc}"}


def _gloo(nbytes: int, rounds: int) -> dict[str, Any]:
    seconds, copy, size = _measure(2, "gloo", nbytes, rounds)
    row, copy_s = _row(2, "gloo", seconds, size), float(copy or seconds)  # (a CPU rank always times its memcpy)
    return {**row, "memcpy_gbps": size / copy_s / 1e9, "ratio": seconds / copy_s}


def check_nccl(count: int, copy_gbps: float | None = None, nbytes: int = 256 * MiB,
               rounds: int = 10) -> dict[str, Any]:
    """The NCCL all-to-all over ``count`` GPUs beside ``copy_gbps`` (a device-to-device copy, when measured); skipped
    with fewer than 2 GPUs."""
    if count < 2:
        return {"skipped": f"needs 2 GPUs, found {count}"}
    seconds, _, size = _measure(count, "nccl", nbytes, rounds)
    row = _row(count, "nccl", seconds, size)
    return {**row, "copy_gbps": copy_gbps, "ratio": row["gbps"] / copy_gbps if copy_gbps else None}
