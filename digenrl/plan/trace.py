"""Peak activation memory of one pass, measured by tracing it on the meta device.

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every tensor an operator creates and keeps the
bytes of the storages still alive (a storage is freed when its last tensor goes: a weakref callback).
Its ``peak`` over a forward and backward is what the caching allocator would have to hold for
activations and transient buffers (parameters and their gradients are excluded: they exist before the
trace or are asked for separately). On ``meta`` tensors every operator is a shape computation, so a
20 B model at its real size traces in seconds with no memory at all.

One substitution keeps the trace honest for GPUs: attention runs as a fused kernel there
(FlashAttention / cuDNN), which keeps ``q, k, v``, the output and one float per query and head for
backward, never the ``L x L`` score matrix. On the meta device torch would decompose
``scaled_dot_product_attention`` into the score-matrix math path, so while tracing it is replaced by
:class:`_FusedAttention`, which creates (and saves) exactly what the fused kernels do.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from digenrl.models.full import BLOCK_KEYS, cast_quietly

__all__ = ["LiveBytes", "fused_attention", "transformer_inputs", "trace_pass", "trace_extrapolated", "trace_decode"]


class LiveBytes(TorchDispatchMode):
    """Track live and peak bytes of the storages created inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view of a tensor made before the trace (a parameter's transpose) allocates nothing
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._sizes and key not in inputs:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


class _FusedAttention(torch.autograd.Function):
    """Shape-level twin of a fused attention kernel: output ``[.., Lq, Dv]`` plus ``[.., Lq]`` fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    return _FusedAttention.apply(query, key, value)


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """While active, ``F.scaled_dot_product_attention`` behaves (in memory) like a fused GPU kernel."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


# -- what one model forward looks like on the meta device -------------------------------------------


def transformer_inputs(name: str, transformer: torch.nn.Module, rows: int, height: int, width: int, frames: int,
                       text_len: int, dtype: torch.dtype, cond_hw: tuple[int, int] | None = None,
                       cond_images: int = 1) -> dict[str, Any]:
    """Meta tensors shaped as the adapters' ``transformer_forward`` passes them for ``rows`` rows (``cond_hw``:
    Qwen-Image-Edit's conditioning image size in pixels, default the output's; ``cond_images`` of them)."""
    c = transformer.config

    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dt)

    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    if name == "qwenimage_edit":  # the noise tokens, then each input image's (packed alike)
        ch, cw = cond_hw or (height, width)
        s, s_img = (lat_h // 2) * (lat_w // 2), (ch // 16) * (cw // 16)
        shapes = [(1, lat_h // 2, lat_w // 2)] + [(1, ch // 16, cw // 16)] * cond_images
        return dict(hidden_states=empty(rows, s + cond_images * s_img, c.in_channels), timestep=empty(rows),
                    encoder_hidden_states=empty(rows, text_len, c.joint_attention_dim),
                    encoder_hidden_states_mask=torch.ones(rows, text_len, device="meta", dtype=torch.long),
                    img_shapes=[shapes] * rows, return_dict=False)
    if name == "qwenimage":
        return dict(hidden_states=empty(rows, (lat_h // 2) * (lat_w // 2), c.in_channels), timestep=empty(rows),
                    encoder_hidden_states=empty(rows, text_len, c.joint_attention_dim),
                    encoder_hidden_states_mask=torch.ones(rows, text_len, device="meta", dtype=torch.long),
                    img_shapes=[[(1, lat_h // 2, lat_w // 2)]] * rows, return_dict=False)
    if name == "flux":
        s = (lat_h // 2) * (lat_w // 2)
        return dict(hidden_states=empty(rows, s, c.in_channels), timestep=empty(rows), guidance=empty(rows, dt=torch.float32),
                    pooled_projections=empty(rows, c.pooled_projection_dim),
                    encoder_hidden_states=empty(rows, text_len, c.joint_attention_dim),
                    txt_ids=empty(text_len, 3), img_ids=empty(s, 3), return_dict=False)
    if name == "wan22":  # TI2V-5B's 48-channel VAE compresses 16x in space, A14B's (Wan2.1's) 8x
        s = 16 if c.in_channels == 48 else 8
        return dict(hidden_states=empty(rows, c.in_channels, lat_f, height // s, width // s), timestep=empty(rows),
                    encoder_hidden_states=empty(rows, text_len, c.text_dim), return_dict=False)
    if name == "wan21":
        return dict(hidden_states=empty(rows, c.in_channels, lat_f, lat_h, lat_w), timestep=empty(rows),
                    encoder_hidden_states=empty(rows, text_len, c.text_dim), return_dict=False)
    if name == "hunyuanvideo":
        return dict(hidden_states=empty(rows, c.in_channels, lat_f, lat_h, lat_w), timestep=empty(rows),
                    encoder_hidden_states=empty(rows, text_len, c.text_embed_dim),
                    encoder_attention_mask=torch.ones(rows, text_len, device="meta", dtype=torch.long),
                    pooled_projections=empty(rows, c.pooled_projection_dim), guidance=empty(rows), return_dict=False)
    if name == "sd3":  # the sequence: 77 CLIP tokens, then text_len T5 tokens (pipeline.encode_prompt)
        return dict(hidden_states=empty(rows, c.in_channels, lat_h, lat_w), timestep=empty(rows, dt=torch.float32),
                    encoder_hidden_states=empty(rows, 77 + text_len, c.joint_attention_dim),
                    pooled_projections=empty(rows, c.pooled_projection_dim), return_dict=False)
    raise ValueError(f"no meta inputs for model {name!r}")


def trace_pass(name: str, transformer: torch.nn.Module, inputs: dict[str, Any], *, train: bool,
               checkpointing: bool) -> int:
    """Peak bytes of one forward (and, with ``train``, its backward) of ``transformer`` on meta ``inputs``.

    Parameters are made trainable for the trace (what a pass saves for backward is decided by what
    requires grad), but only the input gradient is asked for, so no weight gradient is created: those
    are counted by the plan, per trainable parameter, as gradients.
    """
    transformer.train(train)
    if checkpointing and train:
        transformer.enable_gradient_checkpointing()
    elif getattr(transformer, "gradient_checkpointing", False):
        transformer.disable_gradient_checkpointing()
    first = next(transformer.parameters())
    transformer.requires_grad_(train)
    mode = LiveBytes()
    with fused_attention(), torch.set_grad_enabled(train), mode:
        out = transformer(**inputs)[0]
        if train:
            # the loss reads the output in fp32 (rl.loss); the gradient flows back to every block
            torch.autograd.grad(out.float().square().mean(), [first])
    transformer.requires_grad_(False)
    return mode.peak


def trace_extrapolated(name: str, transformer: torch.nn.Module, make_inputs: Any, *, train: bool,
                       checkpointing: bool) -> int:
    """Peak bytes of ``transformer`` at its full depth, traced on depth-2/3 copies and extrapolated.

    A block stack's peak is affine in its depth (each block adds the same saved tensors, or with
    checkpointing the same block input), so copies with two blocks per stack and with one more block
    in each stack in turn give the intercept and the slopes exactly (tests compare with a full trace).
    """
    cls, config = type(transformer), dict(transformer.config)
    keys = [k for k in BLOCK_KEYS[name] if config.get(k, 0) >= 1]  # the stacks to extrapolate along
    dtype = next(transformer.parameters()).dtype

    def peak(depths: dict[str, int]) -> int:
        with torch.device("meta"):
            copy = cast_quietly(cls.from_config({**config, **depths}), dtype)
        return trace_pass(name, copy, make_inputs(copy), train=train, checkpointing=checkpointing)

    dual = [i for i in config.get("dual_attention_layers") or () if i < config.get("num_layers", 0) - 1]
    if dual and config["num_layers"] > 3:
        # SD3.5-Medium (MMDiT-X): its first blocks carry a second attention, so they form a stack of their own
        # (blocks 0..d-1 dual, then plain ones, the last without a context output, as in the real model)
        p0 = peak({"num_layers": 2, "dual_attention_layers": (0,)})
        per_dual = peak({"num_layers": 3, "dual_attention_layers": (0, 1)}) - p0
        per_plain = peak({"num_layers": 3, "dual_attention_layers": (0,)}) - p0
        return p0 + (len(dual) - 1) * per_dual + (config["num_layers"] - 1 - len(dual)) * per_plain
    # two and three blocks: with one, the checkpointed peak can sit in a different phase of the pass
    base = {k: min(2, config[k]) for k in keys}
    p0 = peak(base)
    total = p0
    for k in keys:
        if config[k] > base[k]:
            total += (peak({**base, k: base[k] + 1}) - p0) * (config[k] - base[k])
    return total


def trace_decode(name: str, vae: torch.nn.Module, height: int, width: int, frames: int) -> int:
    """Peak bytes of decoding one sample with ``vae`` on the meta device (no grad)."""
    dtype = next(vae.parameters()).dtype
    z = vae.config.get("z_dim") or vae.config.get("latent_channels")
    s = vae.config.get("scale_factor_spatial") or 8  # Wan2.2's 48-channel VAE: 16
    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // s, width // s
    shape = (1, z, lat_h, lat_w) if name in ("flux", "sd3") else (1, z, lat_f, lat_h, lat_w)
    mode = LiveBytes()
    with torch.no_grad(), mode:
        vae.decode(torch.empty(shape, device="meta", dtype=dtype), return_dict=False)
    return mode.peak
