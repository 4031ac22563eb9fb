"""Learning per second: Flow-GRPO, DiffusionNFT and AWM on the tiny Qwen-Image, same machine, same budget.

    python bench/learning_algorithms.py --figures docs/ --clock cpu   # the README's figure: 3 seeds x (Flow-GRPO, nft, awm + controls)
    python bench/learning_algorithms.py --algorithm nft --control shuffled --seconds 100 --json runs/nft.json  # one run
    python bench/learning_algorithms.py --stale docs/                 # nft under async1 beside colocated, one seed

Every run trains ``configs/tiny-qwenimage.toml`` colocated (``bench/learning.py``'s loop: one process, one
torch thread) with ``train.algorithm`` and the settings of :data:`SETTINGS`, for ``--seconds`` seconds of
training (the evaluations excluded: the clock stops while they run), and scores its weights on
``bench/learning.py``'s fixed evaluation: 3-step Euler ODE samples of all 168 prompts from the same 4
noises each, the same judge for every algorithm whatever its rollout samples (an SDE, dpm2, 6 steps), at
the start, after each of ``--eval-at`` seconds and at the end. The published speed-ups (DiffusionNFT up to
25x, AWM up to 24x over Flow-GRPO) count optimizer steps; a user pays seconds, and here an NFT or AWM
iteration costs twice a Flow-GRPO-Fast one (its trainer runs three forwards per row, the trained, the
old/EMA policy's and the reference's, on two rows per sample; Flow-GRPO-Fast trains one transition per
sample). ``gain`` = fixed evaluation at the end - at the start; the criterion (issue 36): gain >= 0.10
and >= 5x the shuffled-advantage control's |gain| (``train.control = "shuffled"``: the advantages permuted
across samples, no link to the reward) for each of nft and awm.

The clock: ``--clock wall`` (default) counts wall-clock seconds, ``--clock cpu`` the run's process CPU
seconds, which for a one-thread run are the wall clock of a core of its own. Every run records both
(``cpu_share`` = CPU / wall). The README's figure is on the CPU clock: the 2-core machine it was measured on
is shared with other work, and its runs got 0.33-0.98 of a core (other sessions' test suites), so equal
wall-clock budgets would have been budgets of unequal compute. Contention still costs a little CPU time
(cache, memory bandwidth): Flow-GRPO took 1.62-1.70 CPU s per iteration between runs.

Measured (``--figures --clock cpu``, 150 s per run, two runs at a time, one thread each): the README's table and
``docs/learning-algorithms.json`` (its ``settings`` are :data:`SETTINGS`).

Settings (``SETTINGS``) and why. Flow-GRPO is the shipped config (lr 1e-3, KL 0.1, the SDE and training at
the first of 3 steps). DiffusionNFT and AWM started from the references' recipes (ALGORITHMS-FORWARD §3-4)
at the config's lr 1e-3. Seed 0, CPU clock, fixed-evaluation gain / shuffled control's gain (its range over
the run's evaluations), iterations done:

* nft as shipped (beta 1, KL 1e-4, ``floor(0.99 x 3) = 2`` levels of the 3-step grid per sample, dpm2 rollout;
  120 wall-clock s): +0.113 / -0.172 (-0.217..0), 21 iterations: the control's undirected walk costs more
  than the method gains (the pretrained model sits near an optimum of what it draws; ``bench/learning.py``
  found the same for Flow-GRPO without its KL). The KL to the reference holds it, 100 s, ~31 iterations:
  KL 0.1 +0.123 / +0.013 (-0.084..+0.030); KL 0.3 +0.108 / -0.009 (-0.043..+0.028); KL 1 +0.069 / -0.008
  (-0.008..+0.010). A smaller rate shrinks the walk, not the rise (which is over in ~10 iterations): lr
  3e-4 (the reference's), KL 0.1, 150 s: +0.123 / -0.004 (-0.035..0), 51 iterations. Chosen: lr 3e-4, KL 0.1.
  ``nft.beta`` and ``nft.decay`` were left as shipped: with one optimizer step per iteration and the old
  policy within a few percent of the trained one (decay ``min(0.001 step, 0.5)`` <= 0.05 in 50 steps), the
  gradient at theta = theta_old does not depend on beta (§3's derivation) and the old policy barely lags.
* awm as shipped (6 levels per sample, KL 1e-3, EMA KL 1; 100 s): +0.089 / -0.135 (falling), 13 iterations
  (7.7 CPU s each). With 3 steps its strata, ``[1, floor(0.9 x 3)) = [1, 2)``, put all 6 levels at grid
  index 1 (sigma 0.58); index 0 (sigma 1, where these samples' colours are decided: Flow-GRPO trains only
  that step) is never drawn (the reference's ``discrete_wo_init``). KL 0.01 (6 levels, 150 s) +0.088 /
  -0.073 (-0.076..0); 2 levels (both at 0.58), KL 0.03, 100 s: +0.065 / -0.011 (-0.052..0), 30 iterations.
  A 6-step rollout grid (1, 0.86, 0.69, 0.51, 0.28, 0.02) gives the strata ``[1, 3)`` and ``[3, 5)``: 2
  levels, one from each, KL 0.03, 150 s: +0.127 / +0.003 (-0.032..+0.003), 43 iterations; the fixed
  evaluation still samples 3 Euler steps, so the 6-step rollout is part of the method's cost, not of its
  judge. At lr 1e-3 the three seeds' controls ended +0.003, -0.016, +0.024 (5.2x less than AWM's gain on
  seed 2) after dipping to -0.070; lr 3e-4 (seed 2): +0.115 / +0.012 (-0.005..+0.012). Chosen: lr 3e-4,
  6 rollout steps, 2 levels, KL 0.03 (EMA KL 1 and p = 0.25 as shipped; on-policy the EMA policy is within
  ``min(0.001 step, 0.3)`` of the trained one and the clip acts on a ratio of exactly 1).

The one-step-stale measurement (``--stale``, ``digenrl run`` under ``colocated`` and ``async1``, nft with
:data:`SETTINGS`, seed 0, 40 iterations; async1 samples with theta_old^(k-1) and trains against theta_old^k):
fixed evaluation from 0.664: colocated +0.1208 (0.7849), async1 +0.1205 (0.7846; max staleness 1): one-step
staleness costs nft nothing measurable here (the last-5-iteration reward window: +0.116 and +0.128). Wall time
107 s vs 88 s: on 2 CPU cores the actors' processes only add overhead (docs/learning-stale.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import ROOT, _overrides, fixed_evaluation, window_stats  # noqa: E402  (the sibling benchmark)

# Per algorithm, the overrides on top of the config (what the README's table ran). An SDE key set together with
# nft / awm is refused by name, so each algorithm carries only its own.
SETTINGS: dict[str, list[str]] = {
    "flow_grpo": [],
    "nft": ["train.algorithm=nft", "train.lr=3e-4", "nft.kl_beta=0.1"],
    "awm": ["train.algorithm=awm", "rollout.num_steps=6", "awm.levels=2", "awm.kl_beta=0.03"],
    "grpo_guard": ["train.algorithm=grpo_guard"],
    # MixGRPO: a 2-step SDE window on a 6-step grid, moving every 10 optimizer steps (starts 0..3); Flash: the
    # steps after the window as one DPM-Solver step
    "mixgrpo": ["train.algorithm=mixgrpo", "rollout.num_steps=6", "mixgrpo.window=2", "mixgrpo.shift_every=10"],
    "mixgrpo_flash": ["train.algorithm=mixgrpo", "rollout.num_steps=6", "mixgrpo.window=2", "mixgrpo.shift_every=10",
                      "mixgrpo.flash=true"],
    # the user's algorithm of examples/ (docs/algorithms.md, "Adding an algorithm")
    "reward_weighted": ['train.algorithm="examples/algorithms/reward_weighted.py:RewardWeighted"'],
}
LABELS = {"flow_grpo": "Flow-GRPO", "nft": "DiffusionNFT", "awm": "AWM", "grpo_guard": "GRPO-Guard", "mixgrpo": "MixGRPO",
          "mixgrpo_flash": "MixGRPO-Flash",
          "reward_weighted": "reward-weighted FM (examples/)"}
COLORS = {"flow_grpo": "tab:blue", "nft": "tab:orange", "awm": "tab:green", "grpo_guard": "tab:red", "mixgrpo": "tab:brown", "mixgrpo_flash": "tab:olive",
          "reward_weighted": "tab:purple"}


def run_timed(args: argparse.Namespace, algorithm: str, control: str, seed: int,
              extra: list[str] | None = None) -> dict[str, Any]:
    """One run of ``algorithm`` for ``args.seconds`` seconds of training; the fixed evaluation at the start,
    at the first iteration end past each of ``args.eval_at`` (training seconds) and after the last iteration.

    ``eval``: ``[training seconds, iterations done, reward]`` rows; ``cpu``: the process CPU seconds of
    training at each row.
    """
    import torch

    from digenrl.config import load_config
    from digenrl.recipes.colocated import iteration, setup

    ns = argparse.Namespace(**{**vars(args), "iters": 100000,
                               "set": [*SETTINGS[algorithm], *args.set, *(extra or [])]})
    overrides = _overrides(ns, control, seed)
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.log.seed)  # as recipes.colocated.train
    state = setup(cfg)
    # the judge's steps are the config's own, whatever an algorithm's rollout.num_steps
    steps = load_config(args.config, SETTINGS[algorithm][:1]).rollout.num_steps

    def evaluate() -> float:
        images, prompts = fixed_evaluation(state.model, state.prompts, steps, args.eval_noises)
        return float(state.reward.score(images, prompts).mean())

    wall = cpu = 0.0
    evals, cpus, walls, history = [[0.0, 0, evaluate()]], [0.0], [0.0], []
    marks = sorted(t for t in args.eval_at if t < args.seconds)
    it = 0

    def clock() -> float:  # the seconds the budget and the figure count
        return cpu if args.clock == "cpu" else wall

    while clock() < args.seconds and it < args.max_iters:
        w0, c0 = time.perf_counter(), time.process_time()
        history.append(iteration(state, it)[0])
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        it += 1
        if (marks and clock() >= marks[0]) or clock() >= args.seconds or it == args.max_iters:
            evals.append([clock(), it, evaluate()])
            cpus.append(cpu)
            walls.append(wall)
            marks = [t for t in marks if t > clock()]
    curve = [h["reward_mean"] for h in history]
    return {
        "algorithm": algorithm, "control": control, "seed": seed, "overrides": overrides,
        "clock": args.clock, "eval": evals, "cpu": cpus, "wall": walls, "eval_gain": evals[-1][2] - evals[0][2],
        "iterations": it, "seconds": wall, "cpu_seconds": cpu, "cpu_share": cpu / wall,
        "seconds_per_iter_median": statistics.median(h["seconds"] for h in history),
        "curve": curve, "summary": window_stats(curve),
        "diagnostics": {k: [h.get(k) for h in history] for k in ("kl", "policy_loss", "grad_norm")}
        | {k: [h.get("algorithm", {}).get(k) for h in history] for k in ("old_deviate", "ema_kl")},
    }


def reward_at(run: dict[str, Any], t: float) -> float:
    """The fixed evaluation at ``t`` training seconds, linear between the evaluations either side."""
    pts = [(e[0], e[2]) for e in run["eval"]]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:], strict=False):
        if t0 <= t <= t1:
            return r0 + (r1 - r0) * (t - t0) / (t1 - t0) if t1 > t0 else r1
    return pts[-1][1]


def _one(job: tuple[argparse.Namespace, str, str, int]) -> dict[str, Any]:
    """A worker process's run (module level, so a process pool can call it)."""
    args, algorithm, control, seed = job
    t0 = time.perf_counter()
    out = run_timed(args, algorithm, control, seed)
    print(f"  {algorithm:9s} {control:8s} seed {seed}: {out['iterations']} its, gain {out['eval_gain']:+.4f} "
          f"({time.perf_counter() - t0:.0f} s with evaluations)", flush=True)
    return out


