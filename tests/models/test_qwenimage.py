"""Qwen-Image adapter against the stock diffusers pipeline and an independent CFG computation."""

from __future__ import annotations

import copy

import pytest
import torch

from digenrl.models import GeneratorModel, load_model
from digenrl.models.qwenimage import qwen_true_cfg

PROMPTS = ["a red square", "text that says \"hi\""]


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwenimage", "tiny", seed=0)


def test_is_generator_model(qwen):
    assert isinstance(qwen, GeneratorModel)
    assert qwen.latent_shape == (16, 64)
    assert qwen.name == "qwenimage"


def test_sigmas_match_stock_scheduler_formula(qwen):
    s = qwen.sigmas(10)
    assert s.shape == (11,) and s.dtype == torch.float32
    assert s[0] == 1.0 and s[-1] == 0.0
    assert torch.all(s[1:] < s[:-1])
    # shift_terminal = 0.02 stretches the schedule so the last nonzero sigma is 0.02
    assert s[-2].item() == pytest.approx(0.02, abs=1e-6)
    # Independent computation: exponential time shift with mu from 16 image tokens, then the stretch.
    import math
    mu = 0.5 + (16 - 256) * (0.9 - 0.5) / (8192 - 256)
    u = torch.linspace(1.0, 0.1, 10, dtype=torch.float64)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    one_minus = 1 - shifted
    stretched = 1 - one_minus / (one_minus[-1] / (1 - 0.02))
    torch.testing.assert_close(s[:-1].double(), stretched, atol=1e-6, rtol=0)


def test_guidance_one_equals_plain_conditional_forward(qwen):
    cond = qwen.encode_prompts(PROMPTS)
    x = qwen.prepare_latents(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.25])
    old = qwen.guidance_scale
    try:
        qwen.guidance_scale = 1.0
        v = qwen.velocity(x, sigma, cond)
    finally:
        qwen.guidance_scale = old
    with torch.no_grad():
        ref = qwen.pipe.transformer(
            hidden_states=x, timestep=sigma, encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_mask"], img_shapes=[[(1, 4, 4)]] * 2, return_dict=False,
        )[0]
    torch.testing.assert_close(v, ref, rtol=0, atol=0)


def test_true_cfg_applies_per_token_norm_rescale(qwen):
    cond = qwen.encode_prompts(PROMPTS)
    x = qwen.prepare_latents(2, torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        v = qwen.velocity(x, sigma, cond)
        v_c = qwen.transformer_forward(x, sigma, cond["prompt_embeds"], cond["prompt_mask"])
        v_u = qwen.transformer_forward(x, sigma, cond["negative_embeds"], cond["negative_mask"])
    w = qwen.guidance_scale
    assert w == 4.0
    comb = v_u + w * (v_c - v_u)
    expected = comb * v_c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)
    # the rescale really acts: per-token norms equal the conditional branch's, not the combination's
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(v.norm(dim=-1), comb.norm(dim=-1), rtol=1e-2)
    torch.testing.assert_close(qwen_true_cfg(v_c, v_u, w), expected)


def test_euler_over_adapter_matches_stock_pipeline(qwen):
    """ALGORITHM (f).2: plain Euler over our sigmas/velocity == QwenImagePipeline, same x0 and N."""
    from diffusers import QwenImagePipeline

    n, b = 6, 2
    cond = qwen.encode_prompts(PROMPTS)
    x0 = qwen.prepare_latents(b, torch.Generator().manual_seed(3))
    sig = qwen.sigmas(n)
    x = x0.clone()
    with torch.no_grad():
        for i in range(n):
            v = qwen.velocity(x, sig[i].expand(b), cond)
            x = x + (sig[i + 1] - sig[i]) * v
    stock = QwenImagePipeline(**qwen.pipe.components)
    with torch.no_grad():
        out = stock(
            prompt_embeds=cond["prompt_embeds"], prompt_embeds_mask=cond["prompt_mask"],
            negative_prompt_embeds=cond["negative_embeds"], negative_prompt_embeds_mask=cond["negative_mask"],
            true_cfg_scale=qwen.guidance_scale, height=64, width=64, num_inference_steps=n,
            latents=x0.clone(), output_type="latent", return_dict=False,
        )[0]
    torch.testing.assert_close(x, out, rtol=1e-4, atol=1e-4)
    assert (x - x0).abs().max() > 0.1  # the loop actually moved


