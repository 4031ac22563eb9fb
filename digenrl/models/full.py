"""Preset ``full``: the published architectures at their real size, built on the meta device (no weights).

The configs below are the diffusers/transformers ``config.json`` files of the released checkpoints,
kept in the project so that nothing is fetched: Qwen/Qwen-Image, black-forest-labs/FLUX.1-dev,
Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers, Wan-AI/Wan2.2-TI2V-5B-Diffusers and
Wan2.2-T2V-A14B-Diffusers, hunyuanvideo-community/HunyuanVideo, stabilityai/stable-diffusion-3.5-medium and
-large. Every module is constructed under ``torch.device("meta")``: parameters carry shapes and dtypes but
no storage, so a 20 B model "builds" in a second and the memory plan (``digenrl.plan``) counts and traces it
exactly.

A family with several sizes picks one with ``model.variant`` (Wan2.1: ``"1.3B"`` or ``"14B"``; SD3.5:
``"medium"`` or ``"large"``), and
``model.layers`` cuts every block stack of the transformer to at most that many blocks at the real width
(:data:`BLOCK_KEYS`). Preset ``random`` (``models/_random.py``) builds the same components with weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from digenrl.errors import ConfigError

__all__ = ["FULL_CONFIGS", "VARIANTS", "BLOCK_KEYS", "FullModel", "build_full", "component_specs", "construct",
           "default_variant", "published_depth", "cast_quietly"]

_QWEN_VL_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
                     tie_word_embeddings=False)
_QWEN_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], in_channels=3)
_T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
               feed_forward_proj="gated-gelu", is_encoder_decoder=False)
_UMT5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
                 feed_forward_proj="gated-gelu")
_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               vocab_size=49408, max_position_embeddings=77, projection_dim=768)
_LLAVA_LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128320, rms_norm_eps=1e-5, rope_theta=500000.0)
_WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                        attention_head_dim=128, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                        rope_max_seq_len=1024)
_WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
# Wan2.2's VAE (TI2V-5B): 48 latent channels, 16x spatial (2x2 patchify inside), residual blocks;
# latents_mean/std: Wan-Video/Wan2.2 wan/modules/vae2_2.py (as diffusers' convert_wan_to_diffusers.py).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)
_WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                  latents_mean=list(WAN22_LATENTS_MEAN), latents_std=list(WAN22_LATENTS_STD))
_WAN_14B = dict(_WAN_TRANSFORMER, num_attention_heads=40, ffn_dim=13824, num_layers=40)
_FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 layers_per_block=2, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
                 shift_factor=0.1159, scaling_factor=0.3611)
# stabilityai/stable-diffusion-3.5-medium and -large: vae/config.json is FLUX.1's architecture, other scaling;
# text_encoder_2/config.json is OpenCLIP ViT-bigG/14's text tower (CLIPTextModelWithProjection, as CLIP-L)
_SD3_VAE = dict(_FLUX_VAE, shift_factor=0.0609, scaling_factor=1.5305)
_CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
               vocab_size=49408, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# transformer/config.json of both: -medium is MMDiT-X (dual attention in blocks 0-12, 2D positions up to 384),
# -large the plain MMDiT; both with QK RMS norm
_SD3_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                        joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm")
_SD3_TEXT = {"text_encoder": ("CLIPTextModelWithProjection", _CLIP_L),
             "text_encoder_2": ("CLIPTextModelWithProjection", _CLIP_G),
             "text_encoder_3": ("T5EncoderModel", _T5_XXL)}

# name -> variant -> component -> (library class name, config kwargs)
FULL_CONFIGS: dict[str, dict[str, dict[str, tuple[str, dict[str, Any]]]]] = {
    "qwenimage": {"20B": {
        "transformer": ("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
        "vae": ("AutoencoderKLQwenImage", _WAN_VAE),
        "text_encoder": ("Qwen2_5_VLForConditionalGeneration", dict(_QWEN_VL_TEXT, vision_config=_QWEN_VL_VISION)),
    }},
    "flux": {"12B": {
        "transformer": ("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))),
        "vae": ("AutoencoderKL", _FLUX_VAE),
        "text_encoder": ("CLIPTextModel", _CLIP_L),
        "text_encoder_2": ("T5EncoderModel", _T5_XXL),
    }},
    "wan21": {
        "1.3B": {
            "transformer": ("WanTransformer3DModel", dict(_WAN_TRANSFORMER, num_attention_heads=12, ffn_dim=8960,
                                                           num_layers=30)),
            "vae": ("AutoencoderKLWan", _WAN_VAE),
            "text_encoder": ("UMT5EncoderModel", _UMT5_XXL),
        },
        "14B": {
            "transformer": ("WanTransformer3DModel", dict(_WAN_TRANSFORMER, num_attention_heads=40, ffn_dim=13824,
                                                           num_layers=40)),
            "vae": ("AutoencoderKLWan", _WAN_VAE),
            "text_encoder": ("UMT5EncoderModel", _UMT5_XXL),
        },
    },
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers and Wan2.2-T2V-A14B-Diffusers: A14B is two transformers of Wan2.1-14B's
    # architecture (``transformer`` the high-noise expert, ``transformer_2`` the low-noise one) over Wan2.1's VAE.
    "wan22": {
        "TI2V-5B": {
            "transformer": ("WanTransformer3DModel", dict(_WAN_TRANSFORMER, in_channels=48, out_channels=48,
                                                           num_attention_heads=24, ffn_dim=14336, num_layers=30)),
            "vae": ("AutoencoderKLWan", _WAN22_VAE),
            "text_encoder": ("UMT5EncoderModel", _UMT5_XXL),
        },
        "A14B": {
            "transformer": ("WanTransformer3DModel", _WAN_14B),
            "transformer_2": ("WanTransformer3DModel", _WAN_14B),
            "vae": ("AutoencoderKLWan", _WAN_VAE),
            "text_encoder": ("UMT5EncoderModel", _UMT5_XXL),
        },
    },
    "hunyuanvideo": {"13B": {
        "transformer": ("HunyuanVideoTransformer3DModel", dict(
            in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
            num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
            qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
            rope_theta=256.0, rope_axes_dim=(16, 56, 56))),
        "vae": ("AutoencoderKLHunyuanVideo", dict(latent_channels=16, block_out_channels=(128, 256, 512, 512),
                                                 layers_per_block=2, spatial_compression_ratio=8,
                                                 temporal_compression_ratio=4)),
        "text_encoder": ("LlamaModel", _LLAVA_LLAMA3_8B),
        "text_encoder_2": ("CLIPTextModel", _CLIP_L),
    }},
    "sd3": {
        "medium": {
            "transformer": ("SD3Transformer2DModel", dict(
                _SD3_TRANSFORMER, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                pos_embed_max_size=384, dual_attention_layers=tuple(range(13)))),
            "vae": ("AutoencoderKL", _SD3_VAE), **_SD3_TEXT,
        },
        "large": {
            "transformer": ("SD3Transformer2DModel", dict(
                _SD3_TRANSFORMER, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                pos_embed_max_size=192)),
            "vae": ("AutoencoderKL", _SD3_VAE), **_SD3_TEXT,
        },
    },
}
# Qwen/Qwen-Image-Edit ("edit") and Qwen/Qwen-Image-Edit-2509 ("edit-plus"): Qwen-Image's transformer, VAE and
# Qwen2.5-VL-7B (their config.json files); the variants differ in the pipeline only (models/qwenimage_edit.py)
FULL_CONFIGS["qwenimage_edit"] = {v: dict(FULL_CONFIGS["qwenimage"]["20B"]) for v in ("edit-plus", "edit")}
VARIANTS: dict[str, tuple[str, ...]] = {name: tuple(v) for name, v in FULL_CONFIGS.items()}
# The block stacks of each transformer (config keys) that ``model.layers`` cuts; HunyuanVideo's two-block
# token refiner is part of its text embedder and stays.
BLOCK_KEYS: dict[str, tuple[str, ...]] = {
    "sd3": ("num_layers",),
    "qwenimage": ("num_layers",),
    "qwenimage_edit": ("num_layers",),
    "flux": ("num_layers", "num_single_layers"),
    "wan21": ("num_layers",),
    "wan22": ("num_layers",),
    "hunyuanvideo": ("num_layers", "num_single_layers"),
}

# transformers config class of each text encoder class
_TEXT_CONFIGS = {"Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLConfig", "T5EncoderModel": "T5Config",
                 "UMT5EncoderModel": "UMT5Config", "CLIPTextModel": "CLIPTextConfig", "LlamaModel": "LlamaConfig",
                 "CLIPTextModelWithProjection": "CLIPTextConfig"}


def default_variant(name: str) -> str:
    """The variant used when ``model.variant`` is empty: the family's only (or largest) size."""
    return VARIANTS[name][-1]


