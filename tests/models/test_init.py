"""``model.init``: the shipped tiny4x-shapes checkpoint loads, is checked, draws its prompts; the pretrain is reproducible."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digenrl.config import load_config
from digenrl.errors import ConfigError
from digenrl.policy import build_model
from digenrl.rewards import make_reward

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-qwenimage.toml"
CKPT = ROOT / "checkpoints" / "tiny4x-shapes"


def _ode_reward(overrides: list[str]) -> float:
    """Mean ``shapes`` reward of ODE samples (the run's 6 steps, noise 0) of 16 shapes prompts."""
    from digenrl.data.shapes import SHAPE_PROMPTS

    model, _ = build_model(load_config(TINY, ["placement.threads=1", *overrides]))
    prompts = list(SHAPE_PROMPTS[::10][:16])
    with torch.no_grad():
        cond = model.encode_prompts(prompts)
        x = model.prepare_latents(len(prompts), generator=torch.Generator().manual_seed(7))
        sig = model.sigmas(6)
        for i in range(6):
            x = x + (sig[i + 1] - sig[i]) * model.velocity(x, sig[i].expand(len(prompts)), cond)
        return float(make_reward("shapes").score(model.decode(x), prompts).mean())


def test_default_config_starts_from_the_shipped_checkpoint() -> None:
    recipe = json.loads((CKPT / "recipe.json").read_text())
    assert (CKPT / recipe["file"]).stat().st_size < 5e6  # small enough for git
    model, _ = build_model(load_config(TINY))
    state = load_file(str(CKPT / recipe["file"]))
    for comp in ("transformer", "vae", "text_encoder"):
        own = {k.replace(".base_layer", ""): v for k, v in getattr(model.pipe, comp).state_dict().items() if "lora_" not in k}
        assert len(own) == sum(k.startswith(f"{comp}.") for k in state)
        for k, v in own.items():
            assert torch.equal(v, state[f"{comp}.{k}"]), f"{comp}.{k}"


def test_the_checkpoint_draws_what_the_prompt_names() -> None:
    """The reason it ships: the random preset's samples are not shapes at all."""
    trained = _ode_reward([])
    random = _ode_reward(["model.init=''", "model.vae_init=signal"])
    assert trained > random + 0.2, (trained, random)  # measured: see recipe.json's ode_sample_shapes_reward


def test_a_changed_checkpoint_or_a_wrong_model_is_refused(tmp_path: Path) -> None:
    for name in ("model.safetensors", "recipe.json"):
        shutil.copy(CKPT / name, tmp_path / name)
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    recipe["sha256"] = "0" * 64
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(ConfigError, match="model.init: .* has sha256"):
        build_model(load_config(TINY, [f"model.init={tmp_path / 'model.safetensors'}"]))
    (tmp_path / "recipe.json").unlink()  # no recipe: no hash check, but the architecture must fit
    with pytest.raises(ConfigError, match="does not fit the qwenimage model's transformer"):
        build_model(load_config(TINY, [f"model.init={tmp_path / 'model.safetensors'}", "model.preset=small"]))
    with pytest.raises(ConfigError, match="model.init: checkpoint 'nowhere.safetensors' does not exist"):
        build_model(load_config(TINY, ["model.init=nowhere.safetensors"]))
    with pytest.raises(ConfigError, match="model.vae_init: must be 'default' with model.init"):
        load_config(TINY, ["model.vae_init=signal"])


@pytest.mark.slow  # ~18 s: two pretraining runs
def test_pretrain_is_deterministic(tmp_path: Path) -> None:
    """Two short pretrains with the same seed write byte-identical checkpoints (and the recipe says so)."""
    digests = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([sys.executable, str(ROOT / "bench" / "pretrain_tiny.py"), "--out", str(out), "--threads", "1",
                        "--vae-steps", "2", "--steps", "2", "--batch", "4", "--vae-batch", "2"],
                       check=True, capture_output=True, timeout=300)
        recipe = json.loads((out / "recipe.json").read_text())
        digests.append(recipe["sha256"])
        build_model(load_config(TINY, [f"model.init={out / 'model.safetensors'}"]))  # loads, hash checked
    assert digests[0] == digests[1]
