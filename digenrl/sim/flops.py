"""Forward FLOPs of the four paper transformers, counted analytically from their diffusers configs.

Only matrix products are counted (linear layers, patch convolutions, and the two batched products of
scaled-dot-product attention), with the convention ``2 * m * n * k`` per product. That is the same
convention ``torch.utils.flop_counter.FlopCounterMode`` uses, so a test can check these formulas
against a real forward of a tiny config, and against a meta-device forward of the real default
config. Element-wise work (norms, activations, RoPE) is not counted: it is memory-bound and small
next to the products, and a cost model applies a utilisation factor on top anyway.

``DEFAULT_CONFIGS`` are the constructor defaults of the diffusers classes (diffusers 0.42.1), which
are the released checkpoints' configs: QwenImageTransformer2DModel (20.4 B parameters),
FluxTransformer2DModel (11.9 B; FLUX.1-dev sets ``guidance_embeds=True``), WanTransformer3DModel
(the 14 B config) and HunyuanVideoTransformer3DModel (12.8 B). A test compares them with
``inspect.signature`` of the installed classes, so they cannot drift silently.

A family with several sizes (``model.variant``: Wan2.1 ``1.3B`` / ``14B``) has one entry per size in
``VARIANTS``: overrides of the default config, named as ``digenrl.models.full.VARIANTS`` names them (a
test compares them with that module's transformer configs). ``""`` is the largest, as in a config.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from digenrl.errors import ConfigError

__all__ = ["ARCHITECTURES", "BLOCK_KEYS", "DEFAULT_CONFIGS", "VARIANTS", "SampleShape", "default_variant",
           "forward_flops", "tokens", "param_count", "variant_config", "SPATIAL_FACTOR"]

ARCHITECTURES = ("qwen-image", "flux", "wan", "hunyuan-video", "sd3", "wan2.2", "qwen-image-edit")

DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen-image": {  # QwenImageTransformer2DModel()
        "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
        "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
    },
    # Qwen-Image-Edit (and -2509, "edit-plus"): Qwen-Image's transformer config; its sequence also holds the input
    # image's tokens (``tokens``)
    "qwen-image-edit": {
        "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
        "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
    },
    "flux": {  # FluxTransformer2DModel(); FLUX.1-dev's hub config has guidance_embeds=True
        "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "pooled_projection_dim": 768, "guidance_embeds": True,
    },
    "wan": {  # WanTransformer3DModel() = Wan2.1-T2V-14B
        "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
        "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    },
    # Wan2.2: A14B's two experts each have Wan2.1-T2V-14B's architecture, and a denoising step runs one of
    # them, so one forward is one 14 B expert's (param_count counts both: what a rollout engine holds)
    "wan2.2": {
        "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
        "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    },
    "hunyuan-video": {  # HunyuanVideoTransformer3DModel()
        "in_channels": 16, "out_channels": 16, "num_attention_heads": 24, "attention_head_dim": 128,
        "num_layers": 20, "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 2,
        "patch_size_t": 1, "guidance_embeds": True, "text_embed_dim": 4096, "pooled_projection_dim": 768,
    },
    # SD3Transformer2DModel's defaults are SD3 (not 3.5); this is stabilityai/stable-diffusion-3.5-large's
    # transformer/config.json (models/full.py; a test builds both sizes on meta and counts them)
    "sd3": {
        "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 38, "attention_head_dim": 64,
        "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
        "pooled_projection_dim": 2048, "dual_attention_layers": (),
    },
}

# Sizes of each family: overrides of DEFAULT_CONFIGS, smallest first (the defaults are the largest).
# Wan2.1-T2V-1.3B-Diffusers transformer/config.json: 12 heads x 128, ffn 8960, 30 layers (1.42 B).
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen-image": {"20B": {}},
    "qwen-image-edit": {"edit-plus": {}, "edit": {}},  # one transformer, two pipelines (models/qwenimage_edit.py)
    "flux": {"12B": {}},
    "wan": {"1.3B": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}, "14B": {}},
    "hunyuan-video": {"13B": {}},
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json: 24 heads x 128, ffn 14336, 30 layers, 48 channels
    # (its VAE compresses 16x in space: SPATIAL_FACTOR)
    "wan2.2": {"TI2V-5B": {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
                           "out_channels": 48}, "A14B": {}},
    # stabilityai/stable-diffusion-3.5-medium transformer/config.json: MMDiT-X, dual attention in blocks 0-12
    "sd3": {"medium": {"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                       "dual_attention_layers": tuple(range(13))}, "large": {}},
}

# The block stacks ``model.layers`` cuts (models/full.py BLOCK_KEYS); HunyuanVideo's token refiner stays.
BLOCK_KEYS: dict[str, tuple[str, ...]] = {
    "qwen-image": ("num_layers",), "qwen-image-edit": ("num_layers",), "flux": ("num_layers", "num_single_layers"),
    "wan": ("num_layers",), "hunyuan-video": ("num_layers", "num_single_layers"), "sd3": ("num_layers",),
    "wan2.2": ("num_layers",)}
# VAE spatial compression where it is not 8: (architecture, variant) -> factor (Wan2.2 TI2V-5B's VAE).
SPATIAL_FACTOR: dict[tuple[str, str], int] = {("wan2.2", "TI2V-5B"): 16}

# Sinusoidal timestep features are 256 wide in all four models (TimestepEmbedding(in_channels=256)).
_TIME_FREQ = 256


@dataclass(frozen=True, slots=True)
class SampleShape:
    """What one sample looks like to the transformer.

    ``latent_frames``/``latent_height``/``latent_width`` are the VAE latent grid (before patching);
    ``text_tokens`` is the length of the prompt embedding the transformer attends to; ``cond_tokens`` the
    tokens of conditioning images appended to the image tokens (Qwen-Image-Edit's input images,
    :func:`edit_image_tokens`).
    """

    latent_frames: int
    latent_height: int
    latent_width: int
    text_tokens: int
    cond_tokens: int = 0

    @staticmethod
    def from_pixels(frames: int, height: int, width: int, text_tokens: int, spatial: int = 8, temporal: int = 4) -> SampleShape:
        """Latent grid of a ``frames x height x width`` sample for a VAE with the given compression.

        Causal video VAEs (Wan, HunyuanVideo) keep the first frame, so ``(frames - 1) / temporal + 1``.
        """
        if height % spatial or width % spatial:
            raise ConfigError(f"height/width {height}x{width} must be multiples of the VAE factor {spatial}")
        if frames < 1 or (frames - 1) % temporal:
            raise ConfigError(f"frames={frames} must be 1 + a multiple of the temporal factor {temporal}")
        return SampleShape((frames - 1) // temporal + 1, height // spatial, width // spatial, text_tokens)


def _config(arch: str, config: dict[str, Any] | None) -> dict[str, Any]:
    if arch not in DEFAULT_CONFIGS:
        raise ConfigError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    merged = dict(DEFAULT_CONFIGS[arch])
    if config:
        merged.update(config)
    return merged


def default_variant(arch: str) -> str:
    """The size ``""`` means: the family's largest (as ``models.full.default_variant``)."""
    _config(arch, None)
    return list(VARIANTS[arch])[-1]