def test_decode_matches_stock_pipeline_postprocess(qwen):
    """Same steps as the tail of QwenImagePipeline.__call__, using the pipeline's own helpers."""
    from diffusers import QwenImagePipeline

    x = qwen.prepare_latents(2, torch.Generator().manual_seed(4)) * 0.5
    img = qwen.decode(x)
    assert img.shape == (2, 3, 64, 64) and 0 <= img.min() and img.max() <= 1
    stock = QwenImagePipeline(**qwen.pipe.components)
    # decode runs channels-last on CPU: the reference is a copy in the stock (contiguous) layout
    vae = copy.deepcopy(stock.vae)
    for p in vae.parameters():
        p.data = p.data.contiguous()
    assert all(p.is_contiguous() for p in vae.parameters())
    with torch.no_grad():
        lat = stock._unpack_latents(x, 64, 64, stock.vae_scale_factor)
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        ref = vae.decode(lat * std + mean, return_dict=False)[0][:, :, 0]
        ref = stock.image_processor.postprocess(ref, output_type="pt")
    torch.testing.assert_close(img, ref, rtol=0, atol=1e-6)


def test_prepare_latents_matches_pipeline_draw(qwen):
    from diffusers import QwenImagePipeline

    a = qwen.prepare_latents(3, torch.Generator().manual_seed(5))
    b = QwenImagePipeline(**qwen.pipe.components).prepare_latents(
        3, 16, 64, 64, torch.float32, "cpu", torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_encode_prompts_padded_and_masked(qwen):
    cond = qwen.encode_prompts(["a", "a much longer prompt about a cat"])
    assert cond["prompt_embeds"].shape == (2, qwen.text_len, 32)
    lens = cond["prompt_mask"].sum(1)
    assert lens[0] < lens[1]
    # padding is zero and masked
    assert cond["prompt_embeds"][0, lens[0]:].abs().sum() == 0
    # a prompt's embedding does not depend on the batch it was encoded in
    alone = qwen.encode_prompts(["a"])
    torch.testing.assert_close(alone["prompt_embeds"][0], cond["prompt_embeds"][0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="prompts"):
        qwen.encode_prompts("a")


def test_velocity_rejects_bad_sigma_shape(qwen):
    cond = qwen.encode_prompts(PROMPTS)
    x = qwen.prepare_latents(2)
    with pytest.raises(ValueError, match=r"sigma must have shape \[B\]"):
        qwen.velocity(x, torch.tensor([0.5, 0.5, 0.5]), cond)


def test_conditionings_of_separate_batches_concatenate(qwen, caplog):
    from digenrl.models import cat_cond, index_cond, repeat_cond

    a, b = qwen.encode_prompts(["a cat"]), qwen.encode_prompts(["a much longer prompt, about dogs"])
    both = qwen.encode_prompts(["a cat", "a much longer prompt, about dogs"])
    joined = cat_cond([a, b])
    x = qwen.prepare_latents(2, torch.Generator().manual_seed(6))
    sigma = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        torch.testing.assert_close(qwen.velocity(x, sigma, joined), qwen.velocity(x, sigma, both), rtol=1e-5, atol=1e-6)
    rep = repeat_cond(a, 3)
    assert rep["prompt_embeds"].shape[0] == 3
    torch.testing.assert_close(index_cond(rep, [2])["prompt_embeds"], a["prompt_embeds"], rtol=0, atol=0)
    with caplog.at_level("WARNING"):
        long = qwen.encode_prompts(["x" * 200])
    assert long["prompt_embeds"].shape[1] == qwen.text_len and "truncated" in caplog.text


def test_tiny4x_sees_sixteen_image_tokens_at_32_px() -> None:
    """The 4x-downsampling VAE: an 8x8 latent packed 2x2 -> 16 tokens (the tiny preset: 4), drawn as the stock
    pipeline draws them, and decoded back to 32 px; other models refuse the preset by name."""
    from diffusers import QwenImagePipeline

    from digenrl.errors import ConfigError

    four = load_model("qwenimage", "tiny4x", seed=0, resolution=(32, 32))
    eight = load_model("qwenimage", "tiny", seed=0, resolution=(32, 32))
    a = four.prepare_latents(2, torch.Generator().manual_seed(5))
    assert a.shape == (2, 16, 64) and eight.prepare_latents(2).shape == (2, 4, 64)
    b = QwenImagePipeline(**four.pipe.components).prepare_latents(
        2, 16, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert four.decode(a).shape == (2, 3, 32, 32)
    with pytest.raises(ConfigError, match="tiny4x.*qwenimage only"):
        load_model("flux", "tiny4x", seed=0)
