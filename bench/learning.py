"""Learning benchmark: does the colocated Flow-GRPO loop raise the reward of the tiny Qwen-Image?

    python bench/learning.py --iters 60 --json runs/learning-color.json
    python bench/learning.py --iters 60 --control shuffled --json runs/learning-color-shuffled.json
    python bench/learning.py --iters 60 --reward jpeg_compressibility --json runs/learning-jpeg.json

It runs ``configs/tiny-qwenimage.toml`` (or ``--config``) on CPU for ``--iters`` iterations with the
chosen reward and records the per-iteration reward curve. The criterion is the mean reward of the
last 5 iterations minus the first 5 (``gain``), and ``gain_in_noise`` = gain / the standard error of that
difference (from the spread of the iterations inside each window). The negative control
``--control shuffled`` permutes the advantages across samples each iteration, which keeps the update
statistics (and the LoRA's growth) but breaks the link to the reward, so its curve should stay flat;
``--control negated`` flips their sign, so its curve should fall. Prints a rich table; writes JSON.

Measured (2-core CPU shared with other jobs, shipped config, 60 iterations, gain = last 5 - first 5):

* jpeg_compressibility: JPEG size 4.53 -> 3.26 kB (seed 0), 4.55 -> 3.01 kB (seed 1); shuffled control
  4.56 -> 4.50 kB. Clear learning, flat control.
* color, before the prompt-path init (decoder re-draw only): +0.026 (seed 0) and +0.005 (seed 1);
  shuffled control +0.006 and +0.021: indistinguishable.
* color with ``vae_init = "signal"`` scaling the text->image attention path x4 (digenrl/models/_toy.py):
  seed 0 +0.024 (0.449 -> 0.473; control +0.014), seed 1 +0.003 (control -0.000); jpeg (same init) JPEG
  size still falls ~31% (reward -0.0091 -> -0.0063). Better, still NOT a clear, reliable margin: the
  policy-gradient SNR for a low-dimensional statistic (mean colour) of a 1024-element latent is low.
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
_PROMPT_SET = {"color": "color", "ocr": "ocr"}


def window_stats(curve: list[float], w: int = 5) -> dict[str, float]:
    """First/last-window means, the gain, and the gain in units of its standard error."""
    first, last = curve[:w], curve[-w:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = math.sqrt(statistics.pvariance(first) / len(first) + statistics.pvariance(last) / len(last)) or float("nan")
    return {"first": statistics.fmean(first), "last": statistics.fmean(last), "gain": gain, "gain_in_noise": gain / se}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from digenrl.config import load_config
    from digenrl.recipes.colocated import train

    overrides = [
        f"train.iterations={args.iters}",
        f"reward.weights={{{args.reward}=1.0}}",
        f"data.prompt_set={_PROMPT_SET.get(args.reward, 'simple')}",
        f"train.control={args.control}",
        f"placement.threads={args.threads}",
        f"log.seed={args.seed}",
        *args.set,
    ]
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    history = train(cfg, write_files=False)
    wall = time.perf_counter() - t0
    curve = [h["reward_mean"] for h in history]
    return {
        "reward": args.reward,
        "control": args.control,
        "iters": args.iters,
        "seed": args.seed,
        "overrides": overrides,
        "curve": curve,
        "summary": window_stats(curve),
        "seconds_total": wall,
        "seconds_per_iter_median": statistics.median(h["seconds"] for h in history),
        "history": history,
        "config": cfg.to_dict(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-qwenimage.toml"))
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--reward", default="color", choices=["color", "jpeg_compressibility", "jpeg_incompressibility", "ocr"])
    ap.add_argument("--control", default="none", choices=["none", "shuffled", "negated"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra config override, e.g. train.lr=3e-2")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    result = run(args)

    from rich.console import Console
    from rich.table import Table

    s = result["summary"]
    table = Table(title=f"learning: {args.reward}, control={args.control}, {args.iters} iterations")
    for col in ("first 5", "last 5", "gain", "gain / s.e.", "s/iter (median)", "total s"):
        table.add_column(col, justify="right")
    table.add_row(f"{s['first']:.4f}", f"{s['last']:.4f}", f"{s['gain']:+.4f}", f"{s['gain_in_noise']:+.1f}",
                  f"{result['seconds_per_iter_median']:.2f}", f"{result['seconds_total']:.1f}")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
