"""Each model size has its own profile: a config is priced with its model, variant, resolution, frames and text
length (``plan --fleet``), a scenario with its model at its variant (``bench bubbles``); the FLOPs are checked
against FlopCounterMode on a meta-device forward of the architecture the memory plan builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.models.full import FULL_CONFIGS
from digenrl.plan.fleet import plan_fleet, scenario_config
from digenrl.sim.flops import DEFAULT_CONFIGS, VARIANTS, SampleShape, forward_flops, param_count
from digenrl.sim.profiles import ARCH_OF_MODEL, PROFILES, model_profile, profile
from digenrl.sim.scenarios import scenario
from digenrl.sim.user import fleet_pools, load_scenario
from digenrl_cli.main import app

diffusers = pytest.importorskip("diffusers")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_MODEL_OF_ARCH = {arch: name for name, arch in ARCH_OF_MODEL.items()}


def _meta_wan(variant: str, shape: SampleShape, layers: int = 0) -> tuple[int, int]:
    """(FLOPs of one forward, parameters) of Wan2.1 ``variant`` (``layers`` blocks: 0 = all) built from
    models/full.py's config on the meta device (what the memory plan builds), at ``shape``: counted, not computed."""
    cls, kwargs = FULL_CONFIGS["wan21"][variant]["transformer"]
    kwargs = {**kwargs, "num_layers": layers} if layers else kwargs
    with torch.device("meta"):
        model = getattr(diffusers, cls)(**kwargs)
        x = torch.empty(1, kwargs["in_channels"], shape.latent_frames, shape.latent_height, shape.latent_width)
        text = torch.empty(1, shape.text_tokens, kwargs["text_dim"])
        t = torch.ones(1)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(hidden_states=x, encoder_hidden_states=text, timestep=t)
    return int(counter.get_total_flops()), sum(p.numel() for p in model.parameters())


def test_variants_are_the_memory_plans_architectures() -> None:
    """flops.VARIANTS names the sizes models/full.py builds, and each one's config is that module's transformer."""
    for arch, sizes in VARIANTS.items():
        name = _MODEL_OF_ARCH[arch]
        assert tuple(sizes) == tuple(FULL_CONFIGS[name]), arch  # same names, smallest first
        for variant, overrides in sizes.items():
            kwargs = FULL_CONFIGS[name][variant]["transformer"][1]
            for key, value in {**DEFAULT_CONFIGS[arch], **overrides}.items():
                if key in kwargs:
                    assert kwargs[key] == value, (arch, variant, key)


def test_planning_wan21_prices_the_1_3b_model_and_the_14b_override_the_14b_one(tmp_path: Path) -> None:
    """configs/wan21.toml (1.3B, 33 frames at 480x832, 512 text tokens, CFG 4.5): `plan --fleet` prices one
    forward at what FlopCounterMode counts on the meta 1.3B transformer at that shape; model.variant=14B at the
    14B count; so their ratio is the counted one (about 6.9: width 5120 vs 1536, 40 vs 30 blocks)."""
    shape = SampleShape.from_pixels(33, 480, 832, 512)
    counted = {v: _meta_wan(v, shape) for v in ("1.3B", "14B")}
    assert counted["1.3B"][1] == param_count("wan", "1.3B") and counted["14B"][1] == param_count("wan", "14B")

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(CONFIGS / "wan21.toml"), "--fleet", "2xH100", "--batches", "3",
                                   "--top", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    small = json.loads(out.read_text())
    assert small["profile"]["name"] == "Wan2.1-1.3B" and small["profile"]["latent"] == [9, 60, 104]
    assert small["profile"]["passes_per_step"] == 2  # guidance_scale 4.5: true CFG
    assert small["profile"]["forward_flops"] == pytest.approx(counted["1.3B"][0], rel=1e-6)
    assert "Wan2.1-1.3B profile (33 frames at 480x832, 512 text tokens" in small["cost_source"]
    assert f"costs: {small['cost_source']}" in res.output

    cfg = load_config(CONFIGS / "wan21.toml", ["model.variant=14B"])
    large = plan_fleet(cfg, fleet_pools("2xH100"), top=1, batches=3, final_batches=3)
    assert large.profile is not None and large.profile["name"] == "Wan2.1-14B"
    assert large.profile["forward_flops"] == pytest.approx(counted["14B"][0], rel=1e-6)
    ratio = large.profile["forward_flops"] / small["profile"]["forward_flops"]
    assert ratio == pytest.approx(counted["14B"][0] / counted["1.3B"][0], rel=1e-6)
    assert 6.5 < ratio < 7.5
    # a 14B forward is ~7x a 1.3B one: the plan's best is several times slower (not the same numbers)
    assert large.best.samples_per_s < small["candidates"][0]["samples_per_s"] / 4


