"""Sequence-parallel benchmark: the all-to-all Ulysses runs around every attention, beside memcpy; SP = N vs SP = 1.

    python bench/all_to_all.py                        # 2 processes on gloo, rich table
    python bench/all_to_all.py --world 4 --json out.json
    python bench/all_to_all.py --backend nccl         # one process per CUDA device

Rows ``all_to_all`` (one per size): ``dist.all_to_all_single`` of a ``[N, S/N, B, H/N, D]`` fp32 tensor (the layout
diffusers' Ulysses attention sends) of that many bytes per member, against an in-process memcpy
(``dst.copy_(src)`` into a warm buffer) of the same bytes measured in the same run: ratio = all-to-all time /
memcpy time (how many memcpys one exchange costs; a health figure for the doctor on the SP group's link). Row
``forward``: one tiny Wan2.1 transformer forward (5 frames at 64 px, 32 latent tokens; ``--frames``,
``--resolution`` for more) parallelized over the group, against the same forward at SP = 1 in the same
process: ratio = SP time / SP = 1 time (below 1 means SP pays; at tiny size it is all communication).
Medians over ``--iters``; 1 torch thread per process; 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SIZES_MIB = (1, 16, 64)


def _median_seconds(fn: Any, iters: int, sync: Any = None) -> float:
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _all_to_all_rows(world: int, device: torch.device, iters: int, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows = []
    for mib in sizes:
        numel = mib * 2**20 // 4 // world * world
        src = torch.randn(world, numel // world, device=device)
        dst = torch.empty_like(src)
        t_a2a = _median_seconds(lambda: dist.all_to_all_single(dst, src), iters, sync)
        t_copy = _median_seconds(lambda: dst.copy_(src), iters, sync)
        rows.append({"what": "all_to_all", "mib": mib, "seconds": t_a2a, "memcpy_seconds": t_copy,
                     "ratio": t_a2a / t_copy})
    return rows


def _forward_row(world: int, device: torch.device, iters: int, frames: int, resolution: int) -> dict[str, Any]:
    from digenrl.models import load_model
    from digenrl.models.sequence_parallel import parallelize

    def build() -> Any:
        return load_model("wan21", "tiny", device=device, num_frames=frames, resolution=(resolution, resolution))

    single, parallel = build(), build()
    parallelize(parallel, dist.group.WORLD)
    x = single.prepare_latents(2, generator=torch.Generator().manual_seed(0))
    cond = single.encode_prompts(["a red square", "a blue circle"])
    sigma = torch.tensor([0.9, 0.4])
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    with torch.no_grad():
        t1 = _median_seconds(lambda: single.velocity(x, sigma, cond), iters, sync)
        dist.barrier()
        tn = _median_seconds(lambda: parallel.velocity(x, sigma, cond), iters, sync)
    tokens = (frames - 1) // 4 + 1
    return {"what": "forward", "tokens": tokens * (resolution // 16) ** 2, "seconds": tn, "sp1_seconds": t1,
            "ratio": tn / t1}


def member(args: argparse.Namespace) -> None:
    """One process of the group: every row, written by rank 0 as JSON on stdout."""
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{args.rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    sizes = tuple(int(s) for s in args.sizes_mib.split(","))
    rows = _all_to_all_rows(args.world, device, args.iters, sizes)
    rows.append(_forward_row(args.world, device, args.iters, args.frames, args.resolution))
    if args.rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start ``args.world`` member processes and return rank 0's rows."""
    port = _free_port()
    root = str(Path(__file__).resolve().parents[1])
    forwarded = ["--world", str(args.world), "--port", str(port), "--backend", args.backend, "--iters", str(args.iters),
                 "--sizes-mib", args.sizes_mib, "--frames", str(args.frames), "--resolution", str(args.resolution)]
    procs = [subprocess.Popen([sys.executable, __file__, "--member", "--rank", str(r), *forwarded], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(args.world)]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise SystemExit(f"a member failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def show(rows: list[dict[str, Any]], world: int, backend: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Ulysses SP over {world} processes ({backend})")
    for col in ("what", "size", "seconds", "baseline seconds", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        if r["what"] == "all_to_all":
            table.add_row("all_to_all / memcpy", f"{r['mib']} MiB", f"{r['seconds']:.5f}", f"{r['memcpy_seconds']:.5f}",
                          f"{r['ratio']:.1f}")
        else:
            table.add_row(f"forward SP={world} / SP=1", f"{r['tokens']} tokens", f"{r['seconds']:.5f}",
                          f"{r['sp1_seconds']:.5f}", f"{r['ratio']:.2f}")
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--sizes-mib", default=",".join(map(str, SIZES_MIB)))
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--json", default=None, help="write {'rows': [...]} here")
    p.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.member:
        member(args)
        return
    rows = run(args)
    show(rows, args.world, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)


if __name__ == "__main__":
    main()
