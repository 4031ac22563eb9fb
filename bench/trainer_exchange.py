"""One gradient exchange between two trainer processes: the old zmq exchange vs the gloo all-reduce.

    .venv/bin/python bench/trainer_exchange.py [--reps 7] [--json out.json]

Two trainer-like processes hold the same trainable set (the tiny preset's LoRA, and a ~100M-parameter
set shaped like a large LoRA: 400 tensors of 256 x 1024). Per repetition, after a barrier:

* ``zmq``: what the removed hand-written exchange did (issue 13): each trainer sends a snapshot of
  its gradient tensors to its peer over the actor transport (zmq, same host: shared-memory segments)
  and sums the peer's into its own. Measured here with raw :class:`ZmqTransport` sends of the same
  buffers, so the method survives the code it measured.
* ``gloo``: :func:`digenrl.roles.trainer_group.all_reduce_buckets` (64 MiB buckets, one
  ``all_reduce`` each) inside the trainer group (TCPStore rendezvous, ``init_process_group``).

Prints the median seconds of each and the ratio gloo/zmq, all from one run (compare ratios, never
absolute times: the machine is shared). Both results are checked against the exact sum. On GPUs the
group's backend is NCCL over NVLink/InfiniBand, with no host staging at all; this CPU bench says
nothing about that path's speed (the simulator's ring model does: ``digenrl bench bubbles``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import torch


def tiny_lora_shapes() -> list[tuple[int, ...]]:
    """Shapes of the tiny Qwen-Image preset's LoRA parameters (the default config's trainable set)."""
    from digenrl.config import config_from_dict
    from digenrl.policy import build_model

    _, params = build_model(config_from_dict({}))
    return [tuple(p.shape) for p in params]


def large_shapes() -> list[tuple[int, ...]]:
    """~105M parameters in 400 tensors (a rank-64 LoRA of a 20B MMDiT is ~190M in ~1700 tensors)."""
    return [(256, 1024)] * 400


def _grads(shapes: list[tuple[int, ...]], rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=g) for s in shapes]


async def _zmq_exchange(transport: Any, peer: str, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    snapshot = [t.clone() for t in grads]  # phase 1 of the old exchange: freeze the local gradients
    await transport.send(peer, {"op": "grads"}, snapshot)
    msg = await transport.recv()
    return [a + b for a, b in zip(grads, msg.payload, strict=True)]


def _run_member(rank: int, store_port: Any, addresses: list[str], sets: dict[str, list[tuple[int, ...]]],
                reps: int, results: Any) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from digenrl.roles.trainer_group import TrainerGroup, all_reduce_buckets, open_store
    from digenrl.transport.zmq import ZmqTransport

    if rank == 0:
        store = open_store("127.0.0.1", 2, 120.0)
        store_port.put(store.port)
        group = TrainerGroup(0, 2, f"127.0.0.1:{store.port}", "gloo", 120.0, store=store)
    else:
        port = store_port.get()
        store_port.put(port)
        group = TrainerGroup(1, 2, f"127.0.0.1:{port}", "gloo", 120.0)

    async def main() -> dict[str, dict[str, list[float]]]:
        transport = ZmqTransport(addresses[rank])
        peer = addresses[1 - rank]
        times: dict[str, dict[str, list[float]]] = {}
        try:
            for name, shapes in sets.items():
                mine, other = _grads(shapes, rank), _grads(shapes, 1 - rank)
                exact = [a + b for a, b in zip(mine, other, strict=True)]
                t = times.setdefault(name, {"zmq": [], "gloo": []})
                for rep in range(reps + 1):  # the first repetition warms up connections and segments
                    dist.barrier()
                    t0 = time.perf_counter()
                    summed = await _zmq_exchange(transport, peer, mine)
                    t1 = time.perf_counter()
                    assert all(torch.equal(a, b) for a, b in zip(summed, exact, strict=True))
                    work = [g.clone() for g in mine]
                    dist.barrier()
                    t2 = time.perf_counter()
                    all_reduce_buckets(work, 64.0)
                    t3 = time.perf_counter()
                    assert all(torch.allclose(a, b) for a, b in zip(work, exact, strict=True))
                    if rep:
                        t["zmq"].append(t1 - t0)
                        t["gloo"].append(t3 - t2)
        finally:
            await transport.aclose()
        return times

    times = asyncio.run(main())
    dist.barrier()
    group.close()
    if rank == 0:
        results.put(times)


def run(reps: int = 7) -> dict[str, Any]:
    """Both exchanges for both trainable sets, in one run; returns medians and ratios."""
    sets = {"tiny_lora": tiny_lora_shapes(), "100M": large_shapes()}
    ctx = mp.get_context("spawn")
    port_q, results = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        addresses = [f"ipc://{d}/t0", f"ipc://{d}/t1"]
        procs = [ctx.Process(target=_run_member, args=(r, port_q, addresses, sets, reps, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        times = results.get(timeout=1200)
        for p in procs:
            p.join(60)
    report: dict[str, Any] = {}
    for name, t in times.items():
        params = sum(int(torch.Size(s).numel()) for s in sets[name])
        z, g = statistics.median(t["zmq"]), statistics.median(t["gloo"])
        report[name] = {"params": params, "tensors": len(sets[name]), "zmq_s": z, "gloo_s": g,
                        "gloo_over_zmq": g / z}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    report = run(args.reps)
    for name, r in report.items():
        print(f"{name:10s} {r['params'] / 1e6:8.2f}M params in {r['tensors']:4d} tensors: "
              f"zmq {r['zmq_s'] * 1e3:8.2f} ms  gloo {r['gloo_s'] * 1e3:8.2f} ms  gloo/zmq {r['gloo_over_zmq']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
