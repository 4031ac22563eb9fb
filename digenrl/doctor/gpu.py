"""The GPU half of ``digenrl doctor``: the checklist for the first day on a machine with GPUs.

RUN ONCE ON A GPU: this project is built on machines without one. The checklist below the
``torch.cuda.is_available()`` guard of :func:`check_gpu` ran once, on one H200 (issue 28: the
collectives then ran at world size 1 too); the ``cupy`` and ``blocks`` checks and the collective plan
(:func:`collective_plan`) added since have never run on a GPU. It is written against torch's
documented API (``torch.cuda``, ``torch.distributed`` with NCCL, CUDA tensors shared between
processes by ``torch.multiprocessing``) and reports each failure as an ``error`` entry instead of
stopping the other checks. Its test is marked ``gpu``.

Checks (each ratio measured in one go):
  * devices (name, capability, memory) and the P2P matrix (``can_device_access_peer``);
  * torch and cupy built for the same CUDA major (:mod:`digenrl.doctor.cuda`);
  * device-to-device copy bandwidth on each GPU and between GPU 0 and each other GPU (the
    reference for the lanes);
  * the all-to-all of sequence parallelism (Ulysses; ``doctor/all_to_all.py``), NCCL over every GPU, with 2+;
  * NCCL broadcast (torch.distributed, one process per GPU) and the weight lane's NCCL
    communicator (cupy), both on all GPUs, only with 2 or more (:func:`collective_plan`: a
    broadcast to nobody measures nothing), and the CUDA IPC lane (a tensor shared with another
    process, copied there), each over the copy;
  * one transformer block per model family at its published width, forward and backward in bf16
    (:mod:`digenrl.doctor.blocks`): a stack that cannot train one cannot train the model;
  * a tiny run in bf16 on ``cuda`` under ``colocated`` and ``async1``: samples/s and peak memory
    (colocated: ``torch.cuda.max_memory_allocated``; actors: per process, sampled by nvidia-smi);
  * rollout/train parity: at the first update the PPO ratio must be 1 within 1e-3 and the mean
    |ratio - 1| (``ratio_dev``, ~ mean |log-prob(train) - log-prob(rollout)|) under 1e-3.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["check_gpu", "problems", "collective_plan", "COLLECTIVES", "SKIPPED_WITHOUT_GPU"]

MiB = 1 << 20
PARITY_TOL = 1e-3
COLLECTIVES = ("nccl_broadcast", "nccl_communicator", "nccl_all_to_all")
SKIPPED_WITHOUT_GPU = ("devices", "p2p", "cupy", "copy_bandwidth", *COLLECTIVES, "cuda_ipc", "tiny_runs", "parity",
                       "blocks")


def collective_plan(count: int) -> dict[str, dict[str, Any]]:
    """Which collective checks run on ``count`` GPUs, and at which world size; the others' skip reason.

    A collective needs two ranks: at world size 1 NCCL's broadcast returns without moving a byte, and
    its "bandwidth" (10-11 TB/s on an H200, 5x a device copy) is no figure of the machine. So it runs
    once, over every GPU, and with fewer than two it is skipped and says why.
    """
    if count < 2:
        return {name: {"skipped": f"needs 2 GPUs, found {count}"} for name in COLLECTIVES}
    return {name: {"world": count} for name in COLLECTIVES}


def check_gpu() -> dict[str, Any]:
    """Every GPU check; without CUDA, which ones were skipped and why."""
    import torch

    if not torch.cuda.is_available():
        why = ("torch is a CPU build" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no CUDA device")
        return {"available": False, "reason": why, "skipped": list(SKIPPED_WITHOUT_GPU)}
    from digenrl.doctor.blocks import check_blocks
    from digenrl.doctor.cuda import check_cupy

    n = torch.cuda.device_count()
    out: dict[str, Any] = {"available": True, "count": n}
    plan = collective_plan(n)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("devices", lambda: _devices(n)),
        ("p2p", lambda: _p2p(n)),
        ("cupy", check_cupy),
        ("copy_bandwidth", lambda: _copies(n)),
        ("nccl_broadcast", lambda: _collective(_nccl, plan["nccl_broadcast"], out)),
        ("nccl_communicator", lambda: _collective(_communicator, plan["nccl_communicator"], out)),
        ("nccl_all_to_all", lambda: _collective(_all_to_all, plan["nccl_all_to_all"], out)),
        ("cuda_ipc", lambda: [_ipc(0, d, out) for d in sorted({0, n - 1})]),
        ("tiny_runs", lambda: [_tiny_run("colocated"), _tiny_run("async1")]),
        ("blocks", check_blocks),
    ]
    for name, step in steps:
        try:
            out[name] = step()
        except Exception as exc:  # one broken check must not hide the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}
    out["parity"] = _parity(out.get("tiny_runs"))
    return out


def problems(gpu: dict[str, Any]) -> list[str]:
    """Failed GPU checks (none without a GPU: a CPU machine runs digenrl fine).

    A skipped check (``{"skipped": why}``, e.g. a collective on one GPU) and a note (cupy absent) are
    not problems; a cupy built for another CUDA than torch is, and so is each family whose real-width
    block failed, by name.
    """
    from digenrl.doctor import blocks

    if not gpu.get("available"):
        return []
    out = [f"gpu check {name} failed: {v['error']}" for name, v in gpu.items()
           if name != "blocks" and isinstance(v, dict) and "error" in v]
    cupy = gpu.get("cupy", {})
    if isinstance(cupy, dict) and cupy.get("problem"):
        out.append(cupy["problem"])
    if isinstance(gpu.get("blocks"), dict):
        out += blocks.problems(gpu["blocks"])
    parity = gpu.get("parity", {})
    if parity.get("ok") is False:
        out.append(f"rollout/train parity: {parity.get('why')}")
    return out


# --------------------------------------------------------------------------------------- devices


def _devices(n: int) -> list[dict[str, Any]]:
    import torch

    rows = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        rows.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
                     "multiprocessors": p.multi_processor_count})
    return rows


def _p2p(n: int) -> list[list[bool]]:
    import torch

    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


def _time_cuda(fn: Callable[[], None], device: int, rounds: int = 10) -> float:
    """Median seconds of ``fn`` on ``device``, timed with CUDA events."""
    import torch

    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _copy_gbps(src_dev: int, dst_dev: int, nbytes: int = 256 * MiB) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    return nbytes / _time_cuda(lambda: dst.copy_(src, non_blocking=True), dst_dev) / 1e9


def _copies(n: int) -> dict[str, Any]:
    return {"on_device_gbps": [_copy_gbps(i, i) for i in range(n)],
            "from_gpu0_gbps": [_copy_gbps(0, j) for j in range(1, n)]}


# ------------------------------------------------------------------------------ NCCL and CUDA IPC


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nccl_rank(rank: int, world: int, port: int, nbytes: int, rounds: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
        for _ in range(3):
            dist.broadcast(buf, 0)
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            times.sort()
            results.put(nbytes / times[len(times) // 2] / 1e9)
    finally:
        dist.destroy_process_group()


def _nccl(world: int, out: dict[str, Any], nbytes: int = 256 * MiB) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_nccl_rank, args=(world, _free_port(), nbytes, 10, results), nprocs=world,
                       start_method="spawn")
    gbps = results.get()
    ref = _reference(out, 0, world - 1)
    return {"gpus": world, "size_bytes": nbytes, "gbps": gbps, "copy_gbps": ref, "ratio": gbps / ref if ref else None}


def _collective(lane: Callable[[int, dict[str, Any]], dict[str, Any]], step: dict[str, Any],
                out: dict[str, Any]) -> dict[str, Any]:
    """One step of :func:`collective_plan`: ``lane`` measured at its world size, or its skip as it is."""
    return lane(step["world"], out) if "world" in step else step


def _communicator_rank(rank: int, world: int, wire: dict[str, Any], nbytes: int, rounds: int, results: Any) -> None:
    import torch

    from digenrl.transport.communicator import GroupSpec, join_group

    # The weight lane's own path: cupy's NCCL binding, unique id handed over, no torch.distributed.
    torch.cuda.set_device(rank)
    comm = join_group(GroupSpec.from_wire(wire), rank, f"cuda:{rank}")
    try:
        bufs = [torch.full((nbytes // 2,), rank, dtype=torch.bfloat16, device=f"cuda:{rank}")]
        times = []
        for _ in range(rounds + 3):
            t0 = time.perf_counter()
            comm.broadcast(bufs, 0)  # returns once the data landed (it waits for its stream)
            times.append(time.perf_counter() - t0)
        exact = bool((bufs[0] == 0).all())  # bf16 as raw bytes: rank 0's zeros everywhere
        times = sorted(times[3:])
        results.put((rank, exact, nbytes / times[len(times) // 2] / 1e9))
    finally:
        comm.close()


def _communicator(world: int, out: dict[str, Any], nbytes: int = 256 * MiB) -> dict[str, Any]:
    import importlib.util

    import torch
    import torch.multiprocessing as mp

    from digenrl.doctor.cuda import cupy_package_for
    from digenrl.transport.communicator import GroupHost

    if importlib.util.find_spec("cupy") is None:
        want = cupy_package_for(torch.version.cuda)
        return {"gpus": world, "skipped": f"cupy is not installed (pip install {want}); transport.weights = 'nccl' "
                                           "needs it"}
    spec = GroupHost("nccl").new_group(world)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_communicator_rank, args=(world, spec.to_wire(), nbytes, 10, results), nprocs=world,
                       start_method="spawn")
    got = sorted(results.get() for _ in range(world))
    if not all(exact for _, exact, _ in got):
        raise RuntimeError(f"nccl communicator broadcast was not bit-exact on ranks {[r for r, e, _ in got if not e]}")
    gbps = got[0][2]
    ref = _reference(out, 0, world - 1)
    return {"gpus": world, "size_bytes": nbytes, "gbps": gbps, "copy_gbps": ref, "ratio": gbps / ref if ref else None}


def _all_to_all(world: int, out: dict[str, Any]) -> dict[str, Any]:
    """Ulysses' all-to-all over every GPU (``doctor/all_to_all.py``) beside the GPU 0 -> last copy."""
    from digenrl.doctor.all_to_all import check_nccl

    return check_nccl(world, _reference(out, 0, world - 1))


