"""The learned reward models as the simulator prices them (issue 31): parameters, FLOPs per image and scoring
activations of CLIP-L/14 and CLIP-H/14 against a meta-device transformers ``CLIPModel`` of the published
configs, and REWARD tokens priced with the config's reward models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from digenrl.config import load_config
from digenrl.plan.trace import LiveBytes, fused_attention
from digenrl.schedule.base import Device, Fragment, Role, Token, TokenKind
from digenrl.sim.cost import CostModel, CostParams
from digenrl.sim.devices import device_spec
from digenrl.sim.profiles import PROFILES, model_profile
from digenrl.sim.reward_models import CLIP_H, CLIP_L, PUBLISHED, ClipSpec, reward_model

transformers = pytest.importorskip("transformers")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(spec: ClipSpec, heads: int = 16) -> transformers.CLIPConfig:
    """The transformers config of ``spec`` (openai/clip-vit-large-patch14, laion/CLIP-ViT-H-14-laion2B-s32B-b79K)."""
    return transformers.CLIPConfig(
        text_config=dict(hidden_size=spec.text_width, intermediate_size=spec.text_mlp,
                         num_hidden_layers=spec.text_layers, num_attention_heads=max(1, spec.text_width // 64),
                         max_position_embeddings=spec.text_tokens, vocab_size=spec.vocab),
        vision_config=dict(hidden_size=spec.vision_width, intermediate_size=spec.vision_mlp,
                           num_hidden_layers=spec.vision_layers, num_attention_heads=heads,
                           image_size=spec.image_size, patch_size=spec.patch),
        projection_dim=spec.projection)


def _meta(spec: ClipSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.CLIPModel(_config(spec)).to(dtype)


@pytest.mark.parametrize(("spec", "published"), [(CLIP_L, 427.6e6), (CLIP_H, 986.1e6)], ids=["clip-l", "clip-h"])
def test_params_and_flops_per_image_match_a_meta_clip(spec: ClipSpec, published: float) -> None:
    model = _meta(spec)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.params == pytest.approx(published, rel=1e-3)
    pixels = torch.empty(1, 3, spec.image_size, spec.image_size, device="meta")
    ids = torch.zeros(1, spec.text_tokens, dtype=torch.long, device="meta")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.get_image_features(pixel_values=pixels)
        model.get_text_features(input_ids=ids)
    assert spec.flops_per_image == pytest.approx(counter.get_total_flops(), rel=0.01)
    # CLIP-L 175.3 GFLOP per image (162.0 image tower + 13.3 text), CLIP-H 381.7 (334.6 + 47.1)
    assert spec.flops_per_image / 1e9 == pytest.approx({CLIP_L: 175.3, CLIP_H: 381.7}[spec], abs=0.1)


@pytest.mark.parametrize("spec", [CLIP_L, CLIP_H], ids=["clip-l", "clip-h"])
def test_scoring_activations_match_a_traced_meta_forward(spec: ClipSpec) -> None:
    model = _meta(spec, torch.bfloat16)
    batch = 8
    peaks = []
    for tower in ("image", "text"):
        with torch.no_grad(), fused_attention(), LiveBytes() as live:
            if tower == "image":
                model.get_image_features(pixel_values=torch.empty(batch, 3, 224, 224, device="meta", dtype=torch.bfloat16))
            else:
                model.get_text_features(input_ids=torch.zeros(batch, 77, dtype=torch.long, device="meta"))
        peaks.append(live.peak)
    assert spec.activation_bytes(batch, 2) == pytest.approx(max(peaks), rel=0.05)


def test_a_model_directory_config_json_gives_the_architecture(tmp_path: Path) -> None:
    small = ClipSpec("small", vision_width=64, vision_layers=2, vision_mlp=128, text_width=32, text_layers=2,
                     text_mlp=64, projection=16, patch=16, image_size=64, text_tokens=16, vocab=100)
    _config(small, heads=4).save_pretrained(tmp_path)
    got = reward_model("pickscore", str(tmp_path))
    assert got is not None and got.source == f"read from {tmp_path / 'config.json'}"
    with torch.device("meta"):
        want = transformers.CLIPModel(_config(small, heads=4))
    assert got.params == sum(p.numel() for p in want.parameters())
    missing = reward_model("pickscore", str(tmp_path / "absent"))
    assert missing is not None and missing.spec == CLIP_H and "published size" in missing.source
    assert reward_model("ocr") is None and reward_model("shapes") is None


def test_aesthetic_scores_the_image_alone_with_its_mlp() -> None:
    a = PUBLISHED["aesthetic"]
    mlp = 2 * (768 * 1024 + 1024 * 128 + 128 * 64 + 64 * 16 + 16)
    text = CLIP_L.flops_per_image - a.flops_per_image + mlp
    assert 0 < text < 0.08 * CLIP_L.flops_per_image  # the text tower, not run
    assert a.params == CLIP_L.params + 927_969  # the whole CLIPModel is held, plus the MLP


def _reward_seconds(prof, samples: int = 32) -> float:
    spec = device_spec("H100")
    cost = CostModel(prof, {"r": spec}, CostParams(mfu_rollout=0.4, mfu_train=0.3), {"r": Role.REWARD})
    frag = Fragment(0, 0, 0, 4, 0, 8, 8)
    return cost.seconds(Token(0, TokenKind.REWARD, "r", 0, num_samples=samples, fragments=(frag,)), Device("r", Role.REWARD))


def test_reward_tokens_are_priced_with_the_configs_reward_models() -> None:
    pick = load_config(CONFIGS / "flux.toml")  # the shipped pickscore
    remote = load_config(CONFIGS / "flux.toml", ["reward.weights={remote=1.0}"])  # its own server: nothing here
    with_pick = model_profile(pick.model, reward=pick.reward)
    with_remote = model_profile(remote.model, reward=remote.reward)
    assert with_pick.reward_flops == CLIP_H.flops_per_image and with_remote.reward_flops == 0.0
    assert "pickscore: CLIP ViT-H/14, 381.7 GFLOP per image" in with_pick.describe()
    assert "remote: its own server, no device FLOPs" in with_remote.describe()
    # Without the [reward] table: the paper recipe's (FLUX: HPS v2.1, the CLIP-H towers).
    assert model_profile(pick.model).reward_flops == PROFILES["flux"].reward_flops == PUBLISHED["hpsv2"].flops_per_image
    # 32 samples: the decode is the same; the difference is the reward model at its utilisation.
    extra = _reward_seconds(with_pick) - _reward_seconds(with_remote)
    assert extra == pytest.approx(32 * CLIP_H.flops_per_image / (device_spec("H100").peak_bf16_flops * 0.4), rel=1e-6)
    ocr = load_config(CONFIGS / "qwenimage.toml")
    assert model_profile(ocr.model, reward=ocr.reward).reward_flops == 0.0  # PaddleOCR on the host
