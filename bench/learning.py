"""Learning benchmark: does the colocated Flow-GRPO loop raise the reward of the tiny Qwen-Image?

    python bench/learning.py --json runs/learning.json                  # 160 iterations, seed 0, ~4 minutes
    python bench/learning.py --control shuffled --json runs/learning-shuffled.json
    python bench/learning.py --figures docs/      # the README's figures: 3 seeds x (Flow-GRPO + 2 controls)
    python bench/learning.py --schedules docs/    # the default run under async1 and colocated, same seed

It runs ``configs/tiny-qwenimage.toml`` (or ``--config``: the tiny4x Qwen-Image pretrained on shapes,
``shapes`` reward) colocated on CPU for ``--iters`` iterations and records two curves:

* ``eval``: every ``--eval-every`` iterations, the mean reward of ODE samples of *every* prompt of the set
  from the *same* ``--eval-noises`` initial noises per prompt (4: 672 samples), a function of the weights
  alone; ``eval_gain`` = end - start. This is the criterion.
* ``curve``: the mean reward of each training batch, with ``gain`` = mean of the last 5 minus the first
  5 and ``gain_in_noise`` = gain / its standard error. It mixes in which prompts each batch drew (32 of
  168, the same draw in every run of a seed): a run with lr 1e-12 "gained" +0.011 (seed 0, 40 its).

The negative control ``--control shuffled`` permutes the advantages across samples each iteration
(same update statistics, no link to the reward), so it should stay flat; ``--control negated`` flips
their sign, so it should fall.

Measured with ``--figures`` (the shipped config: tiny4x, 3 steps, lr 1e-3, KL 0.1; 160 iterations; two
runs at a time, one thread each, ~23 minutes on 2 cores), seeds 0/1/2, fixed evaluation from 0.664:
Flow-GRPO +0.120, +0.120, +0.112; shuffled -0.018, -0.007, +0.002 (6.6x, 17x, 52x); negated -0.49, -0.50,
-0.51. On the mean of the reward's three parts (its score before it became their product) the same runs
gain +0.066, +0.066, +0.062 (0.861 -> 0.92-0.93). Where: the triangles' shape colour 0.64 -> 0.97-0.98
(drawn in a muddy mix before), the form 0.71 -> 0.79 (circles and squares 0.81 -> 0.85, triangles 0.52 ->
0.68); the background was right.

Why the shuffled control moves: it is a random walk of the LoRA weights (AdamW steps of ~lr per weight in
directions with no reward information). On the pretrained model, which sits near an optimum of what it
draws, it costs reward, and its fixed evaluation swings between checkpoints (a swing of the weights, not
evaluation noise: with four noises per prompt instead of one, seed 0's series moved by at most 0.007). The
KL to the pretrained model (``train.kl_beta``, at the trained step) and a small rate bound the walk;
Flow-GRPO's gain levels off by iteration ~60 whatever the rate. Seed 0, 120 iterations, fixed evaluation,
Flow-GRPO / shuffled control at the end (the control's range over its checkpoints): lr 3e-3 +0.116 /
-0.031 (-0.040..+0.008); lr 1.5e-3 +0.111 / -0.001 (-0.024..+0.010); lr 1e-3 +0.110 / +0.004
(-0.014..+0.007). At lr 3e-3: KL 0.3 +0.079 / -0.017; KL 0.05 +0.122 / -0.045 (-0.107..+0.001); noise
level 1.0 +0.117 / -0.046.

Why these models: the old default, the tiny transformer over an 8x VAE (four image tokens at 32 px),
gained +0.055 in 60 iterations on the mean of the parts, levelling off at 0.91 (every setting tried; the
list is in the git history of this file) with its VAE's reconstructions at 0.926: its decoder blurred
every form. The 4x VAE's reconstructions score 0.967 (0.902 on the product); its transformer still draws
blobs (form 0.70 after 12000 flow-matching steps, 0.68 after 6000, one noise per prompt; 6, 12 or 24
sampling steps score no better than 3), and Flow-GRPO moves colour within ~10 iterations and form slowly.

Where the reward is lost: ``eval_parts`` holds the ``shapes`` reward's three parts at the first and last
evaluation, over all prompts and per shape; ``--figures`` also writes ``ceiling`` to ``learning.json``:
the dataset's images (0.981) and the same images through the model's VAE (0.902, form 0.912).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Prompt sets per reward: the colour reward needs colour words; JPEG and OCR take any prompt set.
_PROMPT_SET = {"color": "color", "ocr": "ocr", "shapes": "shapes"}


def window_stats(curve: list[float], w: int = 5) -> dict[str, float]:
    """First/last-window means, the gain, and the gain in units of its standard error."""
    first, last = curve[:w], curve[-w:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = math.sqrt(statistics.pvariance(first) / len(first) + statistics.pvariance(last) / len(last)) or float("nan")
    return {"first": statistics.fmean(first), "last": statistics.fmean(last), "gain": gain, "gain_in_noise": gain / se}


def _overrides(args: argparse.Namespace, control: str, seed: int) -> list[str]:
    return [
        f"train.iterations={args.iters}",
        f"reward.weights={{{args.reward}=1.0}}",
        f"data.prompt_set={_PROMPT_SET.get(args.reward, 'simple')}",
        f"train.control={control}",
        f"placement.threads={args.threads}",
        f"log.seed={seed}",
        *args.set,
    ]


_GRID_NOISE = 12345  # the initial noise of the before/after sample grids


def _shown(prompts: list[str]) -> list[str]:
    """The 16 prompts of the sample grids, spread over the set."""
    return prompts[:: max(1, len(prompts) // 16)][:16]


def _ode_samples(model: Any, prompts: list[str], seed: int, steps: int) -> Any:
    """ODE samples (noise 0) of ``prompts`` from fixed initial noise: the same picture before and after."""
    import torch

    with torch.no_grad():
        cond = model.encode_prompts(prompts)
        x = model.prepare_latents(len(prompts), generator=torch.Generator().manual_seed(seed))
        sig = model.sigmas(steps)
        for i in range(steps):
            x = x + (sig[i + 1] - sig[i]) * model.velocity(x, sig[i].expand(len(prompts)), cond)
        return model.decode(x)


def fixed_evaluation(model: Any, prompts: list[str], steps: int, noises: int) -> tuple[Any, list[str]]:
    """ODE samples of every prompt from ``noises`` fixed initial noises each: ``(images, their prompts)``.

    A function of the weights alone, so its change between two checkpoints is what the training did. More
    than one noise per prompt averages out how a weight change happens to move each single picture (the
    shuffled control's evaluation swung +-0.02 between checkpoints at one noise per prompt).
    """
    import torch

    images = torch.cat([_ode_samples(model, prompts, 777 + k, steps) for k in range(noises)])
    return images, prompts * noises


def parts_by_shape(images: Any, prompts: list[str]) -> dict[str, dict[str, float]]:
    """The ``shapes`` reward's parts (background, shape colour, form) and total, over all prompts and per shape."""
    from digenrl.rewards.shapes import ShapesReward, parse_shape_prompt

    parts = ShapesReward().parts(images, prompts)
    parts["total"] = ShapesReward.total(parts)
    shape = [parse_shape_prompt(p)[1] for p in prompts]
    out = {}
    for group in ("all", *sorted(set(shape))):
        rows = [k for k, s in enumerate(shape) if group in ("all", s)]
        out[group] = {name: round(float(v[rows].mean()), 4) for name, v in parts.items()}
    return out


def _print_parts(eval_parts: dict[int, dict[str, dict[str, float]]], indent: str = "") -> None:
    """Each shape's reward parts at the first -> the last evaluation (``shapes`` only; else nothing)."""
    if not eval_parts:
        return
    first, last = eval_parts[min(eval_parts)], eval_parts[max(eval_parts)]
    for shape, before in first.items():
        print(f"{indent}{shape:8s} " + "  ".join(f"{k} {before[k]:.3f}->{last[shape][k]:.3f}" for k in before))


def vae_ceiling(model: Any, count: int = 336) -> dict[str, dict[str, float]]:
    """:func:`parts_by_shape` of dataset images (a seed no pretraining read) passed through the model's VAE:
    what samples as good as the data's own latents would score, the ceiling of any policy over this decoder."""
    import torch

    from digenrl.data.shapes import shapes_batch

    images, prompts = shapes_batch(99, 0, count, size=model.height)
    vae = model.pipe.vae
    with torch.no_grad():
        rec = vae.decode(vae.encode((images * 2 - 1)[:, :, None]).latent_dist.mean).sample[:, :, 0]
    return {"dataset": parts_by_shape(images, prompts), "vae": parts_by_shape(((rec + 1) / 2).clamp(0, 1), prompts)}


def run(args: argparse.Namespace, control: str | None = None, seed: int | None = None,
        grids: bool = False) -> dict[str, Any]:
    """One learning run (the colocated loop, as ``digenrl run`` with ``schedule.name = colocated`` trains).

    With ``grids``, also the ODE samples of 16 fixed prompts and noises before the first and after the
    last iteration (``result["grids"]``: the two image tensors and the prompts).
    """
    import torch

    from digenrl.config import load_config
    from digenrl.recipes.colocated import iteration, setup

    control = args.control if control is None else control
    seed = args.seed if seed is None else seed
    overrides = _overrides(args, control, seed)
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.log.seed)  # as recipes.colocated.train
    t0 = time.perf_counter()
    state = setup(cfg)
    shown = _shown(state.prompts)
    before = _ode_samples(state.model, shown, _GRID_NOISE, cfg.rollout.num_steps) if grids else None

    parts = {}  # the shapes reward's parts at the first and the last evaluation: where the reward is lost

    def evaluate(it: int) -> tuple[int, float]:
        images, prompts = fixed_evaluation(state.model, state.prompts, cfg.rollout.num_steps, args.eval_noises)
        if args.reward == "shapes" and it in (0, cfg.train.iterations):
            parts[it] = parts_by_shape(images, prompts)
        return it, float(state.reward.score(images, prompts).mean())

    evals = [evaluate(0)]
    history = []
    for it in range(cfg.train.iterations):
        history.append(iteration(state, it)[0])
        if (it + 1) % args.eval_every == 0 or it == cfg.train.iterations - 1:
            evals.append(evaluate(it + 1))
    after = _ode_samples(state.model, shown, _GRID_NOISE, cfg.rollout.num_steps) if grids else None
    wall = time.perf_counter() - t0
    curve = [h["reward_mean"] for h in history]
    out = {
        "reward": args.reward,
        "control": control,
        "iters": args.iters,
        "seed": seed,
        "overrides": overrides,
        "curve": curve,
        "summary": window_stats(curve),
        "eval": evals,
        "eval_gain": evals[-1][1] - evals[0][1],
        "eval_parts": parts,
        "seconds_total": wall,
        "seconds_per_iter_median": statistics.median(h["seconds"] for h in history),
        "history": history,
        "config": cfg.to_dict(),
    }
    if grids:
        out["grids"] = {"before": before, "after": after, "prompts": shown}
    return out