@dataclass
class FullModel:
    """The components of one published pipeline on the meta device.

    ``transformer`` is what trains; ``text_encoders`` run once per prompt; ``vae`` decodes samples.
    ``transformer_2``: a second expert of the same size (Wan2.2 A14B's low-noise expert), else ``None``.
    """

    name: str
    variant: str
    transformer: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: dict[str, torch.nn.Module]
    transformer_2: torch.nn.Module | None = None


def _resolve(name: str, variant: str) -> str:
    if name not in FULL_CONFIGS:
        raise ConfigError(f"model.name: {name!r} has no full-size config; allowed: {', '.join(FULL_CONFIGS)}")
    variant = variant or default_variant(name)
    if variant not in FULL_CONFIGS[name]:
        raise ConfigError(f"model.variant: {name} has no variant {variant!r}; allowed: {', '.join(VARIANTS[name])}")
    return variant


def published_depth(name: str, variant: str = "") -> int:
    """Blocks of the deepest stack of ``name``'s transformer (the largest useful ``model.layers``).

    Raises:
        ConfigError: unknown model name or variant.
    """
    kwargs = FULL_CONFIGS[name][_resolve(name, variant)]["transformer"][1]
    return max(kwargs[k] for k in BLOCK_KEYS[name])


def component_specs(name: str, variant: str = "", layers: int = 0) -> dict[str, tuple[str, dict[str, Any]]]:
    """``FULL_CONFIGS[name][variant]`` with every block stack of the transformer cut to ``layers`` blocks.

    ``layers = 0`` keeps the published depth; a stack shallower than ``layers`` keeps its own (FLUX.1 with
    ``layers = 1``: one double-stream and one single-stream block).

    Raises:
        ConfigError: unknown model name or variant.
    """
    spec = dict(FULL_CONFIGS[name][_resolve(name, variant)])
    if layers:
        for key in ("transformer", "transformer_2"):  # both experts of a two-expert model
            if key in spec:
                cls_name, kwargs = spec[key]
                spec[key] = (cls_name, {**kwargs, **{k: min(layers, kwargs[k]) for k in BLOCK_KEYS[name]}})
    return spec


