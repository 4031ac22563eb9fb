"""Every model's tiny preset through the GeneratorModel interface, against direct diffusers calls."""

from __future__ import annotations

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models import MODEL_NAMES, GeneratorModel, decode_in_chunks, load_model
from tests.conftest import gpu_test

PROMPTS = ["a red cat", "two dogs playing in the snow"]


def prompts_for(name: str) -> list[str]:
    """:data:`PROMPTS`, as edit prompts on the shipped example images for an edit model (they need input images)."""
    if name != "qwenimage_edit":
        return PROMPTS
    from pathlib import Path

    from digenrl.data.prompts import edit_prompt

    root = Path(__file__).resolve().parents[2] / "examples" / "edit"
    return [edit_prompt(p, [str(root / img)]) for p, img in zip(PROMPTS, ("red_square.png", "green_circle.png"))]
TINY_LATENTS = {
    "qwenimage": (16, 64),
    "qwenimage_edit": (16, 64),
    "flux": (16, 16),
    "wan21": (16, 1, 8, 8),
    "wan22": (16, 1, 8, 8),  # A14B: Wan2.1's VAE under both experts
    "hunyuanvideo": (4, 1, 8, 8),
    "sd3": (16, 8, 8),  # the VAE latent itself; the transformer patchifies inside
}

_cache: dict[str, GeneratorModel] = {}


def tiny(name: str) -> GeneratorModel:
    if name not in _cache:
        _cache[name] = load_model(name, "tiny", seed=0)
    return _cache[name]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_encode_prepare_velocity_decode(name):
    m = tiny(name)
    assert isinstance(m, GeneratorModel) and m.name == name
    assert m.latent_shape == TINY_LATENTS[name]
    cond = m.encode_prompts(prompts_for(name))
    assert all(v.shape[0] == 2 for v in cond.values())
    x = m.prepare_latents(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, *m.latent_shape) and x.dtype == torch.float32
    # same generator seed -> same noise; different seed -> different noise
    torch.testing.assert_close(x, m.prepare_latents(2, torch.Generator().manual_seed(0)), rtol=0, atol=0)
    s = m.sigmas(5)
    assert s.shape == (6,) and s[0] == pytest.approx(1.0, abs=1e-3) and s[-1] == 0 and torch.all(s[1:] < s[:-1])
    v = m.velocity(x, torch.tensor([s[1].item(), s[3].item()]), cond)
    assert v.shape == x.shape and v.dtype == x.dtype and torch.isfinite(v).all()
    img = m.decode(x)
    assert img.shape == (2, 3, 64, 64) and torch.isfinite(img).all() and 0 <= img.min() and img.max() <= 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_row_sigma_equals_rows_computed_alone(name):
    """TSP packs rows at different noise levels into one call: each row must equal its solo call."""
    m = tiny(name)
    cond = m.encode_prompts(prompts_for(name))
    x = m.prepare_latents(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.95, 0.2])
    with torch.no_grad():
        both = m.velocity(x, sigma, cond)
        for i in range(2):
            row = m.velocity(x[i:i + 1], sigma[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()})
            torch.testing.assert_close(both[i:i + 1], row, rtol=1e-4, atol=1e-5)
        # and the noise level really matters
        assert (m.velocity(x, sigma.flip(0), cond) - both).abs().max() > 1e-4


