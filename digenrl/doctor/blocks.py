"""One transformer block per model family at its published width: can this stack train it?

Why: on an H200 (torch 2.11, CUDA 13) a real-width FLUX.1 transformer ran forward but its backward
died in cuBLAS (``CUBLAS_STATUS_EXECUTION_FAILED``, cublasLt gemm m 12288 n 1024 k 3072: the text
stream's feed-forward ``ff_context`` at 2 x 512 text tokens), while Qwen-Image trained. Such a
failure follows the gemm shapes (and the cuBLAS build), so only the published width can show it; one
block has every gemm shape of its transformer's blocks, and a user learns it in seconds instead of
after loading 24 GB. Whether one block reproduces that failure of the whole FLUX.1 is not known yet:
this has not run on a GPU.

Each family's block is the diffusers class its transformer stacks (the double-stream block where
there are two kinds), built from the transformer config of :data:`digenrl.models.full.FULL_CONFIGS`
with random weights, called the way the transformer's own ``forward`` calls it (rotary embeddings
from the family's own rope module, ``temb`` of the block's shape, the text mask where the model
passes one), then trained once: forward, a mean-square loss, backward into every parameter.

:func:`block_check` runs one family in this process on any device: the doctor's GPU check
(:func:`check_blocks`, in a spawned process, a fresh one after each failure) and its CPU twin in the
tests (fewer heads, a few tokens, float32) are the same code.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["FAMILIES", "BlockShape", "GPU_SHAPES", "BlockCase", "build_block", "block_check", "check_blocks"]

FAMILIES = ("qwenimage", "flux", "wan21", "hunyuanvideo", "sd3")


@dataclass(frozen=True)
class BlockShape:
    """The tokens one block sees: ``batch`` rows of a ``frames x height x width`` token grid (after
    the VAE and the patching) and ``text_tokens`` prompt tokens."""

    batch: int
    frames: int
    height: int
    width: int
    text_tokens: int

    @property
    def image_tokens(self) -> int:
        return self.frames * self.height * self.width


# 512 x 512 pixels: VAE /8 -> 64 x 64 latents, 2 x 2 patches -> 32 x 32 tokens (one frame for the video
# families). Text: the ``pretrained`` text_len of each adapter (digenrl.models.<family>.create), i.e. the
# pipelines' max_sequence_length; batch 2 as a LoRA/full training pass uses (the FLUX failure was B=2 x 512).
GPU_SHAPES = {
    "qwenimage": BlockShape(2, 1, 32, 32, 512),
    "flux": BlockShape(2, 1, 32, 32, 512),
    "wan21": BlockShape(2, 1, 32, 32, 512),
    "hunyuanvideo": BlockShape(2, 1, 32, 32, 256),
    "sd3": BlockShape(2, 1, 32, 32, 77 + 128),  # CLIP's 77 tokens beside T5's text_len
}


_Gen = torch.Generator | None  # None on the meta device, which has no generator
_Run = Callable[[], tuple[torch.Tensor, ...]]
_Built = tuple[torch.nn.Module, _Run]  # what a family's builder returns: the block and its forward


@dataclass
class BlockCase:
    """One block on its device with its inputs: ``run()`` is the forward, returning every output stream."""

    family: str
    variant: str
    block: torch.nn.Module
    run: _Run
    dim: int
    heads: int


def _transformer_config(family: str, variant: str) -> tuple[str, dict[str, Any]]:
    from digenrl.models.full import FULL_CONFIGS, default_variant

    if family not in FULL_CONFIGS:
        raise ValueError(f"unknown model family {family!r}; the block check knows: {', '.join(FAMILIES)}")
    variant = variant or default_variant(family)
    return variant, dict(FULL_CONFIGS[family][variant]["transformer"][1])


def _randn(*shape: int, device: torch.device, dtype: torch.dtype, gen: _Gen) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=gen).to(dtype)


def _qwenimage(cfg: dict[str, Any], s: BlockShape, dev: torch.device, dt: torch.dtype, gen: _Gen) -> _Built:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock

    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    block = QwenImageTransformerBlock(dim, cfg["num_attention_heads"], cfg["attention_head_dim"])
    rope = QwenEmbedRope(theta=10000, axes_dim=list(cfg["axes_dims_rope"]), scale_rope=True)  # as the model builds it
    freqs = rope([(s.frames, s.height, s.width)], device=dev, max_txt_seq_len=s.text_tokens)
    x = _randn(s.batch, s.image_tokens, dim, device=dev, dtype=dt, gen=gen)
    txt = _randn(s.batch, s.text_tokens, dim, device=dev, dtype=dt, gen=gen)
    temb = _randn(s.batch, dim, device=dev, dtype=dt, gen=gen)
    mask = torch.ones(s.batch, s.text_tokens, dtype=torch.bool, device=dev)  # digenrl passes the prompt mask

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(block(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, temb=temb,
                           image_rotary_emb=freqs))

    return block, run


def _flux(cfg: dict[str, Any], s: BlockShape, dev: torch.device, dt: torch.dtype, gen: _Gen) -> _Built:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock

    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    block = FluxTransformerBlock(dim, cfg["num_attention_heads"], cfg["attention_head_dim"])
    # Position ids as the pipeline makes them: text at 0, image tokens at (0, row, column).
    img_ids = torch.zeros(s.height, s.width, 3, device=dev, dtype=torch.float32)
    img_ids[..., 1] += torch.arange(s.height, device=dev)[:, None]
    img_ids[..., 2] += torch.arange(s.width, device=dev)[None, :]
    ids = torch.cat([torch.zeros(s.text_tokens, 3, device=dev, dtype=torch.float32), img_ids.reshape(-1, 3)])
    freqs = FluxPosEmbed(theta=10000, axes_dim=list(cfg["axes_dims_rope"]))(ids)
    x = _randn(s.batch, s.image_tokens, dim, device=dev, dtype=dt, gen=gen)
    txt = _randn(s.batch, s.text_tokens, dim, device=dev, dtype=dt, gen=gen)
    temb = _randn(s.batch, dim, device=dev, dtype=dt, gen=gen)

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(block(hidden_states=x, encoder_hidden_states=txt, temb=temb, image_rotary_emb=freqs))

    return block, run


def _grid(cfg_patch: Any, s: BlockShape, dev: torch.device) -> torch.Tensor:
    """An empty latent of the pixel grid the video ropes read their sizes from (only its shape is used)."""
    pt, ph, pw = cfg_patch
    return torch.empty(1, 0, s.frames * pt, s.height * ph, s.width * pw, device=dev)


def _wan21(cfg: dict[str, Any], s: BlockShape, dev: torch.device, dt: torch.dtype, gen: _Gen) -> _Built:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    block = WanTransformerBlock(dim, cfg["ffn_dim"], cfg["num_attention_heads"], cfg["qk_norm"], cfg["cross_attn_norm"],
                                cfg["eps"])
    rope = WanRotaryPosEmbed(cfg["attention_head_dim"], cfg["patch_size"], cfg["rope_max_seq_len"])
    freqs = rope(_grid(cfg["patch_size"], s, dev))
    x = _randn(s.batch, s.image_tokens, dim, device=dev, dtype=dt, gen=gen)
    txt = _randn(s.batch, s.text_tokens, dim, device=dev, dtype=dt, gen=gen)  # the text after the condition embedder
    temb = _randn(s.batch, 6, dim, device=dev, dtype=dt, gen=gen)  # timestep_proj unflattened to (B, 6, dim)

    def run() -> tuple[torch.Tensor, ...]:
        return (block(x, txt, temb, freqs),)

    return block, run


def _hunyuanvideo(cfg: dict[str, Any], s: BlockShape, dev: torch.device, dt: torch.dtype, gen: _Gen) -> _Built:
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoRotaryPosEmbed,
        HunyuanVideoTransformerBlock,
    )

    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    block = HunyuanVideoTransformerBlock(cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["mlp_ratio"],
                                         cfg["qk_norm"])
    rope = HunyuanVideoRotaryPosEmbed(cfg["patch_size"], cfg["patch_size_t"], list(cfg["rope_axes_dim"]),
                                      cfg["rope_theta"])
    patch = (cfg["patch_size_t"], cfg["patch_size"], cfg["patch_size"])
    freqs = rope(_grid(patch, s, dev))
    x = _randn(s.batch, s.image_tokens, dim, device=dev, dtype=dt, gen=gen)
    txt = _randn(s.batch, s.text_tokens, dim, device=dev, dtype=dt, gen=gen)
    temb = _randn(s.batch, dim, device=dev, dtype=dt, gen=gen)
    # The model always passes a [B, 1, 1, image + text] mask (all true: no padded prompt tokens here).
    mask = torch.ones(s.batch, 1, 1, s.image_tokens + s.text_tokens, dtype=torch.bool, device=dev)

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(block(x, txt, temb, mask, freqs))

    return block, run


def _sd3(cfg: dict[str, Any], s: BlockShape, dev: torch.device, dt: torch.dtype, gen: _Gen) -> _Built:
    from diffusers.models.attention import JointTransformerBlock

    # SD3.5 Medium's first blocks add a second image-only attention (MMDiT-X): the check builds that kind
    # where the variant has it. No rotary embedding: SD3 adds its positions before the blocks.
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    block = JointTransformerBlock(dim, cfg["num_attention_heads"], cfg["attention_head_dim"], qk_norm=cfg["qk_norm"],
                                  use_dual_attention=bool(cfg.get("dual_attention_layers")))
    x = _randn(s.batch, s.image_tokens, dim, device=dev, dtype=dt, gen=gen)
    txt = _randn(s.batch, s.text_tokens, dim, device=dev, dtype=dt, gen=gen)  # after the context embedder
    temb = _randn(s.batch, dim, device=dev, dtype=dt, gen=gen)

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(block(hidden_states=x, encoder_hidden_states=txt, temb=temb))

    return block, run


_BUILDERS = {"qwenimage": _qwenimage, "flux": _flux, "wan21": _wan21, "hunyuanvideo": _hunyuanvideo, "sd3": _sd3}


def build_block(family: str, shape: BlockShape, *, device: str | torch.device = "cuda",
                dtype: torch.dtype = torch.bfloat16, heads: int | None = None, variant: str = "",
                seed: int = 0) -> BlockCase:
    """``family``'s block with random weights on ``device`` in ``dtype``, and its inputs for ``shape``.

    Args:
        family: one of :data:`FAMILIES`.
        shape: the tokens the block sees.
        device: where the block is built (constructed there: no host copy of a real-width block);
            ``meta`` builds it without values, for a test that no host tensor reaches it.
        dtype: parameter and activation dtype.
        heads: attention heads; ``None`` is the published count (the real width). Fewer heads keep the
            head width, so the rotary axes still fit; Wan's feed-forward shrinks in proportion.
        variant: the size of a family with several (``FULL_CONFIGS``); empty: the largest.
        seed: weights and inputs, drawn from a generator of their own (the global RNG is left alone).

    Raises:
        ValueError: unknown family, or ``heads`` not positive.
    """
    variant, cfg = _transformer_config(family, variant)
    if heads is not None:
        if heads < 1:
            raise ValueError(f"heads must be positive, got {heads}")
        if "ffn_dim" in cfg:
            cfg["ffn_dim"] = max(1, cfg["ffn_dim"] * heads // cfg["num_attention_heads"])
        cfg["num_attention_heads"] = heads
    dev = torch.device(device)
    # The meta device (the tests' stand-in for a GPU: a host tensor reaching the block fails there as on
    # CUDA) has no generator; its tensors hold no values anyway.
    gen = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(seed)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    default = torch.get_default_dtype()
    # Built where it runs and in its dtype from the start: a real-width block never exists on the host or
    # in float32 (Wan2.1 14B's is 0.35 B parameters).
    with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.device(dev):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            block, run = _BUILDERS[family](cfg, shape, dev, dtype, gen)
        finally:
            torch.set_default_dtype(default)
    block = block.to(dtype=dtype).train()  # a module that picked its own dtype follows the check's
    return BlockCase(family, variant, block, run, cfg["num_attention_heads"] * cfg["attention_head_dim"],
                     cfg["num_attention_heads"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, rounds: int) -> float:
    """Median milliseconds of ``fn`` over ``rounds`` (after the call that already ran once)."""
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _train_once(case: BlockCase) -> None:
    case.block.zero_grad(set_to_none=True)
    torch.stack([o.float().pow(2).mean() for o in case.run()]).sum().backward()


def _gradient_gaps(block: torch.nn.Module) -> list[str]:
    """Parameters the backward did not reach, or reached with a non-finite gradient."""
    return [f"{name} ({'no gradient' if p.grad is None else 'non-finite gradient'})"
            for name, p in block.named_parameters()
            if p.grad is None or not bool(torch.isfinite(p.grad).all())]


def block_check(family: str, shape: BlockShape | None = None, *, device: str | torch.device = "cuda",
                dtype: torch.dtype = torch.bfloat16, heads: int | None = None, variant: str = "",
                rounds: int = 5) -> dict[str, Any]:
    """Build ``family``'s block (:func:`build_block`), run it forward and train it once, then time both.

    NEVER RUN ON A GPU YET: with ``device="cuda"`` (the doctor's check) this has only run as its CPU twin
    (``device="cpu"``, float32, fewer heads and tokens, in the tests); the CUDA path differs only in where
    the tensors live and the ``torch.cuda.synchronize`` around each timed call.

    Raises:
        ValueError: unknown family (a bug in the caller, not a finding about this machine).

    Returns:
        ``ok``, the phase that failed (``build``, ``forward``, ``backward`` or ``gradients``) and its
        error, else ``forward_ms`` (no grad, a rollout step) and ``train_ms`` (forward + backward),
        medians of ``rounds``; the shape and dtype either way, and once built the hidden size ``dim``,
        the heads and the parameter count.
    """
    if family not in GPU_SHAPES:
        raise ValueError(f"unknown model family {family!r}; the block check knows: {', '.join(FAMILIES)}")
    shape = shape or GPU_SHAPES[family]
    dev = torch.device(device)
    out: dict[str, Any] = {"family": family, "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
                           "shape": asdict(shape)}
    phase = "build"
    try:
        case = build_block(family, shape, device=dev, dtype=dtype, heads=heads, variant=variant)
        out.update(variant=case.variant, dim=case.dim, heads=case.heads,
                   params=sum(p.numel() for p in case.block.parameters()))
        phase = "forward"
        with torch.no_grad():
            case.run()
            _sync(dev)
            forward_ms = _timed(case.run, dev, rounds)
        phase = "backward"
        _train_once(case)
        _sync(dev)
        phase = "gradients"
        if gaps := _gradient_gaps(case.block):
            raise RuntimeError(f"{len(gaps)} parameters not trained: {', '.join(gaps[:5])}")
        phase = "backward"
        train_ms = _timed(lambda: _train_once(case), dev, rounds)
    except Exception as exc:  # the finding: which family, which phase, which error
        out.update(ok=False, phase=phase, error=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc(limit=8))
        return out
    out.update(ok=True, forward_ms=forward_ms, train_ms=train_ms)
    return out


def _child(families: list[str], kwargs: dict[str, Any], results: Any) -> None:
    for family in families:
        r = block_check(family, **kwargs)
        results.put(r)
        if not r["ok"]:
            return  # a CUDA error can be sticky: the families after it start in a fresh process


def _next_result(results: Any, proc: Any, timeout_s: float) -> dict[str, Any] | str:
    """The child's next result, or why none came (it exited, or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
    try:  # a result put just before the process exited is in the pipe by now (flushed at exit)
        return results.get(timeout=0.5)
    except queue.Empty:
        return f"exited with code {proc.exitcode}" if not proc.is_alive() else f"gave no result within {timeout_s:.0f} s"


def _in_child(families: list[str], timeout_s: float, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """``block_check`` of ``families`` in order in one spawned process, up to the first failure.

    A family whose process died or hung (``timeout_s`` after the previous result) gets a ``process`` error.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(families, kwargs, results), name="digenrl-doctor-blocks")
    proc.start()
    got: list[dict[str, Any]] = []
    try:
        for family in families:
            r = _next_result(results, proc, timeout_s)
            got.append(r if isinstance(r, dict) else
                       {"family": family, "ok": False, "phase": "process", "error": f"the check process {r}"})
            if not got[-1]["ok"]:
                break
        return got
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def check_blocks(families: tuple[str, ...] = FAMILIES, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 timeout_s: float = 120.0, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """One entry per family: its block at the published width on ``device`` (:func:`block_check`).

    The families run in a spawned process, so that a broken CUDA context or a hang stays out of the
    doctor's other checks; after a failure the rest go on in a fresh one.

    NEVER RUN ON A GPU YET (see :func:`block_check`).
    """
    out: dict[str, dict[str, Any]] = {}
    todo = list(families)
    while todo:
        got = _in_child(todo, timeout_s, {"device": device, "dtype": dtype, **kwargs})
        out.update((r["family"], r) for r in got)
        todo = todo[len(got):]
    return out


def problems(blocks: dict[str, Any]) -> list[str]:
    """A line per family whose block failed: it cannot train on this stack at its published width."""
    if "error" in blocks:  # the check itself broke before any family ran
        return [f"gpu check blocks failed: {blocks['error']}"]
    return [f"{family}: a real-width block cannot train on this stack: {r.get('phase')} failed: {r.get('error')}"
            for family, r in blocks.items() if isinstance(r, dict) and r.get("ok") is False]

