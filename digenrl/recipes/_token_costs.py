"""The costs file of ``digenrl bench tokens``: its rows fitted to the lines a plan charges, and the report.

``token_costs`` fits each sweep of a :class:`~digenrl.recipes.bench_tokens.TokenBench`'s rows with
:func:`fit_line` into the ``MeasuredCost`` that ``digenrl plan --fleet --costs`` and ``MeasuredCost.from_report``
read (costs version 3); an all-reduce the bench did not measure is the catalog's (:func:`catalog_allreduce`).
``token_report`` is the JSON report: the model, the peak, the prediction's parameters, the rows, one sample's
cost on each side (:func:`per_sample`) and the ``calibration`` (the costs file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from digenrl.recipes._token_bench import Measurement, TokenBench
from digenrl.sim.cost import TRAIN_PASSES
from digenrl.sim.measured import AllReduce, MeasuredCost

__all__ = ["SOURCE", "fit_line", "catalog_allreduce", "token_costs", "token_report", "per_sample"]

SOURCE = "digenrl bench tokens"
Line = tuple[float, float]  # seconds = a + b x


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Non-negative ``seconds = a + b x`` through ``(x, seconds)``, least squares of the *relative*
    residuals (a sweep's small sizes count as much as its large ones).

    Returns:
        ``(a, b, largest relative residual)``.
    """
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    if len(points) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([w, x * w], 1), y * w, rcond=None)
    else:
        a, b = 0.0, float(y[0] / x[0])
    if b < 0:  # no growth measured: a constant
        a, b = float(np.sum(w * w * y) / np.sum(w * w)), 0.0
    elif a < 0:  # through the origin
        a, b = 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    return float(a), float(b), float(np.max(np.abs(a + b * x - y) * w))


def catalog_allreduce(nbytes: float, device: str, why: str) -> tuple[AllReduce, str]:
    """An all-reduce not measured here (``why``): the simulator's ring all-reduce of ``nbytes`` over the
    catalog ``device``'s intra-node link and collective latency (what ``CostModel`` charges), and the
    sentence saying so."""
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.devices import device_spec

    latency, spec = calibrated_params().collective_latency_s, device_spec(device)
    return (AllReduce(float(nbytes), spec.intra_node_bytes_per_s, latency),
            f"{why}: charged as the simulator's ring all-reduce of the trainable set over the catalog "
            f"{spec.name}'s intra-node link ({spec.intra_node_bytes_per_s / 1e9:g} GB/s, {latency * 1e6:g} us a step)")


def _fit(results: list[Measurement], kind: str) -> tuple[float, float, float] | None:
    points = [(m.size, m.seconds) for m in results if m.kind == kind]
    return fit_line(points) if points else None


def _one(results: list[Measurement], kind: str, not_measured: dict[str, str]) -> float:
    seconds = next((m.seconds for m in results if m.kind == kind), None)
    if seconds is None:
        not_measured[kind] = "out of device memory: 0 charged"
    return seconds or 0.0


def _sweep_fits(results: list[Measurement], notes: list[str], not_measured: dict[str, str]) -> dict[str, Line]:
    """The train pass's line and a REWARD token's (its decode's plus its score's); 0 for a sweep not measured."""
    fits: dict[str, Line] = {}
    for kind, name in (("train", "train pass"), ("decode", "decode"), ("score", "reward score")):
        if (fit := _fit(results, name)) is not None:
            fits[kind] = (fit[0], fit[1])
            notes.append(f"{name}: {fit[0] * 1e3:.3f} ms + {fit[1] * 1e3:.4f} ms/unit (largest relative "
                         f"residual {fit[2]:.0%})")
        else:
            not_measured[name] = "out of device memory: 0 charged"
    decode, score = fits.pop("decode", (0.0, 0.0)), fits.pop("score", (0.0, 0.0))
    fits["reward"] = (decode[0] + score[0], decode[1] + score[1])  # a REWARD token decodes, then scores
    fits.setdefault("train", (0.0, 0.0))
    return fits


def _allreduce(bench: TokenBench, notes: list[str], not_measured: dict[str, str]) -> tuple[AllReduce, str]:
    """The all-reduce the bench measured, else the catalog's (and why, in ``not_measured``)."""
    if bench.allreduce is not None:
        notes.append(f"allreduce: {bench.allreduce_source}")
        return bench.allreduce, bench.allreduce_source
    why = "on a GPU the trainers' NCCL all-reduce is not measured" if bench.device.type == "cuda" \
        else "--no-allreduce"
    allreduce, source = catalog_allreduce(sum(p.numel() * p.element_size() for p in bench.params),
                                          bench.catalog or "measured", why)
    not_measured["allreduce"] = source
    return allreduce, source


