"""Qwen-Image-Edit in the simulator and the memory plan: the input image's tokens are counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from digenrl.sim.flops import SampleShape, edit_image_tokens, forward_flops, param_count
from digenrl.sim.profiles import model_profile, profile
from digenrl.sim.scenarios import scenario

diffusers = pytest.importorskip("diffusers")
ROOT = Path(__file__).resolve().parents[2]
TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def test_forward_flops_count_the_input_image_tokens() -> None:
    """The formula equals FlopCounterMode on a real tiny forward over [noise tokens, image tokens], as the adapter calls it."""
    shape = SampleShape(1, 8, 8, 7, cond_tokens=16)
    model = diffusers.QwenImageTransformer2DModel(**TINY).eval()
    x = torch.randn(1, 2 * 16, 64)  # 4x4 noise tokens, then the input image's 4x4
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(hidden_states=x, encoder_hidden_states=torch.randn(1, 7, 32), timestep=torch.ones(1),
              encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.bool), img_shapes=[[(1, 4, 4), (1, 4, 4)]])
    assert forward_flops("qwen-image-edit", shape, TINY) == int(counter.get_total_flops())
    # at real size: Qwen-Image's forward over the noise and the input image's tokens
    assert forward_flops("qwen-image-edit", SampleShape(1, 64, 64, 1536, cond_tokens=1024)) == forward_flops(
        "qwen-image", SampleShape(1, 64, 128, 1536))


@pytest.mark.parametrize("area,height,width", [(1024 * 1024, 512, 512), (1024 * 1024, 480, 832), (512 * 512, 512, 512),
                                               (64 * 64, 48, 80)])
def test_input_image_tokens_are_the_adapters(area: int, height: int, width: int) -> None:
    """The simulator's count of the conditioning image's tokens equals what the adapter packs (models/qwenimage_edit.py
    image_size: the pipelines' calculate_dimensions), at the pipelines' 1024² and other areas."""
    from digenrl.models.qwenimage_edit import image_size

    h, w = image_size(area, height, width)
    assert edit_image_tokens(area, height, width) == (h // 16) * (w // 16)


def test_param_count_is_the_published_transformer() -> None:
    """Both variants build Qwen-Image's transformer (models/full.py); the Hugging Face model cards of Qwen/Qwen-Image-Edit
    and -2509 give 20.4 B parameters (safetensors metadata of the 20B MMDiT)."""
    from digenrl.models.full import build_full

    for variant in ("edit", "edit-plus"):
        full = build_full("qwenimage_edit", variant, text_encoders=False)
        n = sum(p.numel() for p in full.transformer.parameters())
        assert n == param_count("qwen-image-edit", variant) == 20_430_401_088
        assert abs(n / 20.4e9 - 1) < 0.005


def test_scenarios_and_config_profile() -> None:
    sc = scenario("qwenedit-16")
    assert sc.profile is profile("qwen-image-edit") and sc.profile.cfg_rollout == 2
    from digenrl.config import load_config

    cfg = load_config(ROOT / "configs" / "qwenimage_edit.toml")
    p = model_profile(cfg.model)
    # 512² output, the input image VAE-encoded at the pipelines' 1024²: 4096 tokens beside the 1024 noise tokens
    assert p.arch == "qwen-image-edit" and p.shape == SampleShape(1, 64, 64, 1536, cond_tokens=4096)
    assert p.forward_flops == forward_flops("qwen-image", SampleShape(1, 64, 64 * 5, 1536))
    small = model_profile(load_config(ROOT / "configs" / "qwenimage_edit.toml", [f"model.image_area={512 * 512}"]).model)
    assert small.shape.cond_tokens == 1024 and small.forward_flops < p.forward_flops


def test_memory_plan_traces_the_longer_sequence() -> None:
    from digenrl.config import load_config
    from digenrl.plan.memory import memory_plan

    edit = memory_plan(load_config(ROOT / "configs" / "qwenimage_edit.toml"))
    assert edit.roles and all(r.fits for r in edit.roles.values())
    t2i = memory_plan(load_config(ROOT / "configs" / "qwenimage_edit.toml",
                                  ["model.name=qwenimage", "model.variant=''", "data.prompt_set=ocr", "data.prompt_file=''"]))
    # the same model but for the input image's tokens: they cost activations, the more the larger the image
    assert edit.train_activations > t2i.train_activations and edit.rollout_forward > t2i.rollout_forward
    small = memory_plan(load_config(ROOT / "configs" / "qwenimage_edit.toml", [f"model.image_area={512 * 512}"]))
    assert t2i.rollout_forward < small.rollout_forward < edit.rollout_forward


def test_edit_plus_counts_every_input_image(tmp_path: Path) -> None:
    """Qwen-Image-Edit-Plus appends each input image's tokens: a prompt file with two images a line doubles the
    conditioning tokens in the simulator (through the plan's config profile) and lengthens the traced sequence."""
    from digenrl.config import load_config
    from digenrl.plan.fleet import config_profile
    from digenrl.plan.memory import memory_plan

    edit = ROOT / "examples" / "edit"
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "put the circle beside the square", '
                   f'"images": ["{edit / "red_square.png"}", "{edit / "green_circle.png"}"]}}\n')
    plus = ["model.variant=edit-plus", "rollout.group_size=2", "rollout.prompts_per_batch=1"]
    one_cfg = load_config(ROOT / "configs" / "qwenimage_edit.toml", plus)
    two_cfg = load_config(ROOT / "configs" / "qwenimage_edit.toml", [*plus, f"data.prompt_file={two}"])
    assert (one_cfg.input_images, two_cfg.input_images) == (1, 2)
    assert config_profile(two_cfg).shape == SampleShape(1, 64, 64, 1536, cond_tokens=2 * 4096)
    assert config_profile(two_cfg).forward_flops == forward_flops("qwen-image", SampleShape(1, 64, 64 * 9, 1536))
    one, both = memory_plan(one_cfg), memory_plan(two_cfg)
    assert both.rollout_forward > one.rollout_forward and both.train_activations > one.train_activations
