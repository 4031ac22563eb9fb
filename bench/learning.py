"""Learning benchmark: does the colocated Flow-GRPO loop raise the reward of the tiny Qwen-Image?

    python bench/learning.py --iters 60 --json runs/learning.json
    python bench/learning.py --iters 60 --control shuffled --json runs/learning-shuffled.json
    python bench/learning.py --figures docs/          # the README's figures: 3 seeds x (Flow-GRPO + 2 controls)

It runs ``configs/tiny-qwenimage.toml`` (or ``--config``: the tiny Qwen-Image pretrained on shapes,
``shapes`` reward) colocated on CPU for ``--iters`` iterations and records two curves:

* ``eval``: every ``--eval-every`` iterations, the mean reward of ODE samples of *every* prompt of the set
  from the *same* initial noise, a function of the weights alone; ``eval_gain`` = end - start. This is
  the criterion.
* ``curve``: the mean reward of each training batch, with ``gain`` = mean of the last 5 minus the first
  5 and ``gain_in_noise`` = gain / its standard error. It mixes in which prompts each batch drew (32 of
  168, the same draw in every run of a seed): a run with lr 1e-12 "gained" +0.011 (seed 0, 40 its).

The negative control ``--control shuffled`` permutes the advantages across samples each iteration
(same update statistics, no link to the reward), so it should stay flat; ``--control negated`` flips
their sign, so it should fall.

Why the shuffled control moved: it is a random walk of the LoRA weights (AdamW steps of ~lr per weight
in directions with no reward information). Its effect is second order and sign-indefinite: on the old
random-init model it happened to raise the colour reward (+0.015); on the pretrained model, which sits
near an optimum of what it draws, it lowers the reward, and the more the longer and larger the steps
(fixed evaluation, seed 0, no KL: -0.072 in 40 iterations at lr 1.5e-3; -0.53 on the training batches at
lr 4e-3). Flow-GRPO's own update has the same noise but its signal corrects what the noise breaks. The
KL to the pretrained model (``train.kl_beta``, at the trained step) holds the walk: beta 0.2 -> control
-0.005, Flow-GRPO +0.059 (60 iterations, lr 3e-3, seed 0); beta 1 -> -0.003 / +0.027.

Measured with ``--figures`` (the shipped config: 3 steps, lr 3e-3, KL 0.1; 60 iterations; 2-core CPU
shared with other jobs, two runs at a time, one thread each, ~15 minutes), seeds 0/1/2, fixed evaluation
from 0.852: Flow-GRPO +0.055, +0.052, +0.054; shuffled -0.006, -0.011, -0.018 (9.3x, 4.7x, 3.1x); negated
-0.36, -0.41, -0.41. Training batches (window gain): Flow-GRPO +0.059 (z 7.1), +0.057 (z 5.6), +0.066
(z 10.0); shuffled +0.001, +0.001, -0.002. The shuffled control's loss is all in its first 10 iterations
(-0.018..-0.024; likely Adam's first steps, its largest, before the KL builds up), flat after.

Why not +0.10: every setting tried levels off at a fixed evaluation of 0.90-0.91 (seed 0, 40 iterations,
6 steps, KL 0.05 unless said): no KL +0.070 (0.912, then down to 0.882 at 120 iterations); KL 0.05
+0.065; 64 prompts per batch +0.070; noise level 0.3 / 0.5 / 1.0 +0.055 / +0.058 / +0.068; LoRA rank 2 /
32 +0.041 / +0.039; group size 16 x 16 prompts +0.056; Adam beta1 0.97 +0.038 (lr 6e-3, KL 0.2) / +0.063
(KL 0.1); KL 0.2: training steps 0-2 +0.044, all but the last +0.030, one step drawn from 0-3 +0.039.
The dataset's own images score 0.99; the model's triangles are blobs (0.73 vs 0.90 for circles and
squares; form 0.53), which a rank-8 LoRA on the first step's velocity does not turn into triangles in
tens of iterations.

Where the reward is lost: ``eval_parts`` holds the ``shapes`` reward's three parts at the first and last
evaluation, over all prompts and per shape; ``--figures`` also writes ``ceiling`` to ``learning.json``:
the dataset's images and the same images through the model's VAE. Seed 0 (background / shape colour /
form): 0.971 / 0.891 / 0.695 at the start, 0.979 / 0.984 / 0.758 after 60 iterations; the VAE's
reconstructions 0.986 / 0.974 / 0.818 (total 0.926): Flow-GRPO fixes the shape colour, and the form it
barely moves is capped by the decoder, so from 0.852 +0.10 is out of reach of any policy over this VAE.
Earlier starting points of the same recipe (750 / 1000 of its 3000 flow-matching steps: 0.788 / 0.801)
gained +0.080 / +0.081, the 750-step model's shuffled control -0.020; a VAE trained 2000 steps
(reconstructions 0.958) under 1000 / 1500 transformer steps: +0.084 / +0.075 (seed 0, 60 iterations); a VAE
trained 3000 steps under 1000 (``pretrain_tiny.py --vae-steps 3000 --steps 1000``, start 0.783): +0.091 with
its shuffled control -0.030; with ``rollout.window=2`` +0.082 / -0.012; ``train.kl_beta=0.2`` +0.079 / -0.019.
Each levels off by iteration 30. The reason is the model, not the loop: at 32 px the transformer sees four
image tokens (a 4x4 latent packed 2x2) in two layers, it draws blobs, and Flow-GRPO moves colour within ~20
iterations but form barely; the gain is then the colour error the pretrained model leaves, small when it
is good, and a weaker start loses more to the control's undirected steps.
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
    shown = state.prompts[:: max(1, len(state.prompts) // 16)][:16]
    before = _ode_samples(state.model, shown, 12345, cfg.rollout.num_steps) if grids else None

    parts = {}  # the shapes reward's parts at the first and the last evaluation: where the reward is lost

    def evaluate(it: int) -> tuple[int, float]:
        # every prompt of the set, the same initial noise each time: a function of the weights alone
        images = _ode_samples(state.model, state.prompts, 777, cfg.rollout.num_steps)
        if args.reward == "shapes" and it in (0, cfg.train.iterations):
            parts[it] = parts_by_shape(images, state.prompts)
        return it, float(state.reward.score(images, state.prompts).mean())

    evals = [evaluate(0)]
    history = []
    for it in range(cfg.train.iterations):
        history.append(iteration(state, it)[0])
        if (it + 1) % args.eval_every == 0 or it == cfg.train.iterations - 1:
            evals.append(evaluate(it + 1))
    after = _ode_samples(state.model, shown, 12345, cfg.rollout.num_steps) if grids else None
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
    import torch
    from PIL import Image

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

    def tile(images: torch.Tensor, scale: int = 3) -> Image.Image:
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

    a, b = tile(grids["before"]), tile(grids["after"])
    fig, axes = plt.subplots(1, 2, figsize=(2 * a.width / 100 + 0.4, a.height / 100 + 0.5), dpi=100)
    for ax, im, title in ((axes[0], a, "iteration 0"), (axes[1], b, f"after {args.iters} iterations")):
        ax.imshow(im)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    fig.savefig(out_dir / "learning-samples.png")
    plt.close(fig)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-qwenimage.toml"))
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--reward", default="shapes", choices=["color", "shapes", "jpeg_compressibility", "jpeg_incompressibility", "ocr"])
    ap.add_argument("--control", default="none", choices=["none", "shuffled", "negated"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per run (default 2; 1 with --figures)")
    ap.add_argument("--set", action="append", default=[], help="extra config override, e.g. train.lr=3e-2")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate on the fixed set every this many iterations")
    ap.add_argument("--figures", type=Path, default=None,
                    help="run Flow-GRPO and both controls for --seeds and write the README's figures to this folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --figures")
    ap.add_argument("--jobs", type=int, default=2, help="with --figures: runs at a time (one thread each)")
    args = ap.parse_args()
    if args.threads is None:
        args.threads = 1 if args.figures is not None else 2
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