def token_costs(bench: TokenBench) -> tuple[MeasuredCost, str, dict[str, str]]:
    """The plan costs fitted to ``bench``'s rows (their notes are what the planner prints), where the
    all-reduce comes from, and what was not measured with what is charged instead.

    Raises:
        RuntimeError: the rollout sweep measured nothing (out of memory at one sample).
    """
    notes = [f"from `{SOURCE}` (one process on {bench.cfg.model.device}, {bench.cfg.model.name} "
             f"{bench.cfg.model.preset}): fits of its sweeps, relative least squares"]
    not_measured = {
        "dispatch_s": "the per-token overhead between actors (the call's trip, the coordinator's handling) "
                      "needs actor processes: 0 charged; `bench bubbles --real` measures it on a CPU",
        "contention": "how busy processes on one host slow each other: none applied (each device owns its "
                      "compute, as on a GPU fleet); `bench bubbles --real` measures it for CPU actors",
        "placement_error": "the simulator's error on the ratio of two splits needs real runs: plan "
                           "--tolerance defaults to 0"}
    step = _fit(bench.results, "rollout step")
    if step is None:
        raise RuntimeError("the rollout sweep measured nothing (out of device memory at one sample)")
    fits = {"rollout": (_one(bench.results, "rollout start", not_measured), step[1])}
    notes.append(f"rollout step: {step[0] * 1e3:.3f} ms/step + {step[1] * 1e3:.4f} ms/sample-step (largest "
                 f"relative residual {step[2]:.0%}); a token's overhead: one fragment's start")
    fits.update(_sweep_fits(bench.results, notes, not_measured))
    if bench.stale and bench.cfg.train.check_parity:
        parity = _one(bench.results, "stale-batch parity", not_measured)
        fits["train"] = (fits["train"][0] + parity, fits["train"][1])
        notes.append("train: each token's overhead includes a stale batch's parity recompute")
    fits["optim"] = (_one(bench.results, "optimizer step", not_measured), 0.0)
    fits["publish"] = (_one(bench.results, "publication (zmq)", not_measured), 0.0)
    allreduce, source = _allreduce(bench, notes, not_measured)
    notes += [f"not measured: {k}: {v}" for k, v in not_measured.items()] + bench.notes
    return MeasuredCost(fits, 0.0, allreduce, None, step[0], tuple(notes)), source, not_measured


def per_sample(bench: TokenBench, fits: dict[str, Line]) -> dict[str, Any]:
    """One sample's cost on each side, from the sweeps' per-unit terms (tokens' fixed overheads left out): the
    rollout's ``num_steps`` sample-steps (+ decode and score), the trainer's rows, and their ratio, beside the
    simulator's (DESIGN.md §10: ~0.3 for one trained step to ~4.5 for DiffusionNFT at 9 noise levels)."""
    cfg = bench.cfg
    steps, rows = cfg.rollout.num_steps, bench.rows_per_sample
    rollout, reward, train = steps * fits["rollout"][1], fits["reward"][1], rows * fits["train"][1]
    out: dict[str, Any] = {
        "algorithm": cfg.train.algorithm, "num_steps": steps, "rows": rows,
        "nograd_forwards_per_row": bench.nograd_forwards,
        "rollout_s": rollout, "reward_s": reward, "train_s": train,
        "train_to_rollout": train / rollout if rollout else None,
        "train_to_rollout_and_reward": train / (rollout + reward) if rollout + reward else None,
        # the simulator's count: transformer passes of one sample on each side
        "passes": {"rollout": steps * bench.passes,
                   "train": rows * bench.passes * (TRAIN_PASSES + bench.nograd_forwards)},
    }
    out["passes"]["train_to_rollout"] = out["passes"]["train"] / out["passes"]["rollout"]
    return out


def token_report(bench: TokenBench) -> dict[str, Any]:
    """The rows (``testbed``: the catalog device they price) and the costs file's ``calibration``."""
    from digenrl.sim.calibration import calibrated_params

    cost, source, not_measured = token_costs(bench)
    sample = per_sample(bench, cost.fits)
    calibration = cost.to_calibration()
    calibration["allreduce"]["source"] = source
    calibration.update(source=SOURCE, not_measured=not_measured, device=bench.catalog,
                       sizes={"fragment_samples": bench.fragment, "rollout_batch": bench.sizes.rollout_batch,
                              "train_pack": bench.sizes.train_pack})
    m, params = bench.cfg.model, calibrated_params()
    model, m_alg = f"{m.name}-{m.preset}", bench.cfg.train.algorithm
    return {
        "bench": "tokens", "train_passes": TRAIN_PASSES,
        "model": {"name": m.name, "preset": m.preset, "dtype": m.dtype, "device": m.device,
                  "threads": torch.get_num_threads() if bench.device.type == "cpu" else None,
                  "algorithm": m_alg, "cfg_passes": bench.passes, "shape": asdict(bench.shape),
                  "pass_flops": bench.pass_flops,
                  "decode_flops": bench.decode_flops, "trainable_params": bench.profile.trainable_params},
        "peak": {"flops_per_s": bench.peak, "source": bench.peak_source},
        "prediction": {"catalog_device": bench.catalog, "mfu_rollout": params.mfu_rollout,
                       "mfu_train": params.mfu_train, "pass_latency_s": params.pass_latency_s,
                       "profile": "the config's model as built (transformer, resolution, CFG, trainable set) "
                                  "priced by sim/cost.py CostModel with the calibrated parameters"},
        "rows": [{**r.to_json(), "testbed": bench.catalog, "model": model} for r in bench.results],
        "per_sample": sample,
        "calibration": calibration,
    }