def _direct(m, x, sigma, cond):
    """The plain conditional transformer call, written from the diffusers pipelines' own inputs."""
    tr = m.pipe.transformer
    b = x.shape[0]
    if m.name == "qwenimage_edit":  # the input image's tokens after the noise tokens; the velocity is the noise part
        return tr(hidden_states=torch.cat([x, cond["image_latents"]], 1), timestep=sigma,
                  encoder_hidden_states=cond["prompt_embeds"], encoder_hidden_states_mask=cond["prompt_mask"],
                  img_shapes=[[(1, 4, 4), (1, 4, 4)]] * b, return_dict=False)[0][:, :x.shape[1]]
    if m.name == "qwenimage":
        return tr(hidden_states=x, timestep=sigma, encoder_hidden_states=cond["prompt_embeds"],
                  encoder_hidden_states_mask=cond["prompt_mask"], img_shapes=[[(1, 4, 4)]] * b, return_dict=False)[0]
    if m.name == "flux":
        ids = m.pipe._prepare_latent_image_ids(b, 4, 4, x.device, x.dtype)
        return tr(hidden_states=x, timestep=sigma, guidance=torch.full((b,), m.guidance_scale),
                  pooled_projections=cond["pooled_embeds"], encoder_hidden_states=cond["prompt_embeds"],
                  txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3), img_ids=ids, return_dict=False)[0]
    if m.name == "wan22":  # each expert on its rows: transformer where t >= boundary_ratio * 1000, else transformer_2
        out = torch.empty_like(x)
        for k, name in enumerate(m.experts):
            rows = (m.expert_of(sigma) == k).nonzero().flatten()
            if rows.numel():
                out[rows] = getattr(m.pipe, name)(hidden_states=x[rows], timestep=sigma[rows] * 1000,
                                                  encoder_hidden_states=cond["prompt_embeds"][rows], return_dict=False)[0]
        return out
    if m.name == "wan21":
        return tr(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond["prompt_embeds"],
                  return_dict=False)[0]
    if m.name == "sd3":
        return tr(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond["prompt_embeds"],
                  pooled_projections=cond["pooled_embeds"], return_dict=False)[0]
    return tr(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond["prompt_embeds"],
              encoder_attention_mask=cond["prompt_mask"], pooled_projections=cond["pooled_embeds"],
              guidance=torch.full((b,), 1000.0 * m.guidance_scale), return_dict=False)[0]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_guidance_one_is_plain_conditional_output(name):
    m = tiny(name)
    cond = m.encode_prompts(prompts_for(name))
    x = m.prepare_latents(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.8, 0.35])
    old = m.guidance_scale
    try:
        if name in ("qwenimage", "qwenimage_edit", "wan21", "wan22", "sd3"):  # true CFG models: scale 1 = conditional branch only
            m.guidance_scale = 1.0
        with torch.no_grad():
            v = m.velocity(x, sigma, cond)
            ref = _direct(m, x, sigma, cond)
    finally:
        m.guidance_scale = old
    torch.testing.assert_close(v, ref, rtol=0, atol=0)


def test_wan_cfg_combines_branches():
    m = tiny("wan21")
    cond = m.encode_prompts(PROMPTS)
    x = m.prepare_latents(2, torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.6, 0.6])
    with torch.no_grad():
        v = m.velocity(x, sigma, cond)
        v_c = _direct(m, x, sigma, cond)
        v_u = _direct(m, x, sigma, {"prompt_embeds": cond["negative_embeds"]})
    torch.testing.assert_close(v, v_u + 4.5 * (v_c - v_u), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "hunyuanvideo"])
def test_euler_over_adapter_matches_stock_pipeline(name):
    """ALGORITHM (f).2 for the FlowMatchEuler pipelines with a guidance embedding."""
    from diffusers import FluxPipeline, HunyuanVideoPipeline

    m = tiny(name)
    n = 4
    cond = m.encode_prompts(PROMPTS)
    x0 = m.prepare_latents(2, torch.Generator().manual_seed(4))
    sig = m.sigmas(n)
    x = x0.clone()
    with torch.no_grad():
        for i in range(n):
            x = x + (sig[i + 1] - sig[i]) * m.velocity(x, sig[i].expand(2), cond)
        if name == "flux":
            out = FluxPipeline(**m.pipe.components)(
                prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_embeds"],
                guidance_scale=m.guidance_scale, height=64, width=64, num_inference_steps=n, latents=x0.clone(),
                output_type="latent", return_dict=False)[0]
        else:
            out = HunyuanVideoPipeline(**m.pipe.components)(
                prompt_embeds=cond["prompt_embeds"], prompt_attention_mask=cond["prompt_mask"],
                pooled_prompt_embeds=cond["pooled_embeds"], guidance_scale=m.guidance_scale, height=64, width=64,
                num_frames=1, num_inference_steps=n, latents=x0.clone(), output_type="latent", return_dict=False)[0]
    torch.testing.assert_close(x, out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["wan21", "hunyuanvideo"])
def test_video_frames(name):
    m = load_model(name, "tiny", num_frames=5)
    assert m.latent_shape[1] == 2
    cond = m.encode_prompts(["a ball rolling"])
    x = m.prepare_latents(1)
    v = m.velocity(x, torch.tensor([0.5]), cond)
    assert v.shape == (1, *m.latent_shape) and torch.isfinite(v).all()
    assert m.decode(x).shape == (1, 3, 5, 64, 64)
    with pytest.raises(ConfigError, match="num_frames"):
        load_model(name, "tiny", num_frames=4)


