"""The single-process reference loop (the colocated path): every step of an iteration in order.

One Flow-GRPO iteration::

    sample P prompts -> repeat each G times -> SDE rollout (store trained transitions, l_old)
    -> decode -> reward -> group advantages (drop zero-std groups)
    -> TSP-packed forward/backward over all trained transitions -> clip grad norm -> AdamW step

A forward-process one (``train.algorithm = nft | awm``) runs the ODE instead (DiffusionNFT with its old
policy), keeps only the clean latents, trains every sample's rows at the noise levels drawn for it, and after
the step moves the algorithm's slow copy (``digenrl.algorithms``).

It is a library call, ``train(config) -> history``, and ``digenrl run ... --set schedule.name=colocated``.
It writes what an actor run writes: ``metrics.jsonl`` (one JSON object per iteration, the same schema),
``config.json``, captioned sample grids (a fixed evaluation every ``log.image_every`` versions:
:mod:`digenrl.recipes.samples`), checkpoints in the actors'
format (``--resume`` continues from them), ``trace.json``, ``gantt.png`` and ``summary.json`` of its one
device's phases (rollout, reward = decode + score, train, optim), the trained weights, and the live
table (plain lines outside a terminal). SIGINT and SIGTERM stop it in order (:mod:`digenrl.roles.stop`).
Everything is seeded from ``log.seed`` and the iteration: prompts, initial noise, transition
noise and step windows, so a run is reproducible and a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from digenrl.algorithms import Algorithm, Backward, algorithm_for
from digenrl.config import Config
from digenrl.data.images import reward_inputs
from digenrl.data.prompts import batch_prompts, load_prompts
from digenrl.models import GeneratorModel, decode_in_chunks, repeat_cond
from digenrl.models.experts import expert_splitter
from digenrl.models.lora import load_trainable, sampling, save_trainable
from digenrl.policy import build_model, trained_steps
from digenrl.recipes.checkpoint import find_checkpoint, load_state, write_checkpoint
from digenrl.recipes.outputs import fresh_out_dir
from digenrl.recipes.samples import write_evaluation, write_rollout_samples, rollout_due
from digenrl.rewards import build_reward
from digenrl.rewards.base import GuardedReward
from digenrl.rewards.failures import FailureBudget
from digenrl.rewards.user import allow_user_rewards
from digenrl.rl.advantages import reward_advantages
from digenrl.roles.evaluation import evaluate, evaluation_due, evaluation_prompts
from digenrl.rl.loss import Sums, reduce_stats
from digenrl.rl.lr import set_lr
from digenrl.rl.forward import velocity_probe
from digenrl.rl.noise import initial_keys, initial_latents, probe_direction, transition_noise
from digenrl.rl.ode import ode_step
from digenrl.rl.flash import run_tail
from digenrl.rl.rollout import rollout_steps
from digenrl.rl.tsp import parity_recompute
from digenrl.roles.stop import RunInterrupted, StopRequest, on_signals
from digenrl.schedule.base import Device, Role, Workload
from digenrl.telemetry.live import LiveDisplay
from digenrl.telemetry.memory import peak_memory
from digenrl.telemetry.metrics import (LOSS_KEYS, MetricsLog, StepMetrics, algorithm_fields, expert_fields,
                                       parity_fields, parity_warning)
from digenrl.telemetry.spans import SpanLog
from digenrl.telemetry.stats import run_stats
from digenrl.telemetry.trace import write_artifacts

__all__ = ["ColocatedRun", "setup", "iteration", "train", "default_out_dir", "save_grid", "summarize"]

log = logging.getLogger(__name__)

PARITY_SAMPLE_ROWS = 16  # rows recomputed for train.check_parity where training computes none
DEVICE = Device("colocated", Role.HYBRID)  # the one device: it samples, scores and trains


@dataclass
class ColocatedRun:
    """Everything one run holds, built by :func:`setup`."""

    cfg: Config
    model: GeneratorModel
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    reward: GuardedReward
    reward_budget: FailureBudget | None  # stops the run when penalties are no longer occasional
    prompts: list[str]
    sigmas: torch.Tensor
    algorithm: Algorithm  # train.algorithm: rows, loss, slow copies and the weights sampling uses
    t0: float = 0.0  # time.perf_counter() at the start of the run
    last_end: float = 0.0  # ... at the end of the previous iteration
    spans: SpanLog | None = None  # every phase of every iteration, as the actors' runs record theirs
    eval_prompts: list[str] | None = None  # the fixed evaluation's prompts (log.samples = "fixed"), drawn once
    last_rewards: torch.Tensor | None = None  # the latest iteration's per-sample rewards (log.samples = "rollout")


def default_out_dir() -> Path:
    """``runs/<timestamp>`` (``-2``... when another run took that second's)."""
    return fresh_out_dir()


def setup(cfg: Config) -> ColocatedRun:
    """Build model (with LoRA or full fine-tuning), optimizer, reward and prompts.

    Raises:
        ConfigError: an invalid model, reward or data setting.
    """
    model, params = build_model(cfg)  # the same policy the disaggregated roles build
    t = cfg.train
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay, eps=t.eps)
    r = cfg.reward
    allow_user_rewards(r.models)  # this process's own config: its Python rewards may be imported here
    reward = build_reward(r.weights, **r.build_options(cfg.model.device))
    prompts = load_prompts(cfg.data.prompt_set, cfg.data.prompts, cfg.data.prompt_file)
    return ColocatedRun(
        cfg=cfg,
        model=model,
        params=params,
        optimizer=opt,
        reward=reward,
        reward_budget=FailureBudget.for_config(r),
        prompts=prompts,
        sigmas=model.sigmas(cfg.rollout.num_steps),
        algorithm=algorithm_for(cfg, model, trains=True),
        t0=time.perf_counter(), last_end=time.perf_counter(), spans=SpanLog(time.time()),
        eval_prompts=evaluation_prompts(prompts, cfg.log.seed, cfg.log.images_per_grid),
    )