def table(results: list[dict[str, Any]], seeds: list[int], marks: tuple[float, ...]) -> list[str]:
    """The README's markdown table of ``results``."""
    def find(a: str, c: str, s: int) -> dict[str, Any]:
        return next(r for r in results if (r["algorithm"], r["control"], r["seed"]) == (a, c, s))

    start = statistics.fmean(r["eval"][0][2] for r in results)
    clock = "wall-clock" if results[0]["clock"] == "wall" else "CPU"
    lines = [f"| {results[0]['seconds_budget']:.0f} {clock} s of training per run, fixed evaluation from {start:.3f} | "
             + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for a in SETTINGS:
        runs = [find(a, "none", s) for s in seeds]
        lines.append(f"| {LABELS[a]}: gain (iterations) | "
                     + " | ".join(f"{r['eval_gain']:+.3f} ({r['iterations']})" for r in runs) + " |")
        if any(r["algorithm"] == a and r["control"] == "shuffled" for r in results):
            cells = []
            for r in runs:
                c = find(a, "shuffled", r["seed"])
                ratio = abs(r["eval_gain"]) / max(abs(c["eval_gain"]), 1e-9)
                span = [e[2] - c["eval"][0][2] for e in c["eval"]]
                cells.append(f"{c['eval_gain']:+.3f} ({ratio:.{1 if ratio < 10 else 0}f}x less; "
                             f"{min(span):+.3f}..{max(span):+.3f})")
            lines.append(f"| {LABELS[a]}, shuffled control (range over its evaluations) | " + " | ".join(cells) + " |")
    names = " / ".join(LABELS[a] for a in SETTINGS)
    for t in marks:
        lines.append(f"| reward at {t:g} s: {names} | "
                     + " | ".join(" / ".join(f"{reward_at(find(a, 'none', s), t):.3f}" for a in SETTINGS)
                                  for s in seeds) + " |")
    lines.append(f"| {clock} s per iteration: {names} | "
                 + " | ".join(" / ".join(f"{_per_iter(find(a, 'none', s)):.2f}" for a in SETTINGS) for s in seeds) + " |")
    return lines


def _per_iter(run: dict[str, Any]) -> float:
    """Seconds per iteration on the run's clock."""
    return (run["cpu_seconds"] if run["clock"] == "cpu" else run["seconds"]) / run["iterations"]


def figures(args: argparse.Namespace) -> dict[str, Any]:
    """Every algorithm (and nft's and awm's shuffled controls) for ``args.seeds``: ``learning-algorithms.png``
    (fixed evaluation against training seconds) and ``learning-algorithms.json`` in ``args.figures``."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir: Path = args.figures
    out_dir.mkdir(parents=True, exist_ok=True)
    # a seed's runs go together, so the runs that share the machine at any time are of one seed and differ in
    # their algorithm: what the other worker (and anything else on the machine) costs them is shared alike
    jobs = [(args, a, c, s) for s in args.seeds for a in SETTINGS
            for c in (("none",) if a == "flow_grpo" else ("none", "shuffled"))]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(_one, jobs))
    for r in results:
        r["seconds_budget"] = args.seconds

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    for r in results:
        a, c = r["algorithm"], r["control"]
        first = r["seed"] == args.seeds[0]
        t, it, val = zip(*r["eval"], strict=True)
        label = (LABELS[a] if c == "none" else f"{LABELS[a]}, advantages shuffled") if first else None
        style = dict(color=COLORS[a], ls="-" if c == "none" else "--", lw=1.4 if c == "none" else 1.0,
                     alpha=1.0 if c == "none" else 0.7, label=label)
        axes[0].plot(t, val, marker="o", ms=2.5, **style)
        axes[1].plot(it, val, marker="o", ms=2.5, **style)
    axes[0].set_xlabel("training seconds, one thread (" + ("wall clock" if args.clock == "wall" else
                       "process CPU time") + "; evaluations excluded)", fontsize=8)
    axes[1].set_xlabel("iteration (= optimizer step)")
    for ax in axes:
        ax.set_ylabel(f"mean {args.reward} reward, fixed evaluation")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"tiny Qwen-Image on one CPU thread, {args.seconds:.0f} s of training per run, seeds "
                 f"{', '.join(map(str, args.seeds))}; fixed evaluation: 3-step Euler ODE samples of every prompt x "
                 f"{args.eval_noises} noises", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "learning-algorithms.png")
    plt.close(fig)
    marks = tuple(m for m in (10.0, 30.0) if m < args.seconds) + (args.seconds,)
    summary = {"seconds": args.seconds, "clock": args.clock, "eval_at": args.eval_at, "settings": SETTINGS,
               "table": table(results, args.seeds, marks), "runs": results}
    (out_dir / "learning-algorithms.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def stale(args: argparse.Namespace) -> dict[str, Any]:
    """nft as ``digenrl run CONFIG --set train.algorithm=nft`` under ``colocated`` and ``async1`` (one-step-stale:
    a batch sampled by theta_old^(k-1) trained against theta_old^k), same seed and iterations: the fixed
    evaluation of each run's final trained weights (and of its old policy) beside the start.

    Writes ``learning-stale.json`` to ``args.stale``; the runs' own outputs go to ``runs/stale/<schedule>``.
    """
    import shutil
    import subprocess

    import torch
    from safetensors.torch import load_file

    from digenrl.config import load_config
    from digenrl.models.lora import load_trainable, load_trainable_state_dict
    from digenrl.recipes.checkpoint import find_checkpoint
    from digenrl.recipes.colocated import setup

    sets = [*SETTINGS["nft"], *args.set, f"train.iterations={args.stale_iters}", f"log.seed={args.seed}"]
    out = {"seed": args.seed, "iterations": args.stale_iters, "overrides": sets, "runs": {}}
    for name in ("colocated", "async1"):
        run_dir = ROOT / "runs" / "stale" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "digenrl_cli.main", "run", args.config, "--out", str(run_dir),
               "--set", f"schedule.name={name}", *(x for o in sets for x in ("--set", o))]
        print("$", " ".join(cmd[2:]), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        ckpt = find_checkpoint(run_dir)
        out["runs"][name] = {"seconds": time.perf_counter() - t0, "curve": [m["reward_mean"] for m in lines],
                             "max_staleness": max(m.get("max_staleness", 0) for m in lines),
                             "checkpoint": str(ckpt.relative_to(ROOT))}

    torch.set_num_threads(1)
    state = setup(load_config(args.config, [*sets, "placement.threads=1", "schedule.name=colocated"]))

    def evaluate() -> float:
        images, asked = fixed_evaluation(state.model, state.prompts, state.cfg.rollout.num_steps, args.eval_noises)
        return float(state.reward.score(images, asked).mean())

    out["start"] = evaluate()
    for name, r in out["runs"].items():
        ckpt = ROOT / r["checkpoint"]
        load_trainable(state.model, ckpt / "trainable.safetensors")
        r["fixed_evaluation"] = evaluate()
        if (ckpt / "old.safetensors").is_file():
            load_trainable_state_dict(state.model, load_file(str(ckpt / "old.safetensors")))
            r["fixed_evaluation_old"] = evaluate()
        r["gain"] = r["fixed_evaluation"] - out["start"]
        r["window"] = window_stats(r["curve"])
    args.stale.mkdir(parents=True, exist_ok=True)
    (args.stale / "learning-stale.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-qwenimage.toml"))
    ap.add_argument("--reward", default="shapes")
    ap.add_argument("--algorithm", default="nft", choices=list(SETTINGS))
    ap.add_argument("--control", default="none", choices=["none", "shuffled", "negated"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=150.0, help="training seconds per run (wall clock)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="what --seconds counts: wall-clock seconds, or the run's process CPU seconds (one thread: "
                         "the wall clock of a core of its own, robust to other load on the machine)")
    ap.add_argument("--max-iters", type=int, default=10**9, help="stop here even if seconds are left")
    ap.add_argument("--eval-at", type=float, nargs="+", default=[2.5, 5, 10, 15, 20, 30, 45, 60, 80, 100, 125],
                    help="fixed evaluations after these training seconds (dense early: the rise takes ~20 s)")
    ap.add_argument("--eval-noises", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--set", action="append", default=[], help="extra config override (after the algorithm's)")
    ap.add_argument("--json", type=Path, default=None, help="one run: write the result here")
    ap.add_argument("--figures", type=Path, default=None, help="every algorithm for --seeds: the README's figure here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="with --figures: runs at a time (one thread each)")
    ap.add_argument("--stale", type=Path, default=None, help="nft under async1 beside colocated (--seed): JSON here")
    ap.add_argument("--stale-iters", type=int, default=40)
    args = ap.parse_args()
    if args.stale is not None:
        out = stale(args)
        for name, r in out["runs"].items():
            print(f"{name:9s} fixed evaluation {out['start']:.4f} -> {r['fixed_evaluation']:.4f} ({r['gain']:+.4f}); "
                  f"old policy {r.get('fixed_evaluation_old', float('nan')):.4f}; {r['seconds']:.0f} s, "
                  f"max staleness {r['max_staleness']}")
        return
    if args.figures is not None:
        summary = figures(args)
        print("\n".join(summary["table"]))
        for r in summary["runs"]:
            print(f"{r['algorithm']:9s} {r['control']:8s} seed {r['seed']}: {r['iterations']:4d} its, "
                  f"{r['seconds_per_iter_median']:.2f} s/it, gain {r['eval_gain']:+.4f}, cpu share {r['cpu_share']:.2f}")
        return
    r = run_timed(args, args.algorithm, args.control, args.seed)
    ev = " ".join(f"{t:.0f}s/{i}:{v:.3f}" for t, i, v in r["eval"])
    print(f"{args.algorithm} {args.control} seed {args.seed} {' '.join(args.set)}: gain {r['eval_gain']:+.4f}, "
          f"{r['iterations']} its, {r['seconds_per_iter_median']:.2f} s/it, cpu share {r['cpu_share']:.2f}\n  {ev}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
