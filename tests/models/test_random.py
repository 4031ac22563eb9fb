"""Preset "random": the published architectures at real width with random weights, built on the device."""

from __future__ import annotations

import copy

import pytest
import torch

from digenrl.config import ModelConfig
from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models import full
from digenrl.models._random import HostDraws, RandomEmbeds, _building
from digenrl.models.full import BLOCK_KEYS, build_full
from tests.conftest import gpu_test

NAMES = ["qwenimage", "flux", "wan21", "hunyuanvideo"]
FAST = {"qwenimage"}  # the other families build 0.5-0.9 B parameters twice: slow
PROMPTS = ["a red square", "a green circle"]


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _stacks(transformer: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    return {n: m for n, m in transformer.named_children() if isinstance(m, torch.nn.ModuleList) and len(m)}


def _random(name: str, dtype: torch.dtype, **kwargs) -> object:
    return load_model(name, "random", layers=1, text_encoder="random-embeds", dtype=dtype, resolution=(32, 32),
                      text_len=16, **kwargs)


def _device_draws(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings of random ops HostDraws did not take to the host (their values would depend on the device)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("preset random:")]


def _velocity(model: object) -> torch.Tensor:
    cond = model.encode_prompts(PROMPTS)
    x = model.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.velocity(x, model.sigmas(4)[1:2].expand(2), cond)


def _loaded_as_pretrained(module: torch.nn.Module, path: object, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` written by ``save_pretrained`` and read back by ``from_pretrained``, as ``pretrained`` reads it."""
    module.save_pretrained(str(path))
    return type(module).from_pretrained(str(path), torch_dtype=dtype).eval()


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_random_preset_at_real_width(name: str, caplog: pytest.LogCaptureFixture, tmp_path: object) -> None:
    model = _random(name, torch.float32)
    assert not _device_draws(caplog)
    tr, published = model.transformer, build_full(name, text_encoders=False)
    # one block of each stack is the published block; all else is the published model, less the cut blocks
    stacks, full_stacks = _stacks(tr), _stacks(published.transformer)
    assert stacks.keys() == full_stacks.keys() and all(len(s) == 1 or k == "token_refiner" for k, s in stacks.items())
    cut = 0
    for key, stack in stacks.items():
        assert _numel(stack[0]) == _numel(full_stacks[key][0]), key
        cut += sum(_numel(b) for b in full_stacks[key][len(stack):])
    assert _numel(tr) == _numel(published.transformer) - cut
    assert _numel(model.pipe.vae) == _numel(published.vae)
    assert [model.pipe.config[k][0] for k in ("transformer", "vae")] == ["diffusers", "diffusers"]
    assert all(getattr(model.pipe, k, None) is None for k in ("text_encoder", "text_encoder_2"))
    # every tensor a module holds, plain attributes too (Qwen-Image's rotary tables), is on the device
    held = [t for m in tr.modules() for t in [*m.parameters(False), *m.buffers(False), *vars(m).values()]
            if isinstance(t, torch.Tensor)]
    assert {t.device.type for t in held} == {"cpu"}
    v = _velocity(model)
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and 0.1 < v.std() < 10

    half = _random(name, torch.bfloat16)
    # the same draws, rounded once: two builds agree, whatever the precision
    for (key, a), (_, b) in zip(tr.state_dict().items(), half.transformer.state_dict().items()):
        torch.testing.assert_close(b.to(torch.bfloat16), a.to(torch.bfloat16), rtol=2**-7, atol=0, msg=key)
    keep = set(getattr(tr, "_keep_in_fp32_modules", None) or ())  # Wan2.1: as from_pretrained loads it
    for key, p in half.transformer.named_parameters():
        assert p.dtype == (torch.float32 if keep & set(key.split(".")) else torch.bfloat16), key
    vh = _velocity(half)  # computed in bf16, returned in the latents' fp32
    assert half.dtype == torch.bfloat16 and torch.isfinite(vh).all()
    assert torch.nn.functional.cosine_similarity(vh.float().flatten(), v.flatten(), dim=0) > 0.99
    # what `pretrained` makes of these weights (from_pretrained: its dtypes, rotary tables, buffers) is this model
    loaded = _loaded_as_pretrained(half.transformer, tmp_path, torch.bfloat16)
    ours, theirs = half.transformer.state_dict(), loaded.state_dict()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)
    half.transformer = loaded
    assert torch.equal(_velocity(half), vh)


def test_host_draws_are_seeded_and_independent_of_dtype() -> None:
    def linear(seed: int, dtype: torch.dtype) -> torch.Tensor:
        with _building("cpu", dtype) as pool, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mode = HostDraws(pool)
            with mode:
                layer = torch.nn.Linear(64, 4096 * 1100 // 64)  # > one chunk of host draws
            assert not mode.unknown
            return layer.weight.detach()

    a, b, c, h = linear(0, torch.float32), linear(0, torch.float32), linear(1, torch.float32), linear(0, torch.bfloat16)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert h.dtype == torch.bfloat16 and torch.equal(h, a.to(torch.bfloat16))
    assert abs(a.std().item() - 1 / (3 * 64) ** 0.5) < 1e-3  # nn.Linear's own init: U(-1/sqrt(in), 1/sqrt(in))
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("name", [*NAMES, "sd3"])  # sd3's real-size builds: tests/models/test_sd3.py
def test_random_embeds_give_the_adapters_cond(name: str) -> None:
    """The tiny preset's adapter with its text encoders vs. with random features: the same keys, shapes, dtypes."""
    guidance = {"qwenimage": 4.0, "wan21": 4.5}.get(name)  # CFG on: the negative branch too
    model = load_model(name, "tiny", guidance_scale=guidance)
    real = model.encode_prompts(PROMPTS)
    RandomEmbeds(name, model.pipe, seed=0).install()
    fake = model.encode_prompts(PROMPTS)
    assert {k: (v.shape, v.dtype) for k, v in fake.items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    assert all(torch.isfinite(v.float()).all() for v in fake.values())
    # per prompt: the same features in any batch, different ones for another prompt or seed
    alone = model.encode_prompts(PROMPTS[1:])
    assert all(torch.equal(fake[k][1], alone[k][0]) for k in fake)
    assert not torch.equal(fake["prompt_embeds"][0], fake["prompt_embeds"][1])
    RandomEmbeds(name, model.pipe, seed=1).install()
    assert not torch.equal(model.encode_prompts(PROMPTS)["prompt_embeds"], fake["prompt_embeds"])
    if "prompt_mask" in fake:  # valid tokens first, then padding
        assert (fake["prompt_mask"].sum(1) > 0).all() and (fake["prompt_mask"].diff(dim=1) <= 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_random_preset_builds_on_meta_at_full_depth(name: str) -> None:
    """On ``meta`` nothing is drawn: the whole model builds in moments, and a host tensor reaching it would fail."""
    model = load_model(name, "random", device="meta", text_encoder="random-embeds", dtype=torch.bfloat16,
                       resolution=(32, 32), text_len=16)
    assert _numel(model.transformer) == _numel(build_full(name, text_encoders=False).transformer)
    assert {p.device.type for p in model.transformer.parameters()} == {"meta"}
    # the cond of the tiny preset's adapter at the real widths (Qwen-Image's pipeline reads its masks' values)
    widths = {3: _random_dim(model), 2: model.transformer.config.get("pooled_projection_dim")}
    cond = {k: torch.ones(*v.shape[:-1], widths[v.dim()]) if v.is_floating_point() else v
            for k, v in load_model(name, "tiny", text_len=16).encode_prompts(PROMPTS).items()}
    cond = {k: v.to("meta", torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in cond.items()}
    x = model.prepare_latents(2)
    v = model.velocity(x, model.sigmas(2)[:1].expand(2).to("meta"), cond)
    assert v.shape == x.shape and v.device.type == "meta"


def _shallow_text_encoders(monkeypatch: pytest.MonkeyPatch) -> None:
    """FULL_CONFIGS with every text encoder at one block (Llama: three, HunyuanVideo reads the third-last state)."""
    configs = copy.deepcopy(full.FULL_CONFIGS)
    for variants in configs.values():
        for spec in variants.values():
            for key, (cls_name, kwargs) in spec.items():
                if key.startswith("text_encoder"):
                    for k in ("num_hidden_layers", "num_layers"):
                        if k in kwargs:
                            kwargs[k] = 3 if cls_name == "LlamaModel" else 1
                    if "vision_config" in kwargs:
                        kwargs["vision_config"] = {**kwargs["vision_config"], "depth": 1}
    monkeypatch.setattr(full, "FULL_CONFIGS", configs)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "flux" else n for n in NAMES])
def test_random_text_encoders_encode_with_byte_tokenizers(name: str, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """``text_encoder = "model"``: the published text encoders' classes and widths (depth cut for the test)."""
    _shallow_text_encoders(monkeypatch)
    model = load_model(name, "random", layers=1, dtype=torch.bfloat16, resolution=(32, 32), text_len=16)
    assert not _device_draws(caplog)
    specs = full.FULL_CONFIGS[name][full.default_variant(name)]
    for key in (k for k in specs if k.startswith("text_encoder")):
        assert type(getattr(model.pipe, key)).__name__ == specs[key][0]
    cond = model.encode_prompts(PROMPTS)
    assert all(torch.isfinite(v.float()).all() for v in cond.values())
    assert cond["prompt_embeds"].shape[1:] == (16, _random_dim(model))
    x = model.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model.velocity(x, model.sigmas(4)[1:2].expand(2), cond)).all()


def _random_dim(model: object) -> int:
    c = model.transformer.config
    return c.get("joint_attention_dim") or c.get("text_dim") or c.get("text_embed_dim")


@pytest.mark.parametrize("overrides,match", [
    ({"layers": 1}, r"model.layers: must be 0 unless model.preset = 'random'"),
    ({"preset": "random", "layers": 61}, r"model.layers: must be in 0..60"),
    ({"preset": "random", "name": "flux", "layers": 39}, r"model.layers: must be in 0..38"),
    ({"preset": "random", "text_encoder": "none"}, r"model.text_encoder: 'none' is not allowed; allowed: 'model', "
                                                   r"'random-embeds'"),
    ({"preset": "pretrained", "path": "/x", "text_encoder": "random-embeds"}, r"model.text_encoder: must be 'model' "
                                                                              r"unless model.preset = 'random'"),
    ({"preset": "random", "init": "checkpoints/x.safetensors"}, r"model.init: must be '' for preset 'random'"),
    ({"preset": "random", "vae_init": "signal"}, r"model.vae_init: must be 'default' for preset 'random'"),
    ({"preset": "random", "name": "wan21", "variant": "7B"}, r"model.variant"),
])
def test_config_refuses_random_settings_by_key(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**overrides)


def test_config_accepts_random_and_full_with_layers() -> None:
    assert ModelConfig(preset="random", layers=60, text_encoder="random-embeds").layers == 60
    assert ModelConfig(preset="full", layers=2).layers == 2
    assert ModelConfig(preset="random", name="wan21", variant="1.3B", layers=30).variant == "1.3B"


def test_load_model_refuses_cut_or_text_free_tiny() -> None:
    with pytest.raises(ConfigError, match="model.layers: only preset 'random'"):
        load_model("qwenimage", "tiny", layers=1)
    with pytest.raises(ConfigError, match="model.text_encoder: only preset 'random'"):
        load_model("qwenimage", "tiny", text_encoder="random-embeds")
    with pytest.raises(ConfigError, match="model.text_encoder: unknown value 'bert'"):
        load_model("qwenimage", "random", text_encoder="bert")


def test_block_keys_name_every_stack_of_the_published_transformers() -> None:
    for name in NAMES:
        stacks = _stacks(build_full(name, text_encoders=False, layers=2).transformer)
        deep = {k for k, s in stacks.items() if len(s) == 2}
        assert len(deep) == len(BLOCK_KEYS[name]), (name, sorted(stacks))


# -- GPU (``pytest -m gpu``; never run yet: no GPU was lent to the task that wrote them) -------------------


@gpu_test()
def test_random_on_cuda_holds_the_cpu_builds_weights() -> None:
    """Host draws: a GPU holds the CPU build's weights bit for bit (a CUDA generator's depend on the GPU model)."""
    cpu, gpu = _random("qwenimage", torch.bfloat16), _random("qwenimage", torch.bfloat16, device="cuda")
    for (key, a), (_, b) in zip(cpu.transformer.state_dict().items(), gpu.transformer.state_dict().items()):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), key
    v, vg = _velocity(cpu), _velocity(gpu)
    assert torch.isfinite(vg).all()
    assert torch.nn.functional.cosine_similarity(vg.cpu().flatten(), v.flatten(), dim=0) > 0.99


@gpu_test()
def test_published_qwenimage_builds_on_the_gpu_in_bf16_only() -> None:
    """The 20 B transformer at full depth: built on the GPU in bf16 (never on the host, never in fp32), finite at
    512 px with 512 prompt tokens and CFG, as ``pretrained`` would run it."""
    import resource
    import time

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    model = load_model("qwenimage", "random", device="cuda", dtype=torch.bfloat16, text_encoder="random-embeds")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    n = _numel(model.transformer) + _numel(model.pipe.vae)
    assert n > 20e9 and torch.cuda.max_memory_allocated() < n * 2 + 2e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss < 8e9
    x = model.prepare_latents(1, torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        v = model.velocity(x, model.sigmas(10)[1:2].to("cuda"), cond)
    assert torch.isfinite(v).all() and 0.1 < v.float().std() < 10
    print(f"random Qwen-Image (20 B, bf16) built on {torch.cuda.get_device_name()} in {seconds:.1f} s")
