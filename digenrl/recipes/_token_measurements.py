"""Each token's measurement of ``digenrl bench tokens`` (what is measured: ``bench_tokens.py``'s docstring).

Every measurement runs the code a run runs for that token on a :class:`~digenrl.recipes._token_bench.TokenBench`
(its model, engine, algorithm, reward and trainable set), times it with the bench's harness (``timed``: the median
after a warm-up, between device synchronisations) and keeps a
:class:`~digenrl.recipes._token_bench.Measurement` with the simulator's count of its FLOPs and its prediction beside
it. :func:`token_steps` lists them in the order they run.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from digenrl.data.images import reward_inputs
from digenrl.recipes._token_bench import Measurement, TokenBench
from digenrl.schedule.base import Fragment, Token, TokenKind
from digenrl.sim.cost import TRAIN_PASSES

__all__ = ["PARITY_ROWS", "Step", "token_steps"]

PARITY_ROWS = 16  # = roles.trainer.PARITY_SAMPLE_ROWS: rows of a stale pass recomputed for parity
Step = tuple[str, str, Callable[[], None]]  # (label, the sweep it belongs to, run it)


def token_steps(bench: TokenBench) -> list[Step]:
    """Every measurement of ``bench`` as ``(label, sweep, run)``, in the order they run."""
    each = functools.partial
    steps: list[Step] = [(f"rollout step, {b} samples", "rollout step", each(_rollout_step, bench, b))
                         for b in _sizes(bench.max_batch)]
    steps.append(("rollout start", "rollout start", each(_rollout_start, bench)))
    steps += [(f"train pass, {r} rows", "train pass", each(_train_pass, bench, r)) for r in _sizes(bench.max_rows)]
    if bench.stale and bench.cfg.train.check_parity:
        steps.append(("stale-batch parity", "stale-batch parity", each(_parity, bench)))
    for b in _sizes(bench.max_decode):
        steps += [(f"decode, {b} samples", "decode", each(_decode, bench, b)),
                  (f"reward score, {b} samples", "reward score", each(_score, bench, b))]
    steps += [("optimizer step", "optimizer step", each(_optim, bench)),
              ("publication", "publication", each(_publish, bench))]
    if bench.want_allreduce and bench.device.type == "cpu":
        steps.append(("all-reduce (2 gloo processes)", "all-reduce", each(_allreduce, bench)))
    return steps


def _sizes(cap: int) -> list[int]:
    """1, 2, 4, ... below ``cap``, then ``cap``."""
    out, n = [], 1
    while n < cap:
        out.append(n)
        n *= 2
    return [*out, max(1, cap)]


def _rollout_step(bench: TokenBench, b: int) -> None:
    seconds, runs = bench.timed(lambda frag: bench.engine.advance([frag], 0, 1), lambda: bench.fresh(b))
    bench.note_compile("the first rollout step")
    token = Token(0, TokenKind.ROLLOUT, "a", 0, num_samples=b, step_start=1, step_end=2)
    step = "SDE step" if bench.algorithm.coupled else f"ODE step ({bench.cfg.rollout.solver})"
    bench.add(Measurement("rollout step", b, "samples", seconds, runs, b * bench.velocity_flops, bench.flops_source,
                          b * bench.velocity_flops_counted, bench.predict(token),
                          f"velocity x {bench.passes} CFG pass(es) + {step}"))


def _rollout_start(bench: TokenBench) -> None:
    g, prompts, members = bench.cfg.rollout.group_size, bench.sizes.fragment_groups, bench.sizes.fragment_members

    def fresh(_: Any) -> None:
        bench.engine._cond_cache.clear()  # a new batch's prompts are encoded again
        bench.engine.fresh([0, 0, 0, prompts, 0, members, g], 0, bench.prompts)

    seconds, runs = bench.timed(fresh)
    flops = prompts * bench.profile.text_flops
    token = Token(0, TokenKind.ROLLOUT, "a", 0, num_samples=prompts * members, step_start=0, step_end=0,
                  fragments=(Fragment(0, 0, 0, prompts, 0, members, g),))
    bench.add(Measurement("rollout start", prompts * members, "samples", seconds, runs, flops or None,
                          "2 x text encoder params x tokens" if flops else "", None, bench.predict(token),
                          f"one fragment: {prompts} prompts encoded, initial noise"))


def _train_pass(bench: TokenBench, r: int) -> None:
    batch, cond, adv = bench.train_rows(r)

    def backward() -> None:  # the trainer's _backward of one token in one pass
        bench.backward(batch, cond, adv)

    try:
        seconds, runs = bench.timed(lambda _: backward())
        bench.note_compile("the first train pass")
        counted = bench.count_flops(backward)
    finally:
        for p in bench.params:
            p.grad = None
    passes = TRAIN_PASSES + bench.nograd_forwards
    samples = len(set(batch.sample.tolist()))
    stale = " (a one-step-stale token)" if bench.stale else ""
    note = (f"fwd + bwd + {bench.nograd_forwards:g} no-grad forward(s) a row{stale}"
            + (" + recompute" if bench.cfg.train.grad_checkpointing else ""))
    bench.add(Measurement("train pass", r, "rows", seconds, runs, r * passes * bench.velocity_flops,
                          f"{bench.flops_source} x {passes:g} passes a row (sim/cost.py)", counted,
                          bench.predict(Token(0, TokenKind.TRAIN, "a", 0, transitions=r, num_samples=samples,
                                              packed=bench.tsp)), note))


def _parity(bench: TokenBench) -> None:
    from digenrl.models.lora import load_trainable_state_dict, trainable_state_dict

    # a trainer recomputes PARITY_ROWS of Flow-GRPO's rows, or the first step of PARITY_ROWS samples of clean ones
    batch, cond, _ = bench.train_rows(PARITY_ROWS * (1 if bench.algorithm.coupled else bench.rows_per_sample))
    behaviour = trainable_state_dict(bench.model)

    def recompute(_: Any) -> None:  # the trainer's _behaviour_parity: swap in, recompute, swap back
        current = trainable_state_dict(bench.model)
        load_trainable_state_dict(bench.model, behaviour)
        bench.algorithm.parity_recompute(batch, cond, PARITY_ROWS)
        load_trainable_state_dict(bench.model, current)

    seconds, runs = bench.timed(recompute)
    bench.add(Measurement("stale-batch parity", 1, "token", seconds, runs, PARITY_ROWS * bench.velocity_flops,
                          bench.flops_source, note=f"each train token of a stale batch (train.check_parity): "
                          f"{PARITY_ROWS} rows between two weight swaps; the simulator has no term"))


def _decode(bench: TokenBench, b: int) -> None:
    from digenrl.models import decode_in_chunks

    x = bench.fresh(b).x
    with torch.no_grad():
        seconds, runs = bench.timed(lambda _: decode_in_chunks(bench.model, x, bench.cfg.rollout.decode_batch))
    flops, predicted = b * bench.decode_flops, None
    if bench.cost is not None:  # the cost model's decode term of a REWARD token
        predicted = flops / (bench.cost.specs["a"].peak_bf16_flops * bench.cost.params.mfu_rollout)
    bench.add(Measurement("decode", b, "samples", seconds, runs, flops, "FlopCounterMode on this decode (as "
                          "sim/profiles.py counts the real VAE)", flops, predicted))


def _score(bench: TokenBench, b: int) -> None:
    with torch.no_grad():
        images, prompts = bench.model.decode(bench.fresh(b).x), bench.prompts[:b]
    texts, sources = reward_inputs(prompts, images, bench.reward.uses_sources)
    seconds, runs = bench.timed(lambda _: bench.reward.score(images, texts, sources=sources))
    flops = b * bench.profile.reward_flops or None
    bench.add(Measurement("reward score", b, "samples", seconds, runs, flops, "sim/reward_models.py" if flops else "",
                          note="the config's reward models on reward.device" if flops else
                          "the config's rewards run on the host: no device FLOPs"))


def _optim(bench: TokenBench) -> None:
    t = bench.cfg.train
    opt = torch.optim.AdamW(bench.params, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay,
                            eps=t.eps)

    def grads() -> None:
        for p in bench.params:
            p.grad = torch.randn_like(p)

    def step(_: Any) -> None:  # TrainerActor._optim_compute of one trainer
        for p in bench.params:
            p.grad.div_(128.0)  # type: ignore[union-attr]  # set by grads()
        torch.nn.utils.clip_grad_norm_(bench.params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    with torch.no_grad():
        saved = [p.detach().clone() for p in bench.params]
        seconds, runs = bench.timed(step, grads)
        for p, s in zip(bench.params, saved, strict=True):
            p.copy_(s)  # the bench's later rows see the weights it built
    nbytes = sum(p.numel() * p.element_size() for p in bench.params)
    bench.add(Measurement("optimizer step", 1, "step", seconds, runs, predicted_s=bench.predict(
        Token(0, TokenKind.OPTIM, "a", 0)), note=f"AdamW over {sum(p.numel() for p in bench.params):,} params "
                                                 f"({nbytes / 2**20:.2f} MiB); memory-bound: no FLOPs"))


def _publish(bench: TokenBench) -> None:
    from digenrl.models.lora import trainable_state_dict
    from digenrl.roles.weights import WeightStore

    store = WeightStore(bench.model)
    parts = asyncio.run(_zmq_publish(bench, store))

    def restage() -> int:
        version = max(store.versions) + 1  # newer than every kept one, or the store drops it
        store.stage(version, trainable_state_dict(bench.model))
        return version

    load, runs = bench.timed(store.ensure, restage)
    nbytes = bench.profile.publish_bytes
    lane = bench.cfg.transport.weights
    note = (f"{nbytes / 2**20:.2f} MiB: state dict + pack_buckets + ZmqTransport send/recv (same host) + unpack "
            "+ stage + ack" + ("" if lane == "zmq" else f"; the config's lane ({lane}) needs two processes"))
    publish = parts.pop("publish")
    bench.add(Measurement("publication (zmq)", 1, "version", statistics.median(publish), len(publish),
                          predicted_s=bench.predict(Token(0, TokenKind.PUBLISH, "a", 0)), note=note,
                          parts={k: statistics.median(v) for k, v in parts.items()}))
    bench.add(Measurement("weight load (rollout)", 1, "version", load, runs, note=(
        "WeightStore.ensure of a staged version: the first rollout token at a new version pays it")))


async def _zmq_publish(bench: TokenBench, store: Any) -> dict[str, list[float]]:
    """The zmq lane's publication between two endpoints of this process: phase -> seconds of each run."""
    from digenrl.models.lora import trainable_state_dict
    from digenrl.roles.weights import pack_buckets, unpack_buckets
    from digenrl.transport.zmq import ZmqTransport

    trainer, rollout = ZmqTransport(), ZmqTransport()
    parts: dict[str, list[float]] = {"pack": [], "send_receive": [], "stage": [], "publish": []}
    try:
        for version in range(1, bench.repeats + 2):  # version 1: the warm-up (connections, shm segments)
            bench.sync()
            t0 = time.perf_counter()
            layout, buckets = pack_buckets(trainable_state_dict(bench.model), bench.cfg.transport.bucket_mb)
            bench.sync()
            t1 = time.perf_counter()
            await trainer.send(rollout.address, {"op": "receive_weights", "v": version}, [layout, buckets])
            msg = await rollout.recv()
            t2 = time.perf_counter()
            store.stage(version, unpack_buckets(*msg.payload))
            t3 = time.perf_counter()
            await rollout.send(trainer.address, {"op": "ack", "v": version})
            await trainer.recv()
            for key, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t0), strict=True):
                parts[key] += [seconds] if version > 1 else []
    finally:
        await trainer.aclose()
        await rollout.aclose()
    return parts


def _allreduce(bench: TokenBench) -> None:
    from digenrl.recipes.measure_costs import measure_allreduce

    bench.allreduce = a = measure_allreduce(bench.cfg)
    bench.allreduce_source = "measured: 2 gloo processes, all_reduce_buckets of the trainable set"
    predicted = bench.cost.allreduce_seconds(("a", "b")) if bench.cost is not None else None
    bench.add(Measurement("all-reduce (2 trainers)", 1, "step", a.seconds(2), 30, predicted_s=predicted,
                          note=f"{a.nbytes / 2**20:.2f} MiB; latency and bandwidth from two sizes"))