def construct(cls_name: str, kwargs: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """One component of :data:`FULL_CONFIGS`, constructed where the caller's device context says.

    Text encoders are built in ``dtype`` (transformers sets the default dtype while constructing); the
    diffusers classes take the caller's default dtype.
    """
    if cls_name in _TEXT_CONFIGS:
        import transformers

        config = getattr(transformers, _TEXT_CONFIGS[cls_name])(**kwargs)
        return getattr(transformers, cls_name)._from_config(config, dtype=dtype)
    import diffusers

    return getattr(diffusers, cls_name)(**kwargs)


def _build(cls_name: str, kwargs: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    module = construct(cls_name, kwargs, dtype)
    # Meta parameters take whatever dtype the constructor chose: cast so that every byte count follows
    # the configured precision (a past bug: Wan's fp32 norms stayed fp32 while the plan said bf16).
    return cast_quietly(module, dtype).eval()


def cast_quietly(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` without diffusers' warning about fp32-kept modules (none are kept on meta)."""
    from diffusers.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        return module.to(dtype=dtype)
    finally:
        dlogging.set_verbosity(level)


def build_full(name: str, variant: str = "", dtype: torch.dtype = torch.bfloat16, *,
               text_encoders: bool = True, layers: int = 0) -> FullModel:
    """Build ``name``'s published architecture at real size on the meta device (``layers``: see
    :func:`component_specs`).

    Raises:
        ConfigError: unknown model name or variant (naming ``model.variant`` and the allowed sizes).
    """
    variant = _resolve(name, variant)
    spec = component_specs(name, variant, layers)
    with torch.device("meta"):
        parts = {key: _build(cls, kwargs, dtype) for key, (cls, kwargs) in spec.items()
                 if text_encoders or not key.startswith("text_encoder")}
    texts = {k: v for k, v in parts.items() if k.startswith("text_encoder")}
    return FullModel(name, variant, parts["transformer"], parts["vae"], texts, parts.get("transformer_2"))
