"""model.compile: the transformer compiled in place samples and trains as the eager one does."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.errors import ConfigError
from digenrl.models import trainable_parameters
from digenrl.policy import build_model

CONF = {"model": {"name": "qwenimage", "preset": "tiny"}}


@pytest.mark.slow  # ~50 s: inductor compiles the tiny transformer (model.compile is opt-in)
def test_a_compiled_transformer_gives_the_eager_velocity_and_gradients(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager, _ = build_model(config_from_dict(CONF))
    compiled, params = build_model(config_from_dict({"model": {**CONF["model"], "compile": "default"}}))
    cond = eager.encode_prompts(["a red square", "a blue circle"])
    x = eager.prepare_latents(2, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.4])
    grads = []
    for model in (eager, compiled):
        trainable = trainable_parameters(model)
        with torch.no_grad():  # LoRA B starts at zero: move it, so the adapters matter
            for p in trainable:
                p.add_(0.01)
        v = model.velocity(x, sigma, cond)
        v.square().mean().backward()
        grads.append((v.detach(), [None if p.grad is None else p.grad.clone() for p in trainable]))
    (v0, g0), (v1, g1) = grads
    torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-5)
    assert [g is None for g in g1] == [g is None for g in g0] and any(g is not None for g in g0)
    for a, b in zip(g1, g0, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    assert compiled.transformer._compiled_call_impl is not None and params == trainable_parameters(compiled)
    assert any((tmp_path / "inductor").rglob("*")), "the compiled kernels were not cached"


def test_compile_with_fsdp_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"model.compile = 'default' with train.shard = 'fsdp'"):
        config_from_dict({"model": {**CONF["model"], "compile": "default", "finetune": "full"},
                          "schedule": {"name": "gap"}, "placement": {"trainer": 2}})
    with pytest.raises(ConfigError, match="model.compile"):
        config_from_dict({"model": {**CONF["model"], "compile": "fast"}})