def _one(job: tuple[argparse.Namespace, str, int, bool]) -> dict[str, Any]:
    """A worker process's run (module level, so a process pool can call it)."""
    args, control, seed, grids = job
    return run(args, control=control, seed=seed, grids=grids)


def _tile(images: Any, scale: int = 3) -> Any:
    """``images [N, 3, h, w]`` in [0, 1] as one PIL image, 8 per row, 1 px apart, enlarged ``scale`` times."""
    import torch
    from PIL import Image

    n, _, h, w = images.shape
    cols = 8
    rows = (n + cols - 1) // cols
    grid = torch.ones(3, rows * (h + 1), cols * (w + 1))
    for k in range(n):
        r, c = divmod(k, cols)
        grid[:, r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = images[k]
    arr = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    im = Image.fromarray(arr)
    return im.resize((im.width * scale, im.height * scale), Image.NEAREST)


def _side_by_side(grids: list[Any], titles: list[str], path: Path) -> None:
    """Sample grids next to each other, one title each, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiles = [_tile(g) for g in grids]
    w, h = tiles[0].width, tiles[0].height
    fig, axes = plt.subplots(1, len(tiles), figsize=(len(tiles) * w / 100 + 0.4, h / 100 + 0.5), dpi=100)
    for ax, im, title in zip(axes, tiles, titles, strict=True):
        ax.imshow(im)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    fig.savefig(path)
    plt.close(fig)


def figures(args: argparse.Namespace) -> dict[str, Any]:
    """The README's pictures: the reward curves of Flow-GRPO and its two controls for ``args.seeds``, and the
    samples before/after (the first seed's Flow-GRPO run).

    Writes ``learning-curve.png``, ``learning-samples.png`` and ``learning.json`` (curves and summaries) to
    ``args.figures``; the runs go ``args.jobs`` at a time, one process and one torch thread each.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir: Path = args.figures
    out_dir.mkdir(parents=True, exist_ok=True)
    controls = ("none", "shuffled", "negated")
    jobs = [(args, c, seed, c == "none" and seed == args.seeds[0]) for seed in args.seeds for c in controls]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(_one, jobs))
    grids = next(r.pop("grids") for r in results if "grids" in r)

    colors = {"none": "tab:blue", "shuffled": "tab:gray", "negated": "tab:red"}
    labels = {"none": "Flow-GRPO", "shuffled": "control: advantages shuffled", "negated": "control: advantages negated"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for r in results:
        c, first = r["control"], r["seed"] == args.seeds[0]
        it, val = zip(*r["eval"], strict=True)
        axes[0].plot(it, val, color=colors[c], marker="o", ms=3, lw=1.5, label=labels[c] if first else None)
        axes[1].plot(r["curve"], color=colors[c], lw=0.8, alpha=0.8, label=labels[c] if first else None)
    axes[0].set_title("fixed evaluation: every prompt, same noise (ODE)", fontsize=9)
    axes[1].set_title("training batches (32 prompts x 8 per iteration)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"mean {args.reward} reward")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"tiny Qwen-Image pretrained on shapes, Flow-GRPO on CPU; seeds {', '.join(map(str, args.seeds))}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "learning-curve.png")
    plt.close(fig)

    _side_by_side([grids["before"], grids["after"]], ["iteration 0", f"after {args.iters} iterations"],
                  out_dir / "learning-samples.png")
    summary = {"prompts_shown": grids["prompts"], "runs": [
        {k: r[k] for k in ("control", "seed", "summary", "eval", "eval_gain", "eval_parts", "curve", "overrides",
                           "seconds_total")}
        for r in results]}
    if args.reward == "shapes":
        from digenrl.config import load_config
        from digenrl.policy import build_model

        summary["ceiling"] = vae_ceiling(build_model(load_config(args.config, [*args.set, "placement.threads=1"]))[0])
    (out_dir / "learning.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def schedules(args: argparse.Namespace) -> dict[str, Any]:
    """The default run, ``digenrl run CONFIG``, under ``async1`` (its actor processes) and ``colocated`` (one
    process), same seed: their training-batch curves, and the fixed evaluation and samples of each run's final
    weights beside the starting point's.

    Writes ``schedules-curve.png``, ``schedules-samples.png`` and ``schedules.json`` to ``args.schedules``;
    the runs' own outputs (metrics, traces, grids, checkpoints) go to ``runs/schedules/<schedule>``, replacing
    the last ones there.
    """
    import shutil
    import subprocess
    import sys

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from digenrl.config import load_config
    from digenrl.models.lora import load_trainable
    from digenrl.recipes.checkpoint import find_checkpoint
    from digenrl.recipes.colocated import setup

    out_dir: Path = args.schedules
    names = ("colocated", "async1")
    curves, weights = {}, {}
    for name in names:
        run_dir = ROOT / "runs" / "schedules" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, not a resume of the last one
        cmd = [sys.executable, "-m", "digenrl_cli.main", "run", args.config, "--out", str(run_dir),
               "--set", f"schedule.name={name}", "--set", f"log.seed={args.seed}", *(x for o in args.set for x in ("--set", o))]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
        curves[name] = [json.loads(ln)["reward_mean"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # colocated writes its final weights beside the metrics; the actor run's are its last checkpoint
        weights[name] = (run_dir / "trainable.safetensors" if name == "colocated"
                         else find_checkpoint(run_dir) / "trainable.safetensors")

    torch.set_num_threads(1)
    state = setup(load_config(args.config, [*args.set, "placement.threads=1"]))  # the runs' model, reward, prompts
    steps = state.cfg.rollout.num_steps

    def evaluate() -> tuple[float, Any]:
        images, asked = fixed_evaluation(state.model, state.prompts, steps, args.eval_noises)
        return (float(state.reward.score(images, asked).mean()),
                _ode_samples(state.model, _shown(state.prompts), _GRID_NOISE, steps))

    fixed, grids = {}, {}
    fixed["start"], grids["start"] = evaluate()
    for name in names:
        load_trainable(state.model, weights[name])
        fixed[name], grids[name] = evaluate()

    iters = len(curves["async1"])
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    for name, color in zip(names, ("tab:gray", "tab:blue"), strict=True):
        ax.plot(curves[name], color=color, lw=1.2, label=f"{name}: fixed evaluation {fixed['start']:.3f} -> {fixed[name]:.3f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"mean {args.reward} reward, training batch")
    ax.set_title(f"digenrl run {Path(args.config).name}: async1 (actor processes) vs colocated, seed {args.seed}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_dir / "schedules-curve.png")
    plt.close(fig)
    _side_by_side([grids["start"], grids["colocated"], grids["async1"]],
                  ["iteration 0", f"colocated, after {iters} iterations", f"async1, after {iters} iterations"],
                  out_dir / "schedules-samples.png")
    summary = {"seed": args.seed, "curves": curves, "fixed_evaluation": fixed, "prompts_shown": _shown(state.prompts),
               "window": {name: window_stats(c) for name, c in curves.items()}}
    (out_dir / "schedules.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-qwenimage.toml"))
    ap.add_argument("--iters", type=int, default=160)
    ap.add_argument("--reward", default="shapes", choices=["color", "shapes", "jpeg_compressibility", "jpeg_incompressibility", "ocr"])
    ap.add_argument("--control", default="none", choices=["none", "shuffled", "negated"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per run (default 2; 1 with --figures)")
    ap.add_argument("--set", action="append", default=[], help="extra config override, e.g. train.lr=3e-2")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate on the fixed set every this many iterations")
    ap.add_argument("--eval-noises", type=int, default=4, help="fixed initial noises per prompt in the evaluation")
    ap.add_argument("--figures", type=Path, default=None,
                    help="run Flow-GRPO and both controls for --seeds and write the README's figures to this folder")
    ap.add_argument("--schedules", type=Path, default=None,
                    help="run the config as `digenrl run` under async1 and colocated (--seed) and write their comparison here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --figures")
    ap.add_argument("--jobs", type=int, default=2, help="with --figures: runs at a time (one thread each)")
    args = ap.parse_args()
    if args.threads is None:
        args.threads = 1 if args.figures is not None else 2
    if args.schedules is not None:
        args.schedules.mkdir(parents=True, exist_ok=True)
        summary = schedules(args)
        for name, w in summary["window"].items():
            print(f"{name:9s} training batches {w['first']:.4f} -> {w['last']:.4f} ({w['gain']:+.4f}, z {w['gain_in_noise']:+.1f})"
                  f"   fixed evaluation {summary['fixed_evaluation']['start']:.4f} -> {summary['fixed_evaluation'][name]:.4f}")
        return
    if args.figures is not None:
        summary = figures(args)
        if "ceiling" in summary:
            for name, p in summary["ceiling"].items():
                print(f"{name:8s} (all prompts) " + "  ".join(f"{k} {v:.3f}" for k, v in p["all"].items()))
        for r in summary["runs"]:
            s, e = r["summary"], r["eval"]
            print(f"seed {r['seed']} {r['control']:9s} eval {e[0][1]:.4f} -> {e[-1][1]:.4f} ({r['eval_gain']:+.4f})   "
                  f"training batches: gain {s['gain']:+.4f} (z {s['gain_in_noise']:+.1f})")
            _print_parts(r["eval_parts"], indent="    ")
        return
    result = run(args)

    from rich.console import Console
    from rich.table import Table

    s = result["summary"]
    e = result["eval"]
    table = Table(title=f"learning: {args.reward}, control={args.control}, {args.iters} iterations")
    for col in ("eval start", "eval end", "eval gain", "batches: first 5", "last 5", "gain", "gain / s.e.",
                "s/iter (median)", "total s"):
        table.add_column(col, justify="right")
    table.add_row(f"{e[0][1]:.4f}", f"{e[-1][1]:.4f}", f"{result['eval_gain']:+.4f}", f"{s['first']:.4f}",
                  f"{s['last']:.4f}", f"{s['gain']:+.4f}", f"{s['gain_in_noise']:+.1f}",
                  f"{result['seconds_per_iter_median']:.2f}", f"{result['seconds_total']:.1f}")
    Console().print(table)
    _print_parts(result["eval_parts"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