def test_image_models_reject_frames_and_bad_resolution():
    with pytest.raises(ConfigError, match="num_frames"):
        load_model("flux", "tiny", num_frames=5)
    with pytest.raises(ConfigError, match="multiples of 16"):
        load_model("qwenimage", "tiny", resolution=(72, 64))


def test_seeded_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    a = torch.rand(3)
    torch.manual_seed(123)
    m1 = load_model("wan21", "tiny", seed=5)
    b = torch.rand(3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    m2 = load_model("wan21", "tiny", seed=5)
    m3 = load_model("wan21", "tiny", seed=6)
    p1, p2, p3 = (next(m.transformer.parameters()) for m in (m1, m2, m3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


def test_bf16_forward_close_to_fp32():
    m32 = tiny("qwenimage")
    m16 = load_model("qwenimage", "tiny", seed=0, dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16
    cond32 = m32.encode_prompts(PROMPTS)
    cond16 = m16.encode_prompts(PROMPTS)
    assert cond16["prompt_embeds"].dtype == torch.bfloat16
    x = m32.prepare_latents(2, torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v32 = m32.velocity(x, sigma, cond32)
        v16 = m16.velocity(x, sigma, cond16)
    assert v16.dtype == torch.float32 and torch.isfinite(v16).all()
    rel = (v16 - v32).norm() / v32.norm()
    assert rel < 0.05, rel


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_small_preset_runs(name):
    m = load_model(name, "small", seed=0)
    cond = m.encode_prompts(prompts_for(name)[:1])
    x = m.prepare_latents(1)
    with torch.no_grad():
        v = m.velocity(x, torch.tensor([0.5]), cond)
    assert v.shape == (1, *m.latent_shape) and torch.isfinite(v).all()
    assert sum(p.numel() for p in m.transformer.parameters()) > 3 * sum(
        p.numel() for p in tiny(name).transformer.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_default_lora_targets_start_at_reference(name):
    from digenrl.models.lora import DEFAULT_LORA_TARGETS, apply_lora, reference

    m = load_model(name, "tiny", seed=0)
    cond = m.encode_prompts(prompts_for(name))
    x = m.prepare_latents(2, torch.Generator().manual_seed(7))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        before = m.velocity(x, sigma, cond)
    params = apply_lora(m, rank=2)
    wrapped = {n.rsplit(".lora_", 1)[0] for n, _ in m.transformer.named_parameters() if "lora_" in n}
    assert wrapped and all(any(w.endswith(t) for t in DEFAULT_LORA_TARGETS[name]) for w in wrapped)
    with torch.no_grad():
        torch.testing.assert_close(m.velocity(x, sigma, cond), before, rtol=0, atol=0)
        for p in params:
            p.add_(0.1)
        assert (m.velocity(x, sigma, cond) - before).abs().max() > 1e-4
    with reference(m):
        torch.testing.assert_close(m.velocity(x, sigma, cond), before, rtol=0, atol=0)


@gpu_test()
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_cuda_bf16_close_to_cpu_fp32(name):
    cpu = tiny(name)
    gpu = load_model(name, "tiny", seed=0, device="cuda", dtype=torch.bfloat16)
    x = cpu.prepare_latents(2, torch.Generator().manual_seed(8))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        ref = cpu.velocity(x, sigma, cpu.encode_prompts(prompts_for(name)))
        out = gpu.velocity(x.cuda(), sigma.cuda(), gpu.encode_prompts(prompts_for(name))).cpu()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.05
    assert gpu.decode(x.cuda()).shape[0] == 2


@pytest.mark.parametrize("name", ["qwenimage", "hunyuanvideo"])
def test_decode_in_chunks_equals_one_call(name):
    """``rollout.decode_batch``: 5 samples decoded 2 at a time equal the one-call decode within fp32 rounding (pixels are then 8-bit)."""
    m = tiny(name)
    x = m.prepare_latents(5, torch.Generator().manual_seed(1))
    whole = m.decode(x)
    torch.testing.assert_close(decode_in_chunks(m, x, 2), whole, rtol=1e-4, atol=1e-5)  # fp32 conv rounding
    assert decode_in_chunks(m, x, 0).shape == whole.shape == decode_in_chunks(m, x, 8).shape
