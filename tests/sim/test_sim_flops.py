"""FLOP formulas against FlopCounterMode on real forwards of tiny configs (and the real configs on meta)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from digenrl.errors import ConfigError
from digenrl.sim.flops import DEFAULT_CONFIGS, SampleShape, forward_flops, param_count

diffusers = pytest.importorskip("diffusers")

TINY = {
    "qwen-image": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                       num_attention_heads=4, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(8, 4, 4)),
    "flux": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
                 guidance_embeds=True),
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    "hunyuan-video": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                          num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
                          text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
    # dual attention in blocks 0 and 2 (MMDiT-X), the last block context_pre_only
    "sd3": dict(patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=6, pos_embed_max_size=8,
                dual_attention_layers=(0, 2), qk_norm="rms_norm", sample_size=8),
}
_CLASSES = {"qwen-image": "QwenImageTransformer2DModel", "flux": "FluxTransformer2DModel",
            "wan": "WanTransformer3DModel", "hunyuan-video": "HunyuanVideoTransformer3DModel",
            "sd3": "SD3Transformer2DModel", "wan2.2": "WanTransformer3DModel",
            "qwen-image-edit": "QwenImageTransformer2DModel"}
# SD3Transformer2DModel's defaults are SD3's; the real configs (stable-diffusion-3.5-large/-medium) add these
_REAL_EXTRA = {"sd3": dict(pos_embed_max_size=192, qk_norm="rms_norm")}


def _inputs(arch: str, cfg: dict, shape: SampleShape, device: str = "cpu") -> dict:
    f, h, w, L = shape.latent_frames, shape.latent_height, shape.latent_width, shape.text_tokens
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    if arch == "qwen-image":
        return dict(hidden_states=r(1, f * (h // 2) * (w // 2), cfg["in_channels"]),
                    encoder_hidden_states=r(1, L, cfg["joint_attention_dim"]),
                    encoder_hidden_states_mask=torch.ones(1, L, dtype=torch.bool, device=device),
                    timestep=torch.ones(1, device=device), img_shapes=[[(f, h // 2, w // 2)]])
    if arch == "flux":
        s = (h // 2) * (w // 2)
        return dict(hidden_states=r(1, s, cfg["in_channels"]), encoder_hidden_states=r(1, L, cfg["joint_attention_dim"]),
                    pooled_projections=r(1, cfg["pooled_projection_dim"]), timestep=torch.ones(1, device=device),
                    img_ids=torch.zeros(s, 3, device=device), txt_ids=torch.zeros(L, 3, device=device),
                    guidance=torch.ones(1, device=device))
    if arch == "wan":
        return dict(hidden_states=r(1, cfg["in_channels"], f, h, w), encoder_hidden_states=r(1, L, cfg["text_dim"]),
                    timestep=torch.ones(1, device=device))
    if arch == "sd3":
        return dict(hidden_states=r(1, cfg["in_channels"], h, w), encoder_hidden_states=r(1, L, cfg["joint_attention_dim"]),
                    pooled_projections=r(1, cfg["pooled_projection_dim"]), timestep=torch.ones(1, device=device))
    return dict(hidden_states=r(1, cfg["in_channels"], f, h, w), encoder_hidden_states=r(1, L, cfg["text_embed_dim"]),
                encoder_attention_mask=torch.ones(1, L, device=device),
                pooled_projections=r(1, cfg["pooled_projection_dim"]), timestep=torch.ones(1, device=device),
                guidance=torch.ones(1, device=device))


def _counted(model: torch.nn.Module, inputs: dict) -> int:
    # The CPU flash-attention kernel has no FLOP formula registered; the math backend decomposes
    # attention into matmuls the counter sees (meta tensors dispatch to a counted kernel anyway).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return int(counter.get_total_flops())


@pytest.mark.parametrize("arch", list(TINY))
def test_formula_matches_flop_counter_on_real_tiny_forward(arch: str) -> None:
    torch.manual_seed(0)
    cfg = TINY[arch]
    shape = SampleShape(3 if arch in ("wan", "hunyuan-video") else 1, 8, 8, 7)
    model = getattr(diffusers, _CLASSES[arch])(**cfg).eval()
    assert forward_flops(arch, shape, cfg) == _counted(model, _inputs(arch, cfg, shape))


def test_default_configs_are_the_installed_diffusers_defaults() -> None:
    for arch, cfg in DEFAULT_CONFIGS.items():
        if arch == "sd3":
            continue  # the installed defaults are SD3 (2B), not SD3.5: test_sd35_real_configs_are_models_full_ones
        sig = inspect.signature(getattr(diffusers, _CLASSES[arch]).__init__).parameters
        for key, value in cfg.items():
            if arch == "flux" and key == "guidance_embeds":
                continue  # FLUX.1-dev's hub config turns the guidance embedder on
            assert sig[key].default == value, (arch, key)


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ConfigError, match="sd9"):
        forward_flops("sd9", SampleShape(1, 64, 64, 8))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(TINY))
def test_formula_matches_meta_forward_of_the_real_config(arch: str) -> None:
    shape = SampleShape(3 if arch in ("wan", "hunyuan-video") else 1, 64, 64, 64)
    kwargs = {"guidance_embeds": True} if arch == "flux" else {**DEFAULT_CONFIGS[arch], **_REAL_EXTRA[arch]} if arch in _REAL_EXTRA else {}
    with torch.device("meta"):
        model = getattr(diffusers, _CLASSES[arch])(**kwargs)
    assert sum(p.numel() for p in model.parameters()) == param_count(arch)
    cfg = {**DEFAULT_CONFIGS[arch]}
    assert forward_flops(arch, shape) == _counted(model, _inputs(arch, cfg, shape, "meta"))


@pytest.mark.parametrize("variant", ["medium", "large"])
def test_sd35_real_configs_are_models_full_ones(variant: str) -> None:
    """The simulator's SD3.5 sizes are ``models.full``'s transformer configs; FLOPs equal a meta forward of them."""
    from digenrl.models.full import FULL_CONFIGS
    from digenrl.sim.flops import variant_config

    real = FULL_CONFIGS["sd3"][variant]["transformer"][1]
    ours = variant_config("sd3", variant)
    assert {k: ours[k] for k in real if k in ours} == {k: real[k] for k in ours if k in real}
    shape = SampleShape(1, 64, 64, 77 + 128)
    with torch.device("meta"):
        model = diffusers.SD3Transformer2DModel(**real)
    assert sum(p.numel() for p in model.parameters()) == param_count("sd3", variant)
    assert forward_flops("sd3", shape, variant=variant) == _counted(model, _inputs("sd3", ours, shape, "meta"))


@pytest.mark.parametrize("variant", ["TI2V-5B", "A14B"])
def test_wan22_real_configs_are_models_full_ones(variant: str) -> None:
    """The simulator's Wan2.2 sizes are ``models.full``'s transformers: a forward is one expert's (a step runs one),
    the parameter count both experts' (what a rollout engine holds)."""
    from digenrl.models.full import FULL_CONFIGS
    from digenrl.sim.flops import SPATIAL_FACTOR, variant_config

    spec = FULL_CONFIGS["wan22"][variant]
    real = spec["transformer"][1]
    ours = variant_config("wan2.2", variant)
    assert {k: ours[k] for k in real if k in ours} == {k: real[k] for k in ours if k in real}
    shape = SampleShape.from_pixels(9, 128, 128, 64, SPATIAL_FACTOR.get(("wan2.2", variant), 8))
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**real)
    experts = 2 if "transformer_2" in spec else 1
    assert experts * sum(p.numel() for p in model.parameters()) == param_count("wan2.2", variant)
    assert forward_flops("wan2.2", shape, variant=variant) == _counted(model, _inputs("wan", ours, shape, "meta"))
