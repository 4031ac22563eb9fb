"""Pretrain the tiny Qwen-Image preset on the shapes dataset, so the default RL run starts from a model that draws.

    nice -n 10 python bench/pretrain_tiny.py      # checkpoints/tiny4x-shapes: ~21 CPU minutes, one thread

The model is the one ``configs/tiny-qwenimage.toml`` builds (``model.init`` cleared): the tiny4x preset
at 32 px, its random byte-level Qwen2.5-VL text encoder kept frozen (it is saved too, so the checkpoint
does not depend on ``model.seed``). Two stages, both deterministic in ``--seed`` (same torch, same
thread count):

1. the VAE as a deterministic autoencoder on the shapes images (the encoder's mean is the latent; L1 +
   MSE reconstruction, a tiny L2 on the latent), from He-initialised convs (at PyTorch's default init
   this VAE barely passes a signal and its loss did not move in 150 steps; He init, gain 1.4: L1 0.99 ->
   0.31 in 100; sampling the latent with the posterior's std, which starts at 1, also stalled it); its latent is then normalised per channel by folding the dataset's latent mean and std
   into ``quant_conv`` / ``post_quant_conv``, so the latent the sampler starts from (N(0, I)) has the
   scale of the data and the architecture stays exactly the preset's;
2. the transformer with plain rectified flow matching on those latents: ``x_s = (1 - s) x0 + s e``,
   target ``e - x0``, ``s`` uniform, conditional on the prompt's embeddings (guidance 1, as the run); the
   rate warms up over 100 steps, then decays to 0 on a cosine (``--lr-decay``). The shipped tiny4x
   checkpoint took 12000 steps (its ODE samples score 0.632 on the ``shapes`` reward, recipe.json).

It writes ``model.safetensors`` (every weight of the three components, fp32, ~2 MB), ``recipe.json``
(arguments, versions, the checkpoint's sha256, the sampled reward) and ``samples.png`` (ODE samples of
16 prompts, the sampler the RL run uses with noise 0). ``model.init`` loads it and checks the sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rel(p: Path) -> str:
    """``p`` relative to the checkout when inside it (recipes do not record a machine's paths)."""
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def build(config: Path, preset: str = ""):  # noqa: ANN201 - the model type lives below this script
    from digenrl.config import load_config
    from digenrl.models import load_model

    chosen = [f"model.preset={preset}"] if preset else []
    cfg = load_config(config, ["model.init=''", "model.vae_init=default", *chosen])
    m = cfg.model
    model = load_model(m.name, m.preset, seed=m.seed, resolution=(m.resolution[0], m.resolution[1]),
                       guidance_scale=m.guidance_scale, text_len=m.text_len or None)
    return cfg, model


def he_init(module, seed: int, gain: float = 1.4) -> None:  # noqa: ANN001
    """Re-draw every conv weight from N(0, gain^2 / fan_in), biases zero."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in module.modules():
            if isinstance(mod, torch.nn.Conv2d | torch.nn.Conv3d):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * (gain / math.sqrt(mod.weight[0].numel())))
                if mod.bias is not None:
                    mod.bias.zero_()


def _step(loss, module, opt, sched) -> None:  # noqa: ANN001
    """One clipped optimizer step of both pretraining phases."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    sched.step()


def train_vae(vae, args, log) -> None:  # noqa: ANN001
    import torch

    from digenrl.data.shapes import shapes_batch

    he_init(vae, args.seed)
    opt = torch.optim.Adam(vae.parameters(), lr=args.vae_lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.vae_steps)
    for step in range(args.vae_steps):
        imgs, _ = shapes_batch(args.seed, step * args.vae_batch, args.vae_batch, size=args.size)
        x = (imgs * 2 - 1)[:, :, None]
        z = vae.encode(x).latent_dist.mean
        rec = vae.decode(z).sample
        l1 = (rec - x).abs().mean()
        loss = l1 + (rec - x).pow(2).mean() + args.latent_l2 * z.pow(2).mean()
        _step(loss, vae, opt, sched)
        if step % 100 == 0 or step == args.vae_steps - 1:
            log(f"vae {step:5d}  L1 {l1.item():.4f}")


def normalise_latent(vae, args) -> dict[str, list[float]]:  # noqa: ANN001
    """Fold the per-channel mean/std of the data's latent means into the 1x1x1 convs around the latent."""
    import torch

    from digenrl.data.shapes import shapes_batch

    with torch.no_grad():
        imgs, _ = shapes_batch(args.seed + 1, 0, 1024, size=args.size)
        mu = vae.encode((imgs * 2 - 1)[:, :, None]).latent_dist.mean  # [N, z, 1, h, w]
        mean = mu.mean(dim=(0, 2, 3, 4))
        std = mu.std(dim=(0, 2, 3, 4)).clamp(min=1e-3)
        z = mean.numel()
        q = vae.quant_conv  # 2z -> 2z; the first z outputs are the mean, the rest the log-variance
        q.weight[:z] /= std.view(-1, 1, 1, 1, 1)
        q.bias[:z] = (q.bias[:z] - mean) / std
        q.bias[z:] -= 2 * std.log()  # var scales by 1/std^2
        p = vae.post_quant_conv  # z -> z: undo the normalisation on the way in
        p.bias += (p.weight[:, :, 0, 0, 0] @ mean)
        p.weight *= std.view(1, -1, 1, 1, 1)
    return {"mean": mean.tolist(), "std": std.tolist()}


def train_transformer(model, args, log) -> None:  # noqa: ANN001
    import math

    import torch

    from digenrl.data.shapes import SHAPE_PROMPTS, shapes_batch
    from digenrl.models._common import pack_2x2

    vae, tr = model.pipe.vae, model.pipe.transformer
    cond = model.encode_prompts(list(SHAPE_PROMPTS))
    index = {p: k for k, p in enumerate(SHAPE_PROMPTS)}
    opt = torch.optim.AdamW(tr.parameters(), lr=args.lr, weight_decay=0.0)

    def rate(step: int) -> float:
        """Warm-up over 100 steps; with ``cosine`` then down to 0 by the last step (a fixed budget's usual schedule)."""
        warm = min(1.0, (step + 1) / 100)
        return warm * 0.5 * (1 + math.cos(math.pi * step / args.steps)) if args.lr_decay == "cosine" else warm

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    gen = torch.Generator().manual_seed(args.seed + 2)
    tr.train()
    for step in range(args.steps):
        imgs, prompts = shapes_batch(args.seed + 3, step * args.batch, args.batch, size=args.size)
        with torch.no_grad():
            x0 = pack_2x2(vae.encode((imgs * 2 - 1)[:, :, None]).latent_dist.mean[:, :, 0])
        b = x0.shape[0]
        noise = torch.randn(x0.shape, generator=gen)
        s = torch.rand(b, generator=gen)
        xs = (1 - s.view(-1, 1, 1)) * x0 + s.view(-1, 1, 1) * noise
        rows = torch.tensor([index[p] for p in prompts])
        v = model.transformer_forward(xs, s, cond["prompt_embeds"][rows], cond["prompt_mask"][rows])
        loss = (v - (noise - x0)).pow(2).mean()
        _step(loss, tr, opt, sched)
        if step % 200 == 0 or step == args.steps - 1:
            log(f"flow {step:5d}  loss {loss.item():.4f}")
    tr.eval()


def sample_and_score(model, args, out: Path) -> float:  # noqa: ANN001
    """ODE samples (the run's sigmas, noise 0) of 16 prompts; returns their mean ``shapes`` reward."""
    import torch

    from digenrl.data.shapes import SHAPE_PROMPTS
    from digenrl.recipes.colocated import save_grid
    from digenrl.rewards import make_reward

    prompts = [SHAPE_PROMPTS[k] for k in range(0, len(SHAPE_PROMPTS), len(SHAPE_PROMPTS) // 16)][:16]
    with torch.no_grad():
        cond = model.encode_prompts(prompts)
        x = model.prepare_latents(len(prompts), generator=torch.Generator().manual_seed(args.seed + 4))
        sig = model.sigmas(args.sample_steps)
        for i in range(args.sample_steps):
            x = x + (sig[i + 1] - sig[i]) * model.velocity(x, sig[i].expand(x.shape[0]), cond)
        images = model.decode(x)
    save_grid(images, out / "samples.png")
    return float(make_reward("shapes").score(images, prompts).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-qwenimage.toml")
    ap.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "tiny4x-shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="", help="model.preset instead of the config's (tiny4x: 4x-downsampling VAE)")
    ap.add_argument("--threads", type=int, default=1)  # 2 threads on a shared 2-core machine: 5x slower
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--vae-steps", type=int, default=800)
    ap.add_argument("--vae-lr", type=float, default=3e-3)
    ap.add_argument("--latent-l2", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=12000, help="flow-matching steps of the transformer")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-decay", choices=("constant", "cosine"), default="cosine", help="the transformer's lr after warm-up")
    ap.add_argument("--sample-steps", type=int, default=6)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    cfg, model = build(args.config, args.preset)
    args.size = cfg.model.resolution[0]
    if cfg.model.resolution[0] != cfg.model.resolution[1]:
        sys.exit(f"{args.config}: model.resolution must be square for the shapes dataset")
    vae = model.pipe.vae.train()
    train_vae(vae, args, log)
    vae.eval()
    stats = normalise_latent(vae, args)
    train_transformer(model, args, log)

    args.out.mkdir(parents=True, exist_ok=True)
    state = {f"{comp}.{k}": v.detach().contiguous().clone() for comp in ("transformer", "vae", "text_encoder")
             for k, v in getattr(model.pipe, comp).state_dict().items()}
    ckpt = args.out / "model.safetensors"
    save_file(state, str(ckpt))
    reward = sample_and_score(model, args, args.out)
    import diffusers

    recipe = {
        "what": "tiny Qwen-Image preset pretrained on the shapes dataset (bench/pretrain_tiny.py)",
        "command": "python bench/pretrain_tiny.py " + " ".join(sys.argv[1:]),
        "args": {k: (_rel(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"name": cfg.model.name, "preset": cfg.model.preset, "seed": cfg.model.seed,
                  "resolution": cfg.model.resolution, "text_len": cfg.model.text_len},
        "latent_normalisation": stats,
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        "seconds": round(time.perf_counter() - t0, 1),
        "ode_sample_shapes_reward": round(reward, 4),
        "file": ckpt.name,
        "bytes": ckpt.stat().st_size,
        "sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest(),
    }
    (args.out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    log(f"wrote {ckpt} ({recipe['bytes'] / 1e6:.1f} MB, sha256 {recipe['sha256'][:12]}); ODE samples' shapes reward {reward:.3f}")


if __name__ == "__main__":
    main()
