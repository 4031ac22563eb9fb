"""One member of a sequence-parallel group, or the SP = 1 reference: the numbers a trainer and a rollout rely on.

``python tests/models/_sp_member.py --rank R --world N --port P --out DIR CASE [CASE ...]`` joins a gloo group on
127.0.0.1:P, runs every case with the model parallelized over it, and writes ``DIR/CASE.R.pt``. ``--world 1`` runs
the same code without a group: the reference. ``--groups G`` splits the world into G SP groups of N / G (the
``(dp, sp)`` mesh of data-parallel SP trainers); group g runs on inputs of its own, those of ``--shift g``. A case is a tiny model config (``CASES``); for each it measures the
guided velocity, a rollout's log-probs, Flow-GRPO's packed training pass (loss sums, gradients, one AdamW step),
the parity recompute and DiffusionNFT's rows (loss sums, gradients).
"""

from __future__ import annotations

import argparse
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

CASES: dict[str, dict[str, Any]] = {
    "wan21": {"name": "wan21", "preset": "tiny", "num_frames": 5, "text_len": 8},  # 2x4x4 = 32 latent tokens
    "wan22": {"name": "wan22", "preset": "tiny", "text_len": 8},  # both experts: rows on each side of the boundary
    # 64 latent + 16 text tokens, the second prompt's 13 (text mask padding on the second member)
    "hunyuanvideo": {"name": "hunyuanvideo", "preset": "tiny", "text_len": 16},
    "qwenimage": {"name": "qwenimage", "preset": "tiny", "text_len": 16},  # 16 image + 16 text tokens (negative: 14)
    # every weight trained (the embedders computed whole on each member too), the KL to the parallel reference copy
    "wan21_full": {"name": "wan21", "preset": "tiny", "num_frames": 5, "text_len": 8, "finetune": "full"},
}
TRAIN: dict[str, dict[str, Any]] = {"wan21_full": {"kl_beta": 0.5}}
PROMPTS = [["a red square", "sky"], ["a blue circle on grass", "rain"]]  # by input shift


DEVICE = "cpu"  # --device: "cuda" puts member r on cuda:r (NCCL), the reference on cuda:0
SHIFT = 0  # which inputs: --shift, or the SP group's index under --groups (same weights, other prompts and noise)
MESH: Any = None  # the world's (dp, sp) mesh under --groups


