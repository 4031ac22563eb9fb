"""The learned rewards on tiny instances of their published models, saved in the published layouts and
loaded through the same code as the real weights: scores against the libraries' own model calls on the
processors' own outputs (fp32, atol 1e-5), and the torch preprocessing against the processors.

Residuals of the preprocessing (``ClipPixels``, float) against the processors (uint8 PIL images; measured
with transformers 5.24's PIL and torchvision backends and open_clip 3.3's transform, which agree): none when
no resize is needed (the short side is already 224, crop offsets included); otherwise at most 2.4/255 per
pixel before normalisation, mean 0.27-0.32/255 (PIL resamples in two passes, rounding and clipping to uint8
after each; torch in float). Asserted after normalisation: max <= 2.5 / 255 / min(std) = 0.0375, mean
<= 0.35 / 255 / min(std) = 0.0053.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _learned_fixtures import (OPENAI_STD, SIZE, open_clip_or_skip, preprocessor_config, smooth_uint8_images,
                               tiny_clip_dir, tiny_hps, tiny_mlp_file, to_pil)
from digenrl.errors import ConfigError
from digenrl.rewards import build_reward, make_reward
from digenrl.rewards._learned import ClipPixels

PROMPTS = ["a red circle", "a blue square on a red background", "a red circle", "circle"]
MAX_RESIDUAL = 2.5 / 255 / min(OPENAI_STD)
MEAN_RESIDUAL = 0.35 / 255 / min(OPENAI_STD)
# (height, width): downscale, upscale, both orientations, no resize (224x299: a crop offset of 37.5, where
# transformers' floor and torchvision's round differ)
SIZES = [(256, 320), (64, 96), (300, 227), (227, 300), (512, 512), (224, 224), (224, 299)]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_clip_dir(tmp_path_factory.mktemp("clip"))


def _hf_reference(path: Path, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, Any]:
    """cos(image, text) of each pair from the processor's own pixel_values and the model's own calls."""
    from transformers import CLIPModel, CLIPProcessor

    from digenrl.rewards._learned import features_of

    model = CLIPModel.from_pretrained(str(path), local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(str(path), local_files_only=True)
    pixels = processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
    text = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = features_of(model.get_image_features(pixel_values=pixels))
        txt = features_of(model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"]))
    img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
    return (img * txt).sum(dim=-1), model


def test_clipscore_is_hessels_clip_s_of_the_model_calls(clip_dir: Path) -> None:
    images = smooth_uint8_images(4, SIZE, SIZE)
    cos, _ = _hf_reference(clip_dir, images, PROMPTS)
    got = make_reward("clipscore", table={"path": str(clip_dir)}, dtype="float32").score(images, PROMPTS)
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got, 2.5 * cos.clamp(min=0), atol=1e-5, rtol=0)
    assert (cos > 0).any() and (cos < 0).any()  # both branches of max(cos, 0) are exercised


def test_pickscore_is_logit_scale_times_cosine_with_a_separate_processor(clip_dir: Path, tmp_path: Path) -> None:
    """PickScore_v1's weights ship no processor: processor_path names the CLIP-H processor's directory. The
    reference is PickScore's own scoring code (yuvalkirstain/PickScore), on the processor's own outputs."""
    from transformers import CLIPModel, CLIPProcessor

    from digenrl.rewards._learned import features_of

    weights = tiny_clip_dir(tmp_path / "pickscore", processor=False, seed=1)
    images = smooth_uint8_images(4, SIZE, SIZE, seed=1)
    model = CLIPModel.from_pretrained(str(weights), local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(str(clip_dir), local_files_only=True)
    image_inputs = processor(images=to_pil(images), return_tensors="pt")
    text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_embs = features_of(model.get_image_features(**image_inputs))
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = features_of(model.get_text_features(**text_inputs))
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        want = torch.diagonal(model.logit_scale.exp() * (text_embs @ image_embs.T))
    reward = make_reward("pickscore", table={"path": str(weights), "processor_path": str(clip_dir)}, dtype="float32")
    torch.testing.assert_close(reward.score(images, PROMPTS), want, atol=1e-5, rtol=0)
    assert math.isclose(float(model.logit_scale.detach().exp()), math.exp(3.1), rel_tol=1e-6)


def test_aesthetic_is_the_laion_mlp_on_normalised_clip_embeddings(clip_dir: Path, tmp_path: Path) -> None:
    """LAION's simple_inference: CLIP image features, L2-normalised in numpy, through the MLP; here the
    state dict from its .pt (torch.load) and from a .safetensors of the same weights score alike."""
    from transformers import CLIPModel, CLIPProcessor

    from digenrl.rewards._learned import features_of

    pt = tiny_mlp_file(tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    st = tiny_mlp_file(tmp_path / "aesthetic.safetensors")
    images = smooth_uint8_images(3, SIZE, SIZE, seed=2)
    model = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).eval()
    pixels = CLIPProcessor.from_pretrained(str(clip_dir), local_files_only=True)(
        images=to_pil(images), return_tensors="pt")["pixel_values"]
    state = torch.load(pt, weights_only=True)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(state[f"layers.{i}.weight"].shape[1], state[f"layers.{i}.weight"].shape[0])
                                for i in (0, 2, 4, 6, 7)])
    mlp.load_state_dict({f"{j}.{p}": state[f"layers.{i}.{p}"] for j, i in enumerate((0, 2, 4, 6, 7)) for p in ("weight", "bias")})
    with torch.no_grad():
        emb = features_of(model.get_image_features(pixel_values=pixels)).numpy()
        emb = emb / np.linalg.norm(emb, 2, axis=-1, keepdims=True)
        want = mlp(torch.from_numpy(emb).float()).squeeze(-1)
    for path in (pt, st):
        got = make_reward("aesthetic", table={"path": str(path), "clip_path": str(clip_dir)}, dtype="float32")
        torch.testing.assert_close(got.score(images, ["ignored"] * 3), want, atol=1e-5, rtol=0)


def test_hpsv2_is_hpsv2s_own_score_through_open_clip(tmp_path: Path) -> None:
    """HPSv2's img_score.py: model(image, text) with output_dict, image_features @ text_features.T, diagonal."""
    open_clip = open_clip_or_skip()
    arch, ckpt = tiny_hps(tmp_path)
    images = smooth_uint8_images(4, SIZE, SIZE, seed=3)
    model, _, preprocess_val = open_clip.create_model_and_transforms(arch, pretrained=str(ckpt), output_dict=True)
    model.eval()
    tokenizer = open_clip.get_tokenizer(arch)
    want = []
    with torch.no_grad():
        for pil, prompt in zip(to_pil(images), PROMPTS, strict=True):
            out = model(preprocess_val(pil).unsqueeze(0), tokenizer([prompt]))
            want.append(torch.diagonal(out["image_features"] @ out["text_features"].T)[0])
    reward = make_reward("hpsv2", table={"path": str(ckpt), "model": arch}, dtype="float32")
    torch.testing.assert_close(reward.score(images, PROMPTS), torch.stack(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["clipscore", "aesthetic"])
def test_videos_batches_devices_and_determinism(name: str, clip_dir: Path, tmp_path: Path) -> None:
    """A video scores the mean of its frames; chunking (batch_size) and repeated calls change nothing."""
    table: dict[str, Any] = {"path": str(clip_dir)}
    if name == "aesthetic":
        table = {"path": str(tiny_mlp_file(tmp_path / "mlp.pt")), "clip_path": str(clip_dir)}
    frames = smooth_uint8_images(6, 40, 48, seed=4)  # a resize and a crop on the way
    video = frames.reshape(2, 3, 3, 40, 48).permute(0, 2, 1, 3, 4)  # [B=2, 3, F=3, H, W]
    whole = make_reward(name, table=table, dtype="float32")
    chunked = make_reward(name, table={**table, "batch_size": 2}, dtype="float32")
    per_frame = whole.score(frames, ["a red circle"] * 6)
    torch.testing.assert_close(whole.score(video, ["a red circle"] * 2), per_frame.reshape(2, 3).mean(dim=1))
    torch.testing.assert_close(chunked.score(frames, ["a red circle"] * 6), per_frame, atol=1e-6, rtol=0)
    assert torch.equal(whole.score(frames, ["a red circle"] * 6), per_frame)


@pytest.mark.parametrize("name", ["clipscore", "pickscore", "aesthetic", "hpsv2"])
def test_the_model_sees_only_tensors_on_its_own_device(name: str, clip_dir: Path, tmp_path: Path) -> None:
    """DESIGN §9's CPU twin of a GPU placement: with the model on the meta device, any host tensor reaching it
    fails as on CUDA. Images cross to the reward's device once (score_batches), the preprocessing and the
    towers stay there. (transformers' CLIP text tower cannot run on meta at all: its causal mask reads a
    value, .item(); its tokens cross in text_features, which the CPU tests run.)"""
    if name == "hpsv2":
        open_clip_or_skip()
        arch, ckpt = tiny_hps(tmp_path)
        table: dict[str, Any] = {"path": str(ckpt), "model": arch}
    elif name == "aesthetic":
        table = {"path": str(tiny_mlp_file(tmp_path / "mlp.pt")), "clip_path": str(clip_dir)}
    else:
        table = {"path": str(clip_dir)}
    reward: Any = make_reward(name, table=table, dtype="float32")
    for module in ("model", "clip", "mlp"):
        if hasattr(reward, module):
            getattr(reward, module).to("meta")
    reward.device = "meta"
    frames = smooth_uint8_images(3, 40, 48).to("meta")
    with torch.inference_mode():
        if name == "aesthetic":
            out = reward.mlp(reward.embeddings(frames))
        elif name == "hpsv2":
            out = reward.image_features(frames) * reward.text_features(["a red circle"] * 3)
        else:
            out = reward.image_features(frames)
    assert out.device.type == "meta" and out.shape[0] == 3


def _hf_processors(root: Path) -> list[Any]:
    """Every backend of transformers' CLIP image processor this install has (PIL; torchvision where it works)."""
    import transformers

    found: dict[str, Any] = {}
    for cls_name in ("CLIPImageProcessorPil", "CLIPImageProcessor"):
        cls = getattr(transformers, cls_name, None)
        try:
            processor = cls.from_pretrained(str(root), local_files_only=True)
        except Exception:  # noqa: BLE001 - a backend this install lacks (torchvision) is simply not compared
            continue
        found.setdefault(type(processor).__name__, processor)  # without torchvision both are the PIL one
    return list(found.values())


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_preprocessing_equals_transformers_clip_image_processor(hw: tuple[int, int], tmp_path: Path) -> None:
    preprocessor_config(tmp_path, size=224)  # openai/clip-vit-large-patch14's, as published
    processors = _hf_processors(tmp_path)
    assert processors, "no CLIP image processor could be built"
    images = smooth_uint8_images(2, *hw, seed=hw[0])
    for processor in processors:
        pixels = ClipPixels.from_hf(processor, "test")
        want = torch.as_tensor(np.asarray(processor(images=to_pil(images), return_tensors="np")["pixel_values"]))
        got = pixels(images)
        assert got.shape == want.shape == (2, 3, 224, 224)
        diff = (got - want).abs()
        if min(hw) == 224:
            assert float(diff.max()) < 1e-6  # no resampling: exact up to float rounding
        assert float(diff.max()) <= MAX_RESIDUAL and float(diff.mean()) <= MEAN_RESIDUAL, (
            type(processor).__name__, float(diff.max()) * 255 * min(OPENAI_STD), float(diff.mean()) * 255 * min(OPENAI_STD))


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_preprocessing_equals_open_clips_transform(hw: tuple[int, int]) -> None:
    open_clip = open_clip_or_skip()
    from open_clip.transform import PreprocessCfg, image_transform_v2

    tag = open_clip.get_pretrained_cfg("ViT-H-14", "laion2b_s32b_b79k")  # HPSv2's base: its preprocessing
    cfg = PreprocessCfg(size=224, **{k: tag[k] for k in ("mean", "std", "interpolation", "resize_mode")})
    preprocess_val = image_transform_v2(cfg, is_train=False)
    from digenrl.rewards.hps import HpsV2Reward

    pixels = HpsV2Reward._pixels(dataclasses.asdict(cfg))
    images = smooth_uint8_images(2, *hw, seed=hw[1])
    want = torch.stack([preprocess_val(p) for p in to_pil(images)])
    diff = (pixels(images) - want).abs()
    if min(hw) == 224:
        assert float(diff.max()) < 1e-6
    assert float(diff.max()) <= MAX_RESIDUAL and float(diff.mean()) <= MEAN_RESIDUAL


def test_the_crop_offset_follows_each_library() -> None:
    """296 rows cropped to 224: transformers starts at (296-224)//2 = 36, torchvision at round(36.0) = 36;
    297 rows: 36 vs round(36.5) = 36 (banker's); 299: 37 vs round(37.5) = 38."""
    base = torch.arange(299.0).view(1, 1, 299, 1).expand(1, 3, 299, 224) / 298
    hf = ClipPixels(224, (224, 224), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    tv = ClipPixels(224, (224, 224), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), crop_offset="round")
    assert round(float(hf(base)[0, 0, 0, 0]) * 298) == 37 and round(float(tv(base)[0, 0, 0, 0]) * 298) == 38


def test_weights_load_once_per_reward_object(clip_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import CLIPModel

    calls = []
    original = CLIPModel.from_pretrained.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(CLIPModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append(a) or original(cls, *a, **k)))
    reward = build_reward({"clipscore": 1.0, "color": 0.5}, models={"clipscore": {"path": str(clip_dir)}})
    images = smooth_uint8_images(2, SIZE, SIZE)
    for _ in range(3):
        reward.score(images, ["a red circle", "a blue circle"])
    assert len(calls) == 1


def test_loading_is_strictly_offline(clip_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load passes local_files_only=True, and a hub-like name that is no local path is refused
    before any library could look it up."""
    from transformers import CLIPModel, CLIPProcessor

    seen: list[Any] = []
    for cls in (CLIPModel, CLIPProcessor):
        original = cls.from_pretrained.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, _o=original, **k: seen.append(k.get("local_files_only")) or _o(c, *a, **k)))
    make_reward("clipscore", table={"path": str(clip_dir)})
    assert seen == [True, True]
    with pytest.raises(ConfigError, match=r"reward.models.clipscore.path: 'openai/clip-vit-large-patch14' does not "
                                          r"exist; .*never from a hub"):
        make_reward("clipscore", table={"path": "openai/clip-vit-large-patch14"})


def test_weights_that_do_not_fit_their_config_are_refused_not_reinitialised(tmp_path: Path) -> None:
    """transformers would initialise missing weights randomly (a warning): a reward refuses, naming the key."""
    import json

    root = tiny_clip_dir(tmp_path / "clip")
    cfg = json.loads((root / "config.json").read_text())
    cfg["vision_config"]["num_hidden_layers"] = 3  # the weights hold 2
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"reward.models.clipscore.path: the weights in .* do not fit its config.json "
                                          r"\(missing or of another shape: \['vision_model.encoder.layers.2"):
        make_reward("clipscore", table={"path": str(root)})


def test_registry_factories_take_the_table_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory signature other rewards register with: factory(table, device, dtype), dtype resolved."""
    from digenrl.rewards import registry

    got: list[tuple[Any, ...]] = []

    class Dummy:
        name = "dummy"

        def score(self, images: torch.Tensor, prompts: Any) -> torch.Tensor:
            return torch.ones(images.shape[0])

    monkeypatch.setitem(registry._FACTORIES, "dummy", lambda table, device, dtype: got.append((table, device, dtype))
                        or Dummy())
    build_reward({"dummy": 1.0}, models={"dummy": {"url": "x", "n": 2}}, device="cuda:1")
    build_reward({"dummy": 1.0}, device="cpu", dtype="float16")
    assert got == [({"url": "x", "n": 2}, "cuda:1", "bfloat16"), ({}, "cpu", "float16")]


def test_the_extra_is_optional() -> None:
    """The [rewards] extra: importing digenrl.rewards never imports open_clip."""
    import subprocess
    import sys

    code = "import sys, digenrl.rewards, digenrl.rewards.hps; print('open_clip' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert importlib.util.find_spec("digenrl.rewards.hps") is not None