def test_config_profile_follows_resolution_frames_text_and_guidance() -> None:
    m = load_config(CONFIGS / "wan21.toml").model
    base = model_profile(m)
    assert base.forward_flops == forward_flops("wan", SampleShape.from_pixels(33, 480, 832, 512), variant="1.3B")
    for key, value, shape in (("resolution", [240, 416], (33, 240, 416, 512)), ("num_frames", 17, (17, 480, 832, 512)),
                              ("text_len", 128, (33, 480, 832, 128))):
        prof = model_profile(load_config(CONFIGS / "wan21.toml", [f"model.{key}={value}"]).model)
        assert prof.forward_flops == forward_flops("wan", SampleShape.from_pixels(*shape), variant="1.3B"), key
        assert prof.forward_flops < base.forward_flops
    assert model_profile(load_config(CONFIGS / "wan21.toml", ["model.guidance_scale=1.0"]).model).cfg_rollout == 1
    # FLUX.1-dev is guidance-distilled: one pass whatever guidance_scale says
    assert model_profile(load_config(CONFIGS / "flux.toml").model).cfg_rollout == 1
    full = model_profile(load_config(CONFIGS / "wan21.toml", ["model.finetune=full"]).model)
    assert full.full_finetune and full.trainable_params == param_count("wan", "1.3B")


def test_a_model_cut_to_fewer_blocks_is_priced_at_its_depth() -> None:
    """model.layers (preset random): the profile's forward is the cut model's counted forward, its transformer
    the cut model's parameters (the memory plan's count)."""
    from digenrl.plan.fleet import config_profile

    cfg = load_config(CONFIGS / "wan21.toml", ["model.preset=random", "model.layers=2", "model.text_len=64"])
    prof = config_profile(cfg)
    flops, params = _meta_wan("1.3B", SampleShape.from_pixels(33, 480, 832, 64), layers=2)
    assert prof.layers == 2 and prof.forward_flops == pytest.approx(flops, rel=1e-6)
    assert prof.transformer_params == params and prof.weight_bytes == 2 * params


def test_a_tiny_preset_has_no_flop_profile() -> None:
    with pytest.raises(ConfigError, match=r"model.preset = 'tiny4x'.*--costs FILE"):
        model_profile(load_config(CONFIGS / "tiny-qwenimage.toml").model)


def test_a_scenario_is_priced_at_its_variant(tmp_path: Path) -> None:
    from digenrl.sim.bench import run_bubbles

    file = tmp_path / "wan13.toml"
    file.write_text('model = "wan21"\nvariant = "1.3B"\nprompts = 2\ngroup_size = 2\nnum_steps = 4\ntrained_steps = 2\n'
                    '[[pools]]\ndevice = "H800"\ncount = 2\n')
    sc = load_scenario(file).scenario
    assert sc.profile.name == "Wan2.1-1.3B" and sc.profile.shape == PROFILES["wan"].shape  # the paper recipe's
    assert sc.profile.forward_flops == forward_flops("wan", PROFILES["wan"].shape, variant="1.3B")
    assert sc.profile.trainable_params < PROFILES["wan"].trainable_params  # LoRA r32 on a narrower model
    (row,) = run_bubbles([str(file)], ["async1"], 3, decomposition=False).rows
    assert (row["model"], row["variant"]) == ("Wan2.1-1.3B", "1.3B") and "Wan2.1-1.3B profile" in row["cost_source"]
    # the paper scenarios keep the paper's size; the planner plans them at it
    assert scenario("wan-16").profile is PROFILES["wan"] and profile("wan", "14B") is PROFILES["wan"]
    assert scenario_config(scenario("wan-16")).model.variant == "14B"
    file.write_text(file.read_text().replace('"1.3B"', '"7B"'))
    with pytest.raises(ConfigError, match=r"variant: wan has no variant '7B'; allowed: 1.3B, 14B"):
        load_scenario(file)