def _ipc_consumer(device: int, handles: Any, done: Any, rounds: int) -> None:
    import torch

    torch.cuda.set_device(device)
    src = handles.get()  # a CUDA tensor rebuilt from its IPC handle (torch.multiprocessing)
    dst = torch.empty(src.numel(), dtype=src.dtype, device=f"cuda:{device}")
    times = []
    for _ in range(rounds + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    del src  # the producer's memory is freed only once the consumer let go
    done.put(times[len(times) // 2])


def _ipc(src_dev: int, dst_dev: int, out: dict[str, Any], nbytes: int = 256 * MiB) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_consumer, args=(dst_dev, handles, done, 10))
    proc.start()
    try:
        blob = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
        handles.put(blob)  # travels as a CUDA IPC handle; blob must stay alive until the consumer is done
        seconds = done.get(timeout=300)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    gbps = nbytes / seconds / 1e9
    ref = _reference(out, src_dev, dst_dev)
    return {"from": src_dev, "to": dst_dev, "size_bytes": nbytes, "gbps": gbps, "copy_gbps": ref,
            "ratio": gbps / ref if ref else None}


def _reference(out: dict[str, Any], src: int, dst: int) -> float | None:
    """The device-to-device copy measured by ``copy_bandwidth`` for ``src -> dst``."""
    copies = out.get("copy_bandwidth")
    if not isinstance(copies, dict) or "error" in copies:
        return None
    if src == dst:
        return float(copies["on_device_gbps"][src])
    return float(copies["from_gpu0_gbps"][dst - 1]) if src == 0 else None


# ------------------------------------------------------------------------------------- tiny runs


@contextlib.contextmanager
def _sampled_peak_memory() -> Iterator[dict[int, int]]:
    """Peak GPU memory per process id, sampled with nvidia-smi every 0.2 s while the block runs."""
    peaks: dict[int, int] = {}
    stop = threading.Event()
    smi = shutil.which("nvidia-smi")

    def sample() -> None:
        while smi and not stop.wait(0.2):
            try:
                lines = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                       capture_output=True, text=True, timeout=5).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                return
            for line in lines:
                pid, mib = (x.strip() for x in line.split(","))
                if pid.isdigit() and mib.isdigit():
                    peaks[int(pid)] = max(peaks.get(int(pid), 0), int(mib) * MiB)

    thread = threading.Thread(target=sample, name="digenrl-doctor-smi", daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join(10)


def _process_titles(pids: list[int]) -> dict[int, str]:
    titles = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                titles[pid] = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            titles[pid] = "exited"
    return titles


def _tiny_run(schedule: str, iterations: int = 2) -> dict[str, Any]:
    import torch

    from digenrl.config import config_from_dict
    from digenrl.recipes.disaggregated import run_disaggregated

    with tempfile.TemporaryDirectory(prefix="digenrl-doctor-") as out:
        cfg = config_from_dict({
            "model": {"device": "cuda", "dtype": "bfloat16"},
            "train": {"iterations": iterations},
            "schedule": {"name": schedule},
            "placement": {"actors_per_gpu": 2},  # the rollout actor and the trainer on one GPU, as a 1-GPU host has
            "log": {"out": out, "image_every": 0, "checkpoint_every": 0, "trace": False, "gantt": False},
        })
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with _sampled_peak_memory() as peaks:
            metrics = run_disaggregated(cfg, out)
        wall = time.perf_counter() - start
    first = metrics[0]
    per_actor = {f"{title} (pid {pid})": peak for pid, title in _process_titles(list(peaks)).items()
                 for peak in [peaks[pid]] if pid != os.getpid()}
    if schedule == "colocated":
        per_actor = {"colocated (this process)": torch.cuda.max_memory_allocated()}
    return {"schedule": schedule, "dtype": "bfloat16", "steps": len(metrics), "wall_s": wall,
            "samples_per_s": sum(m["samples_per_s"] for m in metrics[1:]) / max(1, len(metrics) - 1)
            if len(metrics) > 1 else first["samples_per_s"],
            "peak_memory_bytes": per_actor, "first_update": {"ratio": first["ratio"], "ratio_dev": first["ratio_dev"]}}


def _parity(runs: Any) -> dict[str, Any]:
    """PPO ratio at the first update of each tiny run: 1 within ``PARITY_TOL``, and mean |ratio - 1| under it."""
    if not isinstance(runs, list):
        return {"ok": None, "why": "the tiny runs did not finish"}
    rows, bad = [], []
    for run in runs:
        ratio, dev = run["first_update"]["ratio"], run["first_update"]["ratio_dev"]
        rows.append({"schedule": run["schedule"], "ratio": ratio, "mean_abs_ratio_minus_1": dev})
        if abs(ratio - 1) > PARITY_TOL or dev > PARITY_TOL:
            bad.append(f"{run['schedule']}: ratio {ratio:.6f}, mean |ratio-1| {dev:.2e} (tolerance {PARITY_TOL:g})")
    return {"ok": not bad, "tolerance": PARITY_TOL, "runs": rows, "why": "; ".join(bad) or None}