def iteration(run: ColocatedRun, it: int) -> tuple[dict[str, Any], torch.Tensor, list[str]]:
    """One iteration of ``train.algorithm``; returns its metrics line (:class:`StepMetrics`), the decoded images
    and the prompts."""
    cfg, model, algo = run.cfg, run.model, run.algorithm
    ro, tr = cfg.rollout, cfg.train
    t0 = time.perf_counter()
    # The dataset position is the iteration: the same prompts as the disaggregated coordinator's batch.
    chosen = batch_prompts(run.prompts, cfg.log.seed, it, ro.prompts_per_batch)
    g = ro.group_size
    prompts = [p for p in chosen for _ in range(g)]
    groups = torch.arange(len(chosen)).repeat_interleave(g)
    cond = repeat_cond(model.encode_prompts(chosen), g)
    seed = cfg.log.seed * 1_000_003 + it
    gen = torch.Generator().manual_seed(seed)
    # Per-sample noise (digenrl/rl/noise.py): the same samples as an on-policy disaggregated run.
    sids = list(range(len(prompts)))
    x0 = initial_latents(model, cfg.log.seed, it, initial_keys(sids, g, ro.same_init_noise and algo.coupled))
    # the algorithm's sampling weights (DiffusionNFT: the old policy), LoRA merged into fp32 weights, as the
    # rollout actors sample
    with algo.sampling(), sampling(model):
        if algo.coupled:
            plan = algo.step_plan(groups.tolist(), sids, seed, it)  # version it samples batch it
            tail = algo.ode_tail(it)  # (MixGRPO-Flash: its own solver after the window)
            res = rollout_steps(model.velocity, x0, cond, run.sigmas, plan, 0, ro.num_steps if tail is None else tail[0],
                                noise_level=ro.noise_level, kind=ro.sde,  # type: ignore[arg-type]
                                noise=lambda i: transition_noise(cfg.log.seed, it, sids, i, x0,
                                                                 active=plan.stochastic[:, i]),
                                policy_version=it)
            clean = res.x if tail is None else run_tail(model.velocity, res.x, cond, tail[1], res.x0, tail[0],
                                                        ro.num_steps)[0]
        else:
            clean, probe = _integrate(model, x0, cond, run.sigmas, algo.solver, cfg.log.seed)
    t1 = time.perf_counter()
    images = decode_in_chunks(model, clean, ro.decode_batch)
    t2 = time.perf_counter()
    failures = run.reward.failures
    # rewards read the prompts' texts; an edit reward also the samples' input images (data/images.py)
    texts, sources = reward_inputs(prompts, images, run.reward.uses_sources)
    rewards = run.reward.score(images, texts, sources=sources)
    run.last_rewards = rewards
    failed = len(prompts) if run.reward.failures > failures else 0  # a failed call penalises all its samples
    if run.reward_budget is not None:  # before training on penalties
        run.reward_budget.add(it, failed, len(prompts), run.reward.last_error)
    t3 = time.perf_counter()
    comps = {} if failed else getattr(run.reward.inner, "last_components", {})  # a failed call left stale ones
    r = cfg.reward
    adv = reward_advantages(rewards, groups, components=comps, weights=r.weights, normalize=r.normalize,  # type: ignore[arg-type]
                            penalty=r.penalty, std=tr.adv_std, clip=tr.adv_clip)  # type: ignore[arg-type]
    a = adv.advantages
    if tr.control == "shuffled":  # negative control: break the sample <-> advantage pairing
        a = a[torch.randperm(a.shape[0], generator=gen)]
    elif tr.control == "negated":
        a = -a
    # The algorithm's rows of what the rollout stored, as a trainer gets them from a fragment; equal-reward
    # groups are left out where the algorithm drops them (Flow-GRPO), trained where not (both NFT references).
    keep = ~adv.zero_std if algo.drops_zero_std else torch.ones(len(prompts), dtype=torch.bool)
    stored = res.transitions.stored() if algo.coupled else {"y": clean, "probe": probe}
    batch: Any = algo.token_rows(stored, (0, len(prompts) * trained_steps(cfg)), keep, it, sids, it)
    if batch is None:  # every group had identical rewards: nothing to learn from
        batch = res.transitions.rows(slice(0, 0))
    batch = batch.to(clean.device)
    rows_trained = len(res.transitions) if algo.coupled else len(batch)
    sums = _backward(run, batch, cond, a, it)
    if algo.coupled and not len(batch) and tr.check_parity:  # nothing trained: parity on a sample of the dropped rows
        sums.append(parity_recompute(model.velocity, res.transitions, cond, PARITY_SAMPLE_ROWS))
    stats = reduce_stats(sums)
    t_step = time.perf_counter()
    stats["grad_norm"] = _optimizer_step(run, it) if len(batch) else 0.0
    terms = algo.after_step(it + 1)  # the slow copies follow the weights of version it + 1
    t4 = time.perf_counter()
    if run.spans is not None:
        _record(run.spans, it, len(prompts), [("rollout", t0, t1), ("reward", t1, t3), ("train", t3, t_step),
                                              ("optim", t_step, t4)])
    seconds, run.last_end = t4 - run.last_end, t4
    bubble = max(0.0, 1.0 - (t4 - t0) / seconds)  # the one process idles only between iterations (files)
    metrics = StepMetrics(
        step=it, version=it + 1, time=t4 - run.t0, seconds=seconds, samples_per_s=len(prompts) / seconds,
        reward_mean=adv.stats["reward_mean"], reward_std=adv.stats["reward_std"],
        reward_std_mean=adv.stats["reward_std_mean"], reward_failures=failed,
        zero_std_ratio=adv.stats["zero_std_ratio"], adv_abs_mean=adv.stats["adv_abs_mean"],
        rows_trained=rows_trained, rows_kept=len(batch), **{k: stats.get(k, 0.0) for k in LOSS_KEYS},
        grad_norm=stats["grad_norm"], max_staleness=0, bubble_ratio={"colocated": bubble, "overall": bubble},
        t_rollout=t1 - t0, t_decode=t2 - t1, t_reward=t3 - t2, t_train=t4 - t3,
        dropped_messages=0,  # one process, no socket: nothing to drop
        rewards={name: float(s.mean()) for name, s in comps.items()}, **parity_fields(stats),
        rows_by_expert=expert_fields(stats), algorithm=algorithm_fields(stats, terms),
    )
    line = metrics.line()
    if (warning := parity_warning(line, tr.parity_tolerance)) is not None:
        log.warning(warning)
    return line, images, prompts


