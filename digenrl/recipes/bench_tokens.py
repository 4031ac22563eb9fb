"""``digenrl bench tokens``: what each token of a config costs on the device it names, beside the simulator.

One process, the config's model at its configured size (a tiny preset on a CPU, ``model.preset =
"random"`` at real size on a GPU) on ``model.device``; on a CPU with ``placement.actor_threads`` torch
threads, what one actor process has. Each measurement runs the code a run runs:

* **rollout step**: ``FragmentEngine.advance`` of step 0 of one fragment of B samples, as a rollout actor runs
  it: the rollout's ``model.velocity`` (the config's CFG, LoRA merged as the rollout samples), then Flow-GRPO's
  SDE step with its seeded noise and the recorded transitions (stochastic and trained under the usual windows),
  or a forward-process method's ODE step (``rollout.solver``), which keeps nothing; B = 1, 2, 4, ... up to
  ``max_batch`` (default: the config's rollout token);
* **rollout start**: ``FragmentEngine.fresh`` of the config's fragment (prompts encoded, initial noise);
* **train pass**: the algorithm's ``backward`` of R rows in one packed pass, as the trainer runs a token (its
  version one ahead of the rows' under a one-step-stale schedule): Flow-GRPO's transitions sampled from the model
  by one SDE step (real shapes and log-probs), with the KL reference forward when ``train.kl_beta > 0``; a
  forward-process method's rows of the clean samples the rollout's ODE made, re-noised at the levels the trainer
  draws, with the no-grad forwards its loss runs (DiffusionNFT: the old policy, the reference); on the model as
  ``prepare_for_training`` sets it up (gradient checkpointing, fp32 master LoRA, the slow copy); R up to
  ``max_rows`` (default: the config's train token). The no-grad forwards a row runs are counted on a probe pass
  (velocity calls without gradient per trained row) and priced with it. A one-step-stale schedule with
  ``train.check_parity`` also pays, per train token, the trainer's parity recompute of a stale batch;
* **decode** (``decode_in_chunks``, ``rollout.decode_batch``) and **reward score** (the config's reward,
  the host function a reward actor runs), B up to one fragment's samples;
* **optimizer step**: the trainer's (divide, clip, AdamW step, zero) over the trainable set;
* **publication over the zmq lane** (the gloo / nccl lanes need a second process: not measured): the
  trainable state dict, ``pack_buckets``, a ``ZmqTransport`` send to a second endpoint of this process
  (codec, same-host shared memory), ``unpack_buckets``, ``WeightStore.stage`` and the acknowledgement,
  what the lead trainer's ``publish`` span covers; the rollout's load of a staged version is its own row;
* **all-reduce** (CPU): the trainer group's all-reduce of the trainable set between two gloo processes
  (``measure_costs.measure_allreduce``, as ``bench bubbles --real`` measures it).

Times are medians of up to ``repeats`` runs after a warm-up run, each between device synchronisations
(``torch.cuda.synchronize`` on CUDA); a sweep stops at the first size that runs out of device memory.
FLOPs are the simulator's count (``sim/flops.py``) of the config's transformer as built (its config,
resolution, text length and the CFG passes its velocity makes), ``TRAIN_PASSES`` plus the counted no-grad
forwards per trained row as the cost model charges, and the decode counted by ``FlopCounterMode`` on the
config's own VAE (as
``sim/profiles.py`` counts the real one). MFU = FLOPs / (seconds x peak): the catalog's peak
(``sim/devices.py``) on a known GPU; a CPU has no catalog entry, so there the peak is a matmul in the
model's dtype measured here at the same thread count. Beside each, the simulator's prediction:
``sim/cost.py`` ``CostModel`` with the calibrated parameters the planner uses, on the catalog device
``plan --fleet`` names (``measured`` on a CPU), for a profile of the config's model as built.

The report's ``per_sample`` is one sample's cost on each side from the sweeps' per-unit terms: the rollout's
``num_steps`` sample-steps and the trainer's rows per sample, and their trainer:rollout ratio (DESIGN.md §10).
The report's ``calibration`` is the costs file of ``digenrl plan CONFIG --fleet Nx<device> --costs OUT``
(``MeasuredCost.from_calibration``, costs version 3) fitted to these rows; ``not_measured`` (and the
notes the planner prints) say what one process cannot measure and what is charged instead.

The CUDA paths (synchronisation, the catalog peak, out-of-memory stops) have never run on a GPU.

The harness every measurement shares is ``_token_bench.py``, the measurements are in ``_token_measurements.py``,
the costs file and the report in ``_token_costs.py``; this module runs them (each module imports only those
below it: harness <- measurements, costs <- this one).
"""

from __future__ import annotations

from typing import Any

import torch

from digenrl.config import Config
from digenrl.recipes._token_bench import ConfigProfile, Measurement, Progress, TokenBench
from digenrl.recipes._token_costs import catalog_allreduce, fit_line, token_report
from digenrl.recipes._token_measurements import token_steps

__all__ = ["Measurement", "ConfigProfile", "TokenBench", "run_steps", "run_token_bench", "fit_line",
           "catalog_allreduce"]


def run_steps(bench: TokenBench, progress: Progress | None = None) -> list[Measurement]:
    """Run ``bench``'s measurements (``token_steps``) in order; a sweep that runs out of device memory stops there
    (noted)."""
    steps, stopped = token_steps(bench), set()
    for i, (label, sweep, step) in enumerate(steps):
        if progress:
            progress(label, i, len(steps))
        if sweep in stopped:
            continue
        try:
            step()
        except torch.cuda.OutOfMemoryError:
            stopped.add(sweep)
            bench.notes.append(f"{label}: out of device memory; {sweep} measured up to the size before")
            torch.cuda.empty_cache()
    if progress:
        progress("done", len(steps), len(steps))
    return bench.results


def run_token_bench(cfg: Config, *, max_batch: int = 0, max_rows: int = 0, repeats: int = 5, allreduce: bool = True,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Measure every token of ``cfg`` on its device (see the module docstring); returns the report.

    On a CPU the process runs ``placement.actor_threads`` torch threads meanwhile (restored after).
    """
    threads = torch.get_num_threads()
    if cfg.model.device == "cpu":
        torch.set_num_threads(cfg.placement.actor_threads)
    try:
        bench = TokenBench(cfg, max_batch=max_batch, max_rows=max_rows, repeats=repeats, allreduce=allreduce)
        run_steps(bench, progress)
        if cfg.model.compile:  # what was compiled: a pass that ran eager (a graph break, a skipped frame) shows here
            from torch._dynamo.utils import counters

            bench.notes.append(f"model.compile = {cfg.model.compile!r}: {counters['stats']['unique_graphs']} graph(s) "
                               f"compiled, {counters['aot_autograd']['total']} with autograd; graph breaks "
                               f"{sum(counters['graph_break'].values())}")
        return token_report(bench)
    finally:
        torch.set_num_threads(threads)