def _config(case: str, algorithm: str) -> Any:
    from digenrl.config import config_from_dict

    return config_from_dict({"model": {**CASES[case], "device": DEVICE}, "train": {"algorithm": algorithm, **TRAIN.get(case, {})},
                             "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 1}})


def _grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _sums(parts: list[dict[str, Any]]) -> torch.Tensor:
    """The passes' diagnostic sums, added, in key order."""
    keys = sorted(k for k in parts[0] if isinstance(parts[0][k], torch.Tensor))
    return torch.stack([sum(p[k] for p in parts).float() for k in keys])


def _model(case: str, algorithm: str, group: dist.ProcessGroup | None) -> tuple[Any, Any, list[torch.nn.Parameter]]:
    from digenrl.algorithms import algorithm_for
    from digenrl.models.sequence_parallel import parallelize
    from digenrl.policy import build_model

    cfg = _config(case, algorithm)
    model, params = build_model(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # trained weights (LoRA: B != 0) that differ from the reference, the same on every member
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    if group is not None:
        if MESH is not None:  # every group enters at once, as trainers do: the groups' set-ups meet
            dist.barrier()
        parallelize(model, group, MESH)
    return model, algorithm_for(cfg, model), params


def flow_grpo(case: str, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Velocity, rollout log-probs, the packed training pass, one optimizer step, the parity recompute."""
    from digenrl.algorithms import Backward
    from digenrl.models import repeat_cond
    from digenrl.models.sequence_parallel import sync_gradients
    from digenrl.rl.rollout import rollout_steps

    model, algo, params = _model(case, "flow_grpo", group)
    cond = repeat_cond(model.encode_prompts(PROMPTS[SHIFT]), 2)
    x = model.prepare_latents(4, generator=torch.Generator().manual_seed(1 + 10 * SHIFT))
    sigma = torch.tensor([0.95, 0.8, 0.5, 0.2])  # Wan2.2: rows of both experts
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["velocity"] = model.velocity(x, sigma, cond)
    sigmas = algo.sigmas
    plan = algo.step_plan([0, 0, 1, 1], [0, 1, 2, 3], seed=3 + SHIFT, version=0)
    start = time.perf_counter()
    ro = rollout_steps(model.velocity, x, cond, sigmas, plan, 0, len(sigmas) - 1, noise_level=algo.cfg.rollout.noise_level,
                       generator=torch.Generator().manual_seed(2 + 10 * SHIFT))
    out["rollout_seconds"] = torch.tensor(time.perf_counter() - start)
    batch = ro.transitions
    out["log_prob"], out["x_final"] = batch.log_prob, ro.x
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device=model.device)
    sums = algo.backward(batch, cond, adv, Backward("packed", normalizer=float(len(batch))), version=0)
    sync_gradients(params, group)
    out["train_sums"], out["grad"] = _sums(sums), _grads(params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    out["stepped"] = torch.cat([p.detach().flatten() for p in params])
    out["parity_sums"] = _sums([algo.parity_recompute(batch, cond, max_rows=4)])
    from digenrl.models._sp_plans import transformers_of

    out["parallel_modules"] = torch.tensor(sum(m._parallel_config is not None for m in transformers_of(model)))
    return out


def nft(case: str, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """DiffusionNFT's training rows: loss sums and gradients."""
    from digenrl.algorithms import Backward
    from digenrl.models import repeat_cond
    from digenrl.models.sequence_parallel import sync_gradients

    model, algo, params = _model(case, "nft", group)
    n = 4
    y = torch.randn(n, *model.prepare_latents(1).shape[1:], generator=torch.Generator().manual_seed(5 + 10 * SHIFT))
    trans = {"sample": torch.arange(n), "y": y, "probe": torch.zeros(n)}
    rows = algo.token_rows(trans, (0, n * algo.rows_per_sample), torch.ones(n, dtype=torch.bool), 0, list(range(n)), 0)
    cond = repeat_cond(model.encode_prompts(PROMPTS[SHIFT]), 2)
    adv = torch.tensor([1.5, -0.5, 0.3, -1.2], device=model.device)
    sums = algo.backward(rows.to(model.device), cond, adv, Backward("packed"), version=1)
    sync_gradients(params, group)
    return {"nft_sums": _sums(sums), "nft_grad": _grads(params)}


def refusals(group: dist.ProcessGroup) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The ConfigError messages for a text length and a latent size the group does not divide, and
    :func:`attention` with the parallel config of the Wan2.1 transformer parallelized for them."""
    from digenrl.errors import ConfigError
    from digenrl.models import load_model
    from digenrl.models.sequence_parallel import parallelize

    found: dict[str, str] = {}
    degree = dist.get_world_size(group)
    try:
        parallelize(load_model("qwenimage", "tiny", text_len=2 * degree + 1), group, MESH)
    except ConfigError as exc:
        found["text_len"] = str(exc)
    wan = load_model("wan21", "tiny", text_len=8)
    parallelize(wan, group, MESH)
    x = torch.zeros(1, 16, 1, 6, 6)  # 3x3 = 9 latent tokens
    try:
        wan.velocity(x, torch.tensor([0.5]), wan.encode_prompts(["a"]))
    except ConfigError as exc:
        found["forward"] = str(exc)
    found_attention = attention(wan.pipe.transformer.blocks[0].attn1.processor._parallel_config, group)
    return found, found_attention


def attention(parallel_config: Any, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """diffusers' Ulysses attention on this member's shard of seeded ``q, k, v [B, S, H, D]``: the output shard and
    the gradients of ``sum(out * w)`` with respect to the whole q, k, v, summed over the group."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    gen = torch.Generator().manual_seed(11)
    q, k, v, w = (torch.randn(2, 8, 4, 6, generator=gen) for _ in range(4))
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    shards = [t.chunk(degree, dim=1)[rank] for t in leaves]
    out = dispatch_attention_fn(*shards, parallel_config=parallel_config)
    (out * w.chunk(degree, dim=1)[rank]).sum().backward()
    grads = [t.grad for t in leaves]
    for g in grads:
        dist.all_reduce(g, group=group)
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nft", action="store_true", help="also DiffusionNFT's rows")
    parser.add_argument("--refusals", action="store_true", help="also the refused sizes' messages")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--groups", type=int, default=1, help="SP groups the world splits into")
    parser.add_argument("--shift", type=int, default=0, help="the reference: which group's inputs")
    parser.add_argument("cases", nargs="+")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    global DEVICE, SHIFT, MESH
    DEVICE = f"cuda:{a.rank}" if a.device == "cuda" else "cpu"
    SHIFT = a.shift
    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
    group = None
    if a.world > 1:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                                timeout=datetime.timedelta(seconds=120))
        group = dist.group.WORLD
        if a.groups > 1:
            from digenrl.models.sequence_parallel import dp_sp_mesh

            MESH = dp_sp_mesh(a.world // a.groups, "cuda" if a.device == "cuda" else "cpu")
            group, SHIFT = MESH.get_group("sp"), a.rank // (a.world // a.groups)
    for case in a.cases:
        result: dict[str, Any] = flow_grpo(case, group)
        if a.nft:
            result.update(nft(case, group))
        torch.save({k: v.cpu() for k, v in result.items()}, f"{a.out}/{case}.{a.rank}.pt")
    if a.refusals and group is not None:
        messages, attn = refusals(group)
        torch.save(messages, f"{a.out}/refusals.{a.rank}.pt")
        torch.save(attn, f"{a.out}/attention.{a.rank}.pt")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