def _record(spans: SpanLog, it: int, samples: int, phases: list[tuple[str, float, float]]) -> None:
    """The iteration's phases as spans of the one device (``time.perf_counter`` stamps, made wall-clock)."""
    offset = time.time() - time.perf_counter()
    for kind, start, end in phases:
        spans.add(DEVICE.name, kind, it, 0, it, start + offset, end + offset,
                  samples=samples if kind in ("rollout", "reward") else 0)


@torch.no_grad()
def _integrate(model: GeneratorModel, x: torch.Tensor, cond: dict[str, torch.Tensor], sigmas: torch.Tensor,
               solver: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward-process rollout: the deterministic ODE from ``x`` to the clean latents, and the first step's
    velocity probes (parity; ``rl.forward.velocity_probe``)."""
    prev, probe = None, torch.zeros(0)
    grid = sigmas.float().to(x.device)
    for i in range(sigmas.shape[0] - 1):
        v = model.velocity(x, grid[i].expand(x.shape[0]), cond)
        probe = velocity_probe(v, probe_direction(seed, v.shape[1:])) if i == 0 else probe
        x, prev = ode_step(solver, x, v, sigmas, i, prev)
    return x, probe


def _backward(run: ColocatedRun, batch: Any, cond: dict[str, torch.Tensor], adv: torch.Tensor,
              version: int | None = None) -> list[Sums]:
    """The iteration's forward/backward over its trained rows, on the model's device.

    The rows and the conditioning were made there by the rollout; the advantages come from the reward,
    on the host, and are placed with them here. The loss is the mean over the rows. ``version``: the weights'
    (default: the rows', on-policy, as every colocated iteration is).
    """
    run.optimizer.zero_grad(set_to_none=True)
    if len(batch) == 0:  # every group had identical rewards: nothing to learn from
        return []
    plan = Backward("packed", run.cfg.train.rows_per_pass or None, experts=expert_splitter(run.model),
                    normalizer=float(len(batch)))
    return run.algorithm.backward(batch, cond, adv.to(batch.sigma.device), plan,
                                  version=batch.policy_version if version is None else version)


def _optimizer_step(run: ColocatedRun, step: int) -> float:
    """Clip the accumulated gradients and step; returns the gradient norm (read once: it decides the step).

    Raises:
        FloatingPointError: a non-finite gradient norm (the step is refused).
    """
    tr = run.cfg.train
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, tr.max_grad_norm))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm is {grad_norm}; refusing the optimizer step")
    set_lr(run.optimizer, tr.lr, tr.lr_warmup, step)
    run.optimizer.step()
    return grad_norm


def save_grid(images: torch.Tensor, path: Path, columns: int = 8, prompts: list[str] | None = None,
              rewards: list[float | None] | None = None, tile_px: int = 256, title: str = "") -> None:
    """Tile ``[N, 3, H, W]`` (or the first frame of videos) into one PNG, each tile enlarged to ``tile_px`` and
    captioned with its prompt and reward when given (:func:`digenrl.telemetry.grid.render_grid`)."""
    from digenrl.telemetry.grid import render_grid

    render_grid(images, prompts, rewards, columns=min(columns, int(images.shape[0])), tile_px=tile_px,
                title=title).save(path)


def train(
    cfg: Config,
    *,
    out_dir: str | Path | None = None,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
    write_files: bool = True,
    resume: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Run ``cfg.train.iterations`` iterations; returns one metrics line per iteration.

    The outputs are an actor run's: ``config.json``, ``metrics.jsonl``, sample grids, checkpoints
    every ``log.checkpoint_every`` iterations (the actors' format), ``trace.json``, ``gantt.png`` and
    ``summary.json`` of the one device's phases, and ``log.live``'s table.

    Args:
        cfg: the validated config.
        out_dir: where to write outputs (default ``log.out``, else ``runs/<timestamp>``).
        on_iteration: called with each iteration's metrics (progress display).
        write_files: False keeps the run in memory (tests, benchmarks).
        resume: a run directory, checkpoints directory or ``step-*`` checkpoint: continue from its weights,
            optimizer state and metrics (every iteration is seeded by its number, so a resumed run logs
            the metrics of an uninterrupted one).

    Raises:
        ConfigError: invalid settings found while building components, or a bad checkpoint.
        RewardError: a reward failed and ``reward.on_error = "raise"``.
        RewardFailing: under ``"penalty"``, more than ``reward.max_failure_fraction`` of the samples of
            the last ``reward.failure_window`` iterations failed.
        FloatingPointError: a non-finite gradient norm.
        RunInterrupted: SIGINT (at once) or SIGTERM (after the iteration under way and its checkpoint, within
            ``log.term_grace`` seconds) stopped the run; its outputs are written (:mod:`digenrl.roles.stop`).
    """
    if torch.get_num_threads() != cfg.placement.threads:
        torch.set_num_threads(cfg.placement.threads)
    torch.manual_seed(cfg.log.seed)
    out = Path(out_dir or cfg.log.out or default_out_dir())
    with on_signals(StopRequest(cfg.log.term_grace)) as stop:
        try:
            with stop.interruptible():  # building the model and reading the checkpoint: nothing written yet
                run = setup(cfg)
                base, history = _resume(run, resume) if resume is not None else (0, [])
        except stop.stopped():
            done = load_state(find_checkpoint(resume))["version"] if resume is not None else 0
            raise RunInterrupted(stop.signum or signal.SIGINT, 0).at(done, out if write_files else None) from None
        title = f"digenrl {cfg.schedule.name}"
        if base >= cfg.train.iterations:  # nothing left to do (and nothing of the finished run is overwritten)
            if cfg.log.live:
                LiveDisplay.show(cfg.train.iterations, title, history)
            return history
        if write_files:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            log.debug("run: writing to %s", out)
        _loop(run, base, history, out if write_files else None, stop, on_iteration)
    if stop.signum is not None:
        raise RunInterrupted(stop.signum, 0).at(len(history), out if write_files else None)
    if write_files:
        save_trainable(run.model, out / "trainable.safetensors")
    return history


def _loop(run: ColocatedRun, base: int, history: list[dict[str, Any]], out: Path | None, stop: StopRequest,
          on_iteration: Callable[[dict[str, Any]], None] | None) -> None:
    """Iterations ``base`` on, each with its metrics line, live-table row, sample grid and checkpoint, until the
    last or a signal: SIGINT leaves the iteration under way, SIGTERM stops after it (and its checkpoint)."""
    cfg = run.cfg
    metrics = MetricsLog.for_run(cfg.log, cfg.to_dict(), out, history)
    run.last_end = time.perf_counter()  # (starting a W&B run takes seconds: no step's)
    live = LiveDisplay(cfg.train.iterations, f"digenrl {cfg.schedule.name}", history) if cfg.log.live else None
    try:
        with live or contextlib.nullcontext():
            if out is not None:
                with stop.interruptible():
                    _write_evaluation(run, out, metrics, base)  # the weights the run starts from
            for it in range(base, cfg.train.iterations):
                with stop.interruptible():
                    line, images, prompts = iteration(run, it)
                terminating = stop.checkpoint_due  # a SIGTERM that came later stops at the next boundary
                history.append(line)
                metrics.write(line)
                if live is not None:
                    live.update(line)
                if out is not None:
                    _write_outputs(run, out, it, images, history, metrics, prompts, checkpoint=terminating)
                    with stop.interruptible():  # after the checkpoint: a Ctrl-C here loses only the grid
                        _write_evaluation(run, out, metrics, it + 1)
                log.debug("iteration %d: %s", it, line)
                if on_iteration is not None:
                    on_iteration(line)
                if terminating or stop.now:
                    break
    except stop.stopped():
        pass  # the iteration under way is lost; the last checkpoint holds what came before it
    finally:
        metrics.close()
        if out is not None:
            _write_timeline(run, out, base)


def _resume(run: ColocatedRun, path: str | Path) -> tuple[int, list[dict[str, Any]]]:
    """Load a checkpoint's weights and optimizer state into ``run``; returns its version and metrics."""
    ckpt = find_checkpoint(path)
    state = load_state(ckpt)
    if state.get("schedule", "colocated") != "colocated":
        log.warning("resuming the colocated loop from a checkpoint of a %r run (%s)", state["schedule"], ckpt)
    load_trainable(run.model, ckpt / "trainable.safetensors")
    # A local file this program wrote (never network data), read to the host: a GPU checkpoint resumes anywhere.
    run.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu"))
    run.algorithm.load_extra_files(ckpt)  # DiffusionNFT's old policy, AWM's EMA policy
    version = state["version"]
    log.info("resuming from %s at version %d", ckpt, version)
    return version, list(state.get("history", []))[:version]


def _write_evaluation(run: ColocatedRun, out: Path, metrics: MetricsLog, version: int) -> None:
    """Version ``version``'s fixed-evaluation grid when it is due (``log.samples = "fixed"``); the model holds
    that version's weights now. Its RNG is its own (:mod:`digenrl.roles.evaluation`): training does not change.
    Its time is no step's: the next step's ``seconds`` (and samples/s, bubble) start after it."""
    cfg = run.cfg
    if cfg.log.samples != "fixed" or not evaluation_due(cfg, version) or run.eval_prompts is None:
        return
    t0 = time.perf_counter()
    write_evaluation(out, metrics, cfg, evaluate(run.model, cfg, run.eval_prompts, run.reward, version))
    run.last_end += time.perf_counter() - t0


def _write_outputs(run: ColocatedRun, out: Path, it: int, images: torch.Tensor, history: list[dict[str, Any]],
                   metrics: MetricsLog | None = None, prompts: list[str] | None = None,
                   checkpoint: bool = False) -> None:
    """Iteration ``it``'s checkpoint and (``log.samples = "rollout"``) its samples' grid, when they are due
    (``checkpoint``: due now, SIGTERM's; not with ``log.checkpoint_every = 0``)."""
    lg, last = run.cfg.log, it == run.cfg.train.iterations - 1
    if lg.samples == "rollout" and rollout_due(run.cfg, it) and metrics is not None and prompts is not None:
        rewards = run.last_rewards.tolist() if run.last_rewards is not None else [None] * len(prompts)
        write_rollout_samples(out, metrics, run.cfg, it, images, prompts, rewards)
    if lg.checkpoint_every and ((it + 1) % lg.checkpoint_every == 0 or last or checkpoint):
        # The actors' checkpoint: the trainer's files and the coordinator's state (nothing is in flight here).
        state = {"version": it + 1, "next_batch": it + 1, "seed": lg.seed, "history": history,
                 "schedule": run.cfg.schedule.name, "in_flight": [], "lost_devices": []}
        write_checkpoint(out / "checkpoints", it + 1, state, lambda d: _write_trainer(run, d),
                         keep=lg.keep_checkpoints)


def _write_trainer(run: ColocatedRun, directory: Path) -> None:
    from safetensors.torch import save_file

    save_trainable(run.model, directory / "trainable.safetensors")
    torch.save(run.optimizer.state_dict(), directory / "optimizer.pt")
    for stem, sd in run.algorithm.extra_state().items():  # DiffusionNFT's old policy, AWM's EMA policy
        save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / f"{stem}.safetensors"))


def _write_timeline(run: ColocatedRun, out: Path, base: int) -> None:
    """``trace.json``, ``gantt.png`` and ``summary.json`` of this process's iterations (from ``base`` on)."""
    if run.spans is None:
        return
    cfg, ro = run.cfg, run.cfg.rollout
    workload = Workload(cfg.train.iterations - base, ro.prompts_per_batch, ro.group_size, ro.num_steps,
                        trained_steps(cfg))
    result = run.spans.timeline(cfg.schedule.name, [DEVICE], workload, time.time() - run.spans.t0)
    write_artifacts(out, result, cfg.log.trace, cfg.log.gantt)
    (out / "summary.json").write_text(json.dumps({**run_stats(result), "lost_devices": [], "admitted": [],
                                                  "peak_memory": {DEVICE.name: peak_memory(cfg.model.device)}},
                                                 indent=1))


def summarize(history: list[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """First/last-window reward means and their difference."""
    rewards = [h["reward_mean"] for h in history]
    w = min(window, max(len(rewards) // 2, 1))
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    return {"first": first, "last": last, "gain": last - first, "window": w, "iterations": len(rewards)}
