"""The costs ``bench bubbles --real`` measures for ``plan --costs``, beyond one placement's compute tokens.

A plan compares splits and token sizes the bench did not run, so its costs must price what changes
with them (costs version 3, ``sim/measured.py``):

* per-kind ``overhead + per_unit x units`` (+ ``step_s x steps`` for a rollout token): non-negative least
  squares over every actor run's tokens, the bench's fine-token calibration run included. Its tokens
  are what separates a token's parts: a quarter of the fragment size (fewer samples per step call) in
  tokens of fewer steps than the other runs' whole trajectories (steps varied apart from samples);
* ``dispatch_s``: the median per-token overhead the coordinator measured (``Coordinator.overhead_log``);
* ``optim``: the median optimizer step of one trainer (real OPTIM tokens of one-trainer runs; with only
  group runs, their median less the all-reduce);
* ``allreduce``: two processes in a torch.distributed group over the trainer group's backend (gloo on
  CPU), summing tensors shaped like the config's trainable set with ``all_reduce_buckets`` as the
  trainers do, and a one-element all-reduce for the latency;
* ``publish``: the median real PUBLISH token.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from digenrl.config import Config
from digenrl.schedule.base import Token, TokenKind
from digenrl.sim.measured import AllReduce, MeasuredCost

__all__ = ["measure_allreduce", "plan_costs"]


def _allreduce_worker(rank: int, address: str, shapes: list[tuple[list[int], str]], reps: int) -> tuple[float, float]:
    """One rank: a one-element all-reduce and one of the trainable set's gradients, medians of ``reps``."""
    import torch

    from digenrl.roles.rollout import limit_threads
    from digenrl.roles.trainer_group import TrainerGroup, all_reduce_buckets

    limit_threads(1)  # a trainer actor's one thread
    group = TrainerGroup(rank, 2, address, "gloo", 60.0)
    try:
        grads = [torch.randn(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes]
        one = [torch.zeros(1)]

        def timed(tensors: list[Any]) -> float:
            group.barrier()  # both ranks enter together, as at a step: the time is the collective's own
            start = time.perf_counter()
            all_reduce_buckets(tensors)
            return time.perf_counter() - start

        for _ in range(3):  # warm-up: gloo's first collectives set up its pairs and buffers
            timed(one)
            timed(grads)
        small = statistics.median(timed(one) for _ in range(reps))
        full = statistics.median(timed(grads) for _ in range(reps))
        return small, full
    finally:
        group.close()


def measure_allreduce(cfg: Config, reps: int = 30, timeout_s: float = 120.0) -> AllReduce:
    """The trainer group's gradient all-reduce of ``cfg``'s trainable set between two processes, measured.

    The two ranks are plain subprocesses (``python -m digenrl.recipes.measure_costs RANK JOB.json``, the
    timings on stdout): no multiprocessing helper process outlives the measurement.

    Raises:
        RuntimeError: a rank failed or did not finish within ``timeout_s`` (its stderr in the message).
    """
    import subprocess
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    from digenrl.policy import build_model

    _, params = build_model(cfg)
    shapes = [(list(p.shape), str(p.dtype).removeprefix("torch.")) for p in params]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)  # the rendezvous, loopback
    job = {"address": f"127.0.0.1:{store.port}", "shapes": shapes, "reps": reps}
    outputs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        procs = [subprocess.Popen([sys.executable, "-m", "digenrl.recipes.measure_costs", str(rank), str(path)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=timeout_s)
                if proc.returncode != 0:
                    raise RuntimeError(f"all-reduce measurement rank failed (exit {proc.returncode}): {err[-2000:]}")
                outputs.append(json.loads(out.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"all-reduce measurement did not finish in {timeout_s:.0f} s") from exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return AllReduce.from_timings(nbytes, *outputs[0])


def plan_costs(tokens: list[tuple[Token, float]], overheads: list[float], allreduce: AllReduce) -> MeasuredCost:
    """The costs a plan reads (see the module docstring) from every actor run's tokens and overheads.

    Raises:
        ValueError: no compute token or no optimizer step among ``tokens``.
    """
    fitted = MeasuredCost.fit([(t, s) for t, s in tokens if t.kind in (TokenKind.ROLLOUT, TokenKind.REWARD,
                                                                     TokenKind.TRAIN)])
    single = [s for t, s in tokens if t.kind is TokenKind.OPTIM and len(t.devices) == 1]
    grouped = [s - allreduce.seconds(len(t.devices)) for t, s in tokens
               if t.kind is TokenKind.OPTIM and len(t.devices) > 1]
    steps = single or grouped
    publishes = [s for t, s in tokens if t.kind is TokenKind.PUBLISH]
    if not steps or not {"rollout", "reward", "train"} <= fitted.fits.keys():
        raise ValueError("plan costs need real rollout, reward, train and optimizer tokens")
    fits = {**fitted.fits, "optim": (max(0.0, statistics.median(steps)), 0.0),
            "publish": (statistics.median(publishes) if publishes else 0.0, 0.0)}
    return MeasuredCost(fits, statistics.median(overheads) if overheads else 0.0, allreduce, step_s=fitted.step_s,
                        notes=fitted.notes)


if __name__ == "__main__":  # one rank of measure_allreduce: RANK JOB.json; prints [small_s, full_s]
    with open(sys.argv[2]) as _f:
        _job = json.load(_f)
    print(json.dumps(_allreduce_worker(int(sys.argv[1]), _job["address"], _job["shapes"], _job["reps"])))
