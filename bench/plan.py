"""Memory-plan benchmark: wall time of `digenrl plan` on the shipped real-model configs, in one process.

    python bench/plan.py                  # table: config, transformer params, seconds, fits
    python bench/plan.py --json out.json  # also write {"rows": [...]}

The first row also pays the diffusers/transformers imports (reported apart, as ``import_s``). Each
plan builds the transformer, VAE and text encoders at real size on the meta device and traces the
activations (2- and 3-block copies); the target is under a minute per config on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CONFIGS = ("qwenimage", "flux", "wan21", "hunyuanvideo", "sd3", "wan22")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    from digenrl.config import load_config
    from digenrl.plan.memory import memory_plan

    import_s = time.perf_counter() - t0
    root = Path(__file__).resolve().parents[1] / "configs"
    rows = []
    for name in CONFIGS:
        start = time.perf_counter()
        plan = memory_plan(load_config(root / f"{name}.toml"))
        rows.append({"config": f"configs/{name}.toml", "transformer_params": plan.transformer_params,
                     "seconds": round(time.perf_counter() - start, 2), "fits": plan.fits,
                     "bytes_per_device": {r: m.bytes_per_device for r, m in plan.roles.items()}})
    print(f"imports: {import_s:.1f} s")
    for r in rows:
        per = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in r["bytes_per_device"].items())
        print(f"{r['config']:28s} {r['transformer_params'] / 1e9:6.2f} B  {r['seconds']:6.1f} s  "
              f"fits={r['fits']}  ({per})")
    if args.json:
        args.json.write_text(json.dumps({"import_s": import_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
