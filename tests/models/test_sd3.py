"""Stable Diffusion 3.5 (``sd3``): tiny builds, shapes, guidance, pretrained round trip, the random preset, LoRA.

The sampler against the stock ``StableDiffusion3Pipeline`` is in ``test_oracle.py`` (bitwise), the published
sizes in ``test_full.py``.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models.full import build_full
from digenrl.models.lora import DEFAULT_LORA_TARGETS, apply_lora

PROMPTS = ["a red cat", "blue sky at noon"]


def _tiny(**kwargs: object) -> object:
    return load_model("sd3", "tiny", resolution=(32, 32), **kwargs)


def _outputs(m: object) -> tuple:
    cond = m.encode_prompts(PROMPTS)
    x = m.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = m.velocity(x, torch.tensor([0.9, 0.2]), cond)
    return cond, v, m.decode(x), m.sigmas(5)


def test_tiny_shapes_and_conditioning() -> None:
    m = _tiny()
    assert m.latent_shape == (16, 2 * 2, 2 * 2) and m.guidance_scale == 4.5 and m.text_len == 16
    cond = m.encode_prompts(PROMPTS)
    # 77 CLIP tokens (CLIP-L 8 + CLIP-G 16 wide, zero-padded to T5's 32) then 16 T5 tokens; pooled 8 + 16
    assert {k: tuple(v.shape) for k, v in cond.items()} == {
        "prompt_embeds": (2, 93, 32), "pooled_embeds": (2, 24),
        "negative_embeds": (2, 93, 32), "negative_pooled_embeds": (2, 24)}
    assert torch.all(cond["prompt_embeds"][:, :77, 24:] == 0) and cond["prompt_embeds"][:, 77:].abs().sum() > 0
    # the negative branch is the prompt "" (the pipeline's default), the same for every row
    empty = m.encode_prompts([""])
    torch.testing.assert_close(cond["negative_embeds"], empty["prompt_embeds"].expand(2, -1, -1), rtol=0, atol=0)
    torch.testing.assert_close(cond["negative_pooled_embeds"], empty["pooled_embeds"].expand(2, -1), rtol=0, atol=0)
    x = m.prepare_latents(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 16, 4, 4) and x.dtype == torch.float32
    sig = m.sigmas(10)
    assert sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0 and bool((sig[1:] < sig[:-1]).all())
    with torch.no_grad():
        v = m.velocity(x, sig[3].expand(2), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    img = m.decode(x)
    assert img.shape == (2, 3, 32, 32) and 0 <= float(img.min()) and float(img.max()) <= 1


def test_tiny_is_deterministic_in_the_seed_and_leaves_the_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = _tiny(seed=0), _tiny(seed=0), _tiny(seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    sa, sb, sc = (m.pipe.transformer.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and not all(torch.equal(sa[k], sc[k]) for k in sa)
    for key in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        pa, pb = getattr(a.pipe, key).state_dict(), getattr(b.pipe, key).state_dict()
        assert all(torch.equal(pa[k], pb[k]) for k in pa), key


def test_velocity_is_the_pipelines_true_cfg() -> None:
    m = _tiny()
    cond = m.encode_prompts(PROMPTS)
    x = m.prepare_latents(2, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v = m.velocity(x, sigma, cond)
        v_c = m.transformer_forward(x, sigma, cond["prompt_embeds"], cond["pooled_embeds"])
        v_u = m.transformer_forward(x, sigma, cond["negative_embeds"], cond["negative_pooled_embeds"])
    torch.testing.assert_close(v, v_u + 4.5 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    uncond = _tiny(guidance_scale=1.0)
    c1 = uncond.encode_prompts(PROMPTS)
    assert set(c1) == {"prompt_embeds", "pooled_embeds"}
    with torch.no_grad():
        torch.testing.assert_close(uncond.velocity(x, sigma, c1), v_c, rtol=0, atol=0)
    with pytest.raises(ValueError, match="negative_embeds"):
        m.velocity(x, sigma, c1)


def test_image_size_and_frames_are_checked() -> None:
    with pytest.raises(ConfigError, match="multiples of 16"):
        load_model("sd3", "tiny", resolution=(40, 32))
    with pytest.raises(ConfigError, match="image model"):
        load_model("sd3", "tiny", num_frames=5)
    with pytest.raises(ConfigError, match="qwenimage only"):
        load_model("sd3", "tiny4x")


def test_pretrained_round_trip_identical(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = _tiny(seed=1)
    m.save_pretrained(tmp_path)
    loaded = load_model("sd3", "pretrained", path=tmp_path, resolution=(32, 32), text_len=m.text_len)
    assert type(loaded.pipe).__name__ == "StableDiffusion3Pipeline"
    assert type(loaded.pipe.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    a, b = _outputs(m), _outputs(loaded)
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        torch.testing.assert_close(a[0][k], b[0][k], rtol=0, atol=0)
    for u, w in zip(a[1:], b[1:]):
        torch.testing.assert_close(u, w, rtol=0, atol=0)


def test_pretrained_missing_component_is_named(tmp_path) -> None:
    saved = tmp_path / "saved"
    _tiny().save_pretrained(saved)
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    shutil.rmtree(broken / "text_encoder_3")
    with pytest.raises(ConfigError, match=r"component folder .*text_encoder_3"):
        load_model("sd3", "pretrained", path=broken)
    shutil.copytree(saved / "text_encoder_3", broken / "text_encoder_3")
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"no weight file .*transformer"):
        load_model("sd3", "pretrained", path=broken)


def test_random_preset_cut_to_one_block_in_bf16() -> None:
    m = load_model("sd3", "random", variant="medium", layers=1, text_encoder="random-embeds", dtype=torch.bfloat16,
                   resolution=(32, 32), text_len=16)
    published = build_full("sd3", "medium", torch.bfloat16, text_encoders=False)
    blocks, full_blocks = m.transformer.transformer_blocks, published.transformer.transformer_blocks
    assert len(blocks) == 1 and blocks[0].attn2 is not None  # the first MMDiT-X block: dual attention
    # the one block is the last (no context output) of a one-block stack; all else is the published transformer
    n = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert n(m.transformer) - n(blocks) == n(published.transformer) - n(full_blocks)
    assert n(m.pipe.vae) == n(published.vae)
    assert all(getattr(m.pipe, k) is None for k in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    assert {p.dtype for p in m.transformer.parameters()} == {torch.bfloat16}
    cond = m.encode_prompts(PROMPTS)
    assert {k: tuple(v.shape) for k, v in cond.items()} == {
        "prompt_embeds": (2, 93, 4096), "pooled_embeds": (2, 2048),
        "negative_embeds": (2, 93, 4096), "negative_pooled_embeds": (2, 2048)}
    x = m.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = m.velocity(x, m.sigmas(4)[1:2].expand(2), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and 0.1 < float(v.std()) < 10


def test_lora_targets_are_flow_grpos_joint_attention() -> None:
    m = _tiny()
    apply_lora(m, rank=4)
    wrapped = {name.rsplit(".lora_A", 1)[0] for name, _ in m.transformer.named_parameters() if ".lora_A" in name}
    # flow_grpo's train_sd3.py targets "attn.to_q" ...: the joint attention of both streams, not MMDiT-X's attn2
    assert wrapped and all(".attn." in w for w in wrapped) and not any("attn2" in w for w in wrapped)
    suffixes = {w.split(".attn.", 1)[1].replace(".default", "") for w in wrapped}
    assert suffixes == {t.removeprefix("attn.") for t in DEFAULT_LORA_TARGETS["sd3"]}


@pytest.mark.parametrize("variant", ["medium", "large"])
def test_simulator_lora_count_equals_the_meta_model(variant: str) -> None:
    from digenrl.sim.profiles import lora_params

    tr = build_full("sd3", variant, torch.bfloat16, text_encoders=False).transformer
    targets = DEFAULT_LORA_TARGETS["sd3"]
    counted = sum(32 * (mod.in_features + mod.out_features) for name, mod in tr.named_modules()
                  if isinstance(mod, torch.nn.Linear) and any(name.endswith("." + t) for t in targets))
    assert lora_params("sd3", 32, "attn", variant) == counted


@pytest.mark.slow  # 16 s: CLIP-G and T5-XXL at their widths
def test_random_preset_builds_the_three_published_text_encoders(monkeypatch: pytest.MonkeyPatch) -> None:
    """``text_encoder = "model"``: CLIP-L and CLIP-G with projection and T5-XXL at their widths (depth cut here)."""
    from tests.models.test_random import _shallow_text_encoders

    _shallow_text_encoders(monkeypatch)
    m = load_model("sd3", "random", variant="medium", layers=1, dtype=torch.bfloat16, resolution=(32, 32), text_len=16)
    encoders = {k: getattr(m.pipe, k) for k in ("text_encoder", "text_encoder_2", "text_encoder_3")}
    kinds = {k: (type(e).__name__, e.config.to_dict().get("hidden_size") or e.config.d_model) for k, e in encoders.items()}
    assert kinds == {"text_encoder": ("CLIPTextModelWithProjection", 768),
                     "text_encoder_2": ("CLIPTextModelWithProjection", 1280),
                     "text_encoder_3": ("T5EncoderModel", 4096)}
    cond = m.encode_prompts(PROMPTS)
    assert tuple(cond["prompt_embeds"].shape) == (2, 93, 4096) and tuple(cond["pooled_embeds"].shape) == (2, 2048)
    assert all(torch.isfinite(v.float()).all() for v in cond.values())
    x = m.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(m.velocity(x, m.sigmas(4)[1:2].expand(2), cond)).all()