def variant_config(arch: str, variant: str = "", layers: int = 0) -> dict[str, Any]:
    """The real config of one size of ``arch`` (``""``: the largest), every block stack cut to ``layers`` blocks
    (``model.layers``; 0 = the published depth; a shallower stack keeps its own, as ``models.full`` cuts them).

    Raises:
        ConfigError: unknown architecture, or a size the family does not have (naming ``model.variant``).
    """
    variant = variant or default_variant(arch)
    if variant not in VARIANTS[arch]:
        raise ConfigError(f"model.variant: {arch} has no variant {variant!r}; allowed: {', '.join(VARIANTS[arch])}")
    c = _config(arch, VARIANTS[arch][variant])
    return {**c, **{k: min(layers, c[k]) for k in BLOCK_KEYS[arch]}} if layers else c


EDIT_VAE_IMAGE_AREA = 1024 * 1024  # Qwen-Image-Edit pipelines' conditioning image area (models/qwenimage_edit.py)


def edit_image_tokens(area: int, height: int, width: int) -> int:
    """Tokens of one Qwen-Image-Edit conditioning image of ``area`` pixels at the output's aspect: its size rounded
    to multiples of 32 as the pipelines' ``calculate_dimensions``, 8x VAE, 2x2 packing (16 pixels a side)."""
    ratio = width / height  # the same operations as the pipelines (and the adapter's image_size): the same rounding
    w = math.sqrt(area * ratio)
    h = w / ratio
    return (round(h / 32) * 32 // 16) * (round(w / 32) * 32 // 16)


def tokens(arch: str, shape: SampleShape, config: dict[str, Any] | None = None) -> int:
    """Number of image/video tokens the transformer sees for one sample (after patching/packing)."""
    c = _config(arch, config)
    if arch == "sd3":  # 2x2 patches of the latent, inside the transformer
        return shape.latent_frames * (shape.latent_height // c["patch_size"]) * (shape.latent_width // c["patch_size"])
    if arch == "qwen-image-edit":
        # the noise tokens, then the input image's, packed alike along the sequence (a Plus run with K images
        # has K of them; counted: one)
        return shape.latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2) + shape.cond_tokens
    if arch in ("qwen-image", "flux"):
        # Both pack 2x2 latent patches into one token in the pipeline (FLUX's own patch_size is 1).
        return shape.latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2)
    if arch in ("wan", "wan2.2"):
        pt, ph, pw = c["patch_size"]
        return (shape.latent_frames // pt) * (shape.latent_height // ph) * (shape.latent_width // pw)
    p, pt = c["patch_size"], c["patch_size_t"]
    return (shape.latent_frames // pt) * (shape.latent_height // p) * (shape.latent_width // p)


def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def _sdpa(q_len: int, kv_len: int, width: int) -> int:
    # QK^T and PV, each 2 * q * kv * width summed over heads.
    return 4 * q_len * kv_len * width


def _time_embed(d: int) -> int:
    return _mm(1, _TIME_FREQ, d) + _mm(1, d, d)


def _qwen(c: dict[str, Any], s: int, t: int) -> int:
    d = c["num_attention_heads"] * c["attention_head_dim"]
    out = c["out_channels"] * c["patch_size"] ** 2
    f = _time_embed(d) + _mm(s, c["in_channels"], d) + _mm(t, c["joint_attention_dim"], d)
    block = (
        2 * _mm(1, d, 6 * d)  # img_mod, txt_mod (per sample)
        + _mm(s + t, d, 4 * d)  # q, k, v, out of each stream
        + _sdpa(s + t, s + t, d)  # joint attention
        + _mm(s + t, d, 4 * d) + _mm(s + t, 4 * d, d)  # img_mlp / txt_mlp
    )
    return f + c["num_layers"] * block + _mm(1, d, 2 * d) + _mm(s, d, out)


def _mmdit_double(d: int, s: int, t: int, mlp: int) -> int:
    return 2 * _mm(1, d, 6 * d) + _mm(s + t, d, 4 * d) + _sdpa(s + t, s + t, d) + 2 * _mm(s + t, d, mlp)


def _mmdit_single(d: int, n: int, mlp: int) -> int:
    # norm (per sample), proj_mlp, q/k/v (no output projection: pre_only), attention, proj_out(d+mlp -> d)
    return _mm(1, d, 3 * d) + _mm(n, d, mlp) + _mm(n, d, 3 * d) + _sdpa(n, n, d) + _mm(n, d + mlp, d)


def _flux(c: dict[str, Any], s: int, t: int) -> int:
    d = c["num_attention_heads"] * c["attention_head_dim"]
    out = (c["out_channels"] or c["in_channels"]) * c["patch_size"] ** 2
    emb = _time_embed(d) * (2 if c["guidance_embeds"] else 1) + _mm(1, c["pooled_projection_dim"], d) + _mm(1, d, d)
    f = emb + _mm(t, c["joint_attention_dim"], d) + _mm(s, c["in_channels"] * c["patch_size"] ** 2, d)
    f += c["num_layers"] * _mmdit_double(d, s, t, 4 * d)
    f += c["num_single_layers"] * _mmdit_single(d, s + t, 4 * d)
    return f + _mm(1, d, 2 * d) + _mm(s, d, out)


def _wan(c: dict[str, Any], s: int, t: int) -> int:
    d = c["num_attention_heads"] * c["attention_head_dim"]
    patch = c["patch_size"][0] * c["patch_size"][1] * c["patch_size"][2]
    f = _mm(s, c["in_channels"] * patch, d)  # patch_embedding Conv3d
    f += _mm(1, c["freq_dim"], d) + _mm(1, d, d) + _mm(1, d, 6 * d)  # time_embedder, time_proj
    f += _mm(t, c["text_dim"], d) + _mm(t, d, d)  # text_embedder
    block = (
        _mm(s, d, 4 * d) + _sdpa(s, s, d)  # self-attention
        + _mm(s, d, 2 * d) + _mm(t, d, 2 * d) + _sdpa(s, t, d)  # cross-attention: q,out on video; k,v on text
        + _mm(s, d, c["ffn_dim"]) + _mm(s, c["ffn_dim"], d)
    )
    return f + c["num_layers"] * block + _mm(s, d, c["out_channels"] * patch)


def _hunyuan(c: dict[str, Any], s: int, t: int) -> int:
    d = c["num_attention_heads"] * c["attention_head_dim"]
    mlp = int(d * c["mlp_ratio"])
    patch = c["patch_size_t"] * c["patch_size"] ** 2
    f = _mm(s, c["in_channels"] * patch, d)  # x_embedder Conv3d
    # token refiner: its own time/pooled-text embedding, proj_in, self-attention blocks, adaLN gates
    te = c["text_embed_dim"]
    f += _time_embed(d) + _mm(1, te, d) + _mm(1, d, d) + _mm(t, te, d)
    f += c["num_refiner_layers"] * (_mm(t, d, 4 * d) + _sdpa(t, t, d) + _mm(t, d, mlp) + _mm(t, mlp, d) + _mm(1, d, 2 * d))
    # condition embedding: timestep, guidance, pooled CLIP text
    f += _time_embed(d) * (2 if c["guidance_embeds"] else 1) + _mm(1, c["pooled_projection_dim"], d) + _mm(1, d, d)
    f += c["num_layers"] * _mmdit_double(d, s, t, mlp)
    f += c["num_single_layers"] * _mmdit_single(d, s + t, mlp)
    return f + _mm(1, d, 2 * d) + _mm(s, d, c["out_channels"] * patch)


def _sd3(c: dict[str, Any], s: int, t: int) -> int:
    d = c["num_attention_heads"] * c["attention_head_dim"]
    p, n = c["patch_size"], c["num_layers"]
    f = _mm(s, c["in_channels"] * p * p, d)  # pos_embed: the patch Conv2d
    f += _time_embed(d) + _mm(1, c["pooled_projection_dim"], d) + _mm(1, d, d)  # timestep + pooled text
    f += _mm(t, c["joint_attention_dim"], c["caption_projection_dim"])  # context_embedder
    for i in range(n):
        dual, last = i in c["dual_attention_layers"], i == n - 1  # MMDiT-X's second attention; context_pre_only
        f += _mm(1, d, 9 * d if dual else 6 * d) + _mm(1, d, 2 * d if last else 6 * d)  # norm1, norm1_context
        f += _mm(s + t, d, 3 * d) + _sdpa(s + t, s + t, d) + _mm(s if last else s + t, d, d)  # joint attention
        f += (_mm(s, d, 4 * d) + _sdpa(s, s, d)) if dual else 0  # attn2: image-only self-attention
        f += 2 * _mm(s if last else s + t, d, 4 * d)  # ff (and ff_context but in the last block)
    return f + _mm(1, d, 2 * d) + _mm(s, d, p * p * c["out_channels"])


_FORMULAS = {"qwen-image": _qwen, "qwen-image-edit": _qwen, "flux": _flux, "wan": _wan, "wan2.2": _wan,
             "hunyuan-video": _hunyuan, "sd3": _sd3}


def forward_flops(arch: str, shape: SampleShape, config: dict[str, Any] | None = None, variant: str = "",
                  layers: int = 0) -> int:
    """FLOPs of one forward pass of one sample (one CFG branch) through ``arch``.

    Args:
        arch: one of ``ARCHITECTURES``.
        shape: the sample's latent grid and text length.
        config: overrides of the default config (tiny test configs); ``None`` = the real model.
        variant: the real model's size (``VARIANTS``; ``""`` = the largest); ignored with ``config``.
        layers: the real model's block stacks cut to this many blocks (0 = published); ignored with ``config``.

    Raises:
        ConfigError: unknown architecture or variant.
    """
    if not config:
        return _real_model_flops(arch, shape, variant or default_variant(arch), layers)
    c = _config(arch, config)
    return _FORMULAS[arch](c, tokens(arch, shape, c), shape.text_tokens)


@functools.lru_cache(maxsize=512)
def _real_model_flops(arch: str, shape: SampleShape, variant: str, layers: int) -> int:
    c = variant_config(arch, variant, layers)
    return _FORMULAS[arch](c, tokens(arch, shape, c), shape.text_tokens)


def param_count(arch: str, variant: str = "") -> int:
    """Parameters of the real model (``variant``: its size, ``""`` = the largest), as counted on the meta
    device (the tests count them again).

    Raises:
        ConfigError: unknown architecture or variant.
    """
    variant = variant or default_variant(arch)
    variant_config(arch, variant)  # raises naming the allowed sizes
    return _KNOWN_PARAMS[(arch, variant)]


# Meta-counted sizes (FEASIBILITY.md §2; tests/sim/test_sim_flops.py counts them again); no diffusers import.
_KNOWN_PARAMS = {("qwen-image", "20B"): 20_430_401_088,
                 # Qwen/Qwen-Image-Edit and -2509: Qwen-Image's transformer (the model cards: 20B MMDiT)
                 ("qwen-image-edit", "edit"): 20_430_401_088, ("qwen-image-edit", "edit-plus"): 20_430_401_088,
                 ("flux", "12B"): 11_901_408_320,
                 ("wan", "1.3B"): 1_418_996_800, ("wan", "14B"): 14_288_491_584,
                 ("hunyuan-video", "13B"): 12_821_012_544,
                 # parameters only: SD3.5's 2D position table is a persistent buffer besides them (medium 226.5 M,
                 # large 89.7 M; with it the checkpoints hold 2.47 B and 8.15 B)
                 ("sd3", "medium"): 2_243_171_520, ("sd3", "large"): 8_056_627_520,
                 # A14B: both experts (2 x Wan2.1-14B's 14_288_491_584), as a rollout engine holds them
                 ("wan2.2", "TI2V-5B"): 4_999_787_712, ("wan2.2", "A14B"): 28_576_983_168}
