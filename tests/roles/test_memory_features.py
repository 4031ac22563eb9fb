"""The trainer's memory features (``policy.prepare_for_training``) on the real tiny diffusers model."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.policy import build_model, prepare_for_training, text_encoders

BASE = {"model": {"name": "qwenimage", "preset": "tiny"}, "schedule": {"name": "gap"}}


def _cfg(**tables: dict) -> object:
    conf = {k: dict(v) for k, v in BASE.items()}
    for table, values in tables.items():
        conf.setdefault(table, {}).update(values)
    return config_from_dict(conf)


def _grads(cfg: object) -> dict[str, torch.Tensor]:
    model, params = build_model(cfg)
    prepare_for_training(model, cfg, generates=True)
    g = torch.Generator().manual_seed(0)
    cond = model.encode_prompts(["a red square", "a blue circle"])
    x = model.prepare_latents(2, generator=g)
    v = model.velocity(x, torch.tensor([0.7, 0.4]), cond)
    (v.float() ** 2).mean().backward()
    # (a few adapters sit where this loss sends no gradient: their grad stays None)
    return {n: p.grad.clone() for n, p in model.transformer.named_parameters() if p.requires_grad and p.grad is not None}


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients() -> None:
    plain = _grads(_cfg())
    ckpt_cfg = _cfg(train={"grad_checkpointing": True})
    model, _ = build_model(ckpt_cfg)
    prepare_for_training(model, ckpt_cfg)
    assert model.transformer.is_gradient_checkpointing
    checkpointed = _grads(ckpt_cfg)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    assert any(float(g.abs().max()) > 0 for g in plain.values())
    for k in plain:
        torch.testing.assert_close(checkpointed[k], plain[k], rtol=1e-5, atol=1e-7, msg=k)


def test_bf16_model_keeps_fp32_master_lora_weights() -> None:
    cfg = _cfg(model={"dtype": "bfloat16"})
    model, params = build_model(cfg)
    prepare_for_training(model, cfg)
    assert {p.dtype for p in params} == {torch.float32}
    assert next(p for n, p in model.transformer.named_parameters() if "lora_" not in n).dtype == torch.bfloat16
    # An update far below bf16's resolution of the weight survives in the fp32 master copy.
    p = params[0]
    before = p.detach().clone()
    with torch.no_grad():
        p.add_(1e-6)
    assert not torch.equal(p, before)
    plain = _cfg(model={"dtype": "bfloat16"}, train={"fp32_master": False})
    model2, params2 = build_model(plain)
    prepare_for_training(model2, plain)
    assert {q.dtype for q in params2} == {torch.bfloat16}


@pytest.mark.parametrize(("schedule", "keeps"), [("gap", False), ("tag", True)])
def test_a_trainer_keeps_the_vae_only_when_it_generates(schedule: str, keeps: bool) -> None:
    cfg = _cfg(schedule={"name": schedule})
    model, _ = build_model(cfg)
    prepare_for_training(model, cfg)
    assert (model.pipe.vae is not None) == keeps
    assert text_encoders(model)  # prompts can still be encoded (probes); on CUDA they wait on the CPU
    assert model.encode_prompts(["a red square"])["prompt_embeds"].shape[0] == 1
