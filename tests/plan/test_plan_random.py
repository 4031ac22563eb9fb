"""The memory plan of ``model.preset = "random"``: the published architecture, so the plan of ``pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.config import load_config
from digenrl.models.full import build_full
from digenrl.plan.memory import memory_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _without_preset(plan: dict) -> dict:
    return {**plan, "model": {k: v for k, v in plan["model"].items() if k != "preset"}}


def test_random_plans_exactly_as_pretrained() -> None:
    pretrained = memory_plan(load_config(CONFIGS / "qwenimage.toml")).to_json()
    random = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["model.preset=random"])).to_json()
    assert (pretrained["model"]["preset"], random["model"]["preset"]) == ("pretrained", "random")
    assert _without_preset(random) == _without_preset(pretrained)


def test_random_embeds_and_layers_change_only_what_they_remove() -> None:
    cfg = load_config(CONFIGS / "qwenimage.toml", ["model.preset=random"])
    whole = memory_plan(cfg)
    embeds = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["model.preset=random",
                                                                  "model.text_encoder=random-embeds"]))
    assert embeds.text_encoder_params == 0 and whole.text_encoder_params > 7e9
    for role in ("rollout", "trainer"):
        a, b = whole.roles[role], embeds.roles[role]
        assert b.text_encoders == b.host_bytes == 0
        assert (a.weights, a.trainable, a.grads, a.optimizer, a.activations, a.vae) == \
               (b.weights, b.trainable, b.grads, b.optimizer, b.activations, b.vae)
    cut = memory_plan(load_config(CONFIGS / "qwenimage.toml", ["model.preset=random", "model.layers=2"]))
    assert cut.transformer_params == sum(p.numel() for p in build_full("qwenimage", layers=2).transformer.parameters())
    block = (whole.transformer_params - cut.transformer_params) / 58
    assert abs(block / (20.43e9 / 60) - 1) < 0.05  # one of the 60 published blocks
    assert cut.roles["trainer"].activations < whole.roles["trainer"].activations
    assert cut.roles["trainer"].weights == cut.transformer_params * torch.finfo(torch.bfloat16).bits // 8
