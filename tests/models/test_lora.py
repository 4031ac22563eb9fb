"""LoRA / full fine-tuning: zero-init equality, reference context, state-dict sync, safetensors files."""

from __future__ import annotations

import pytest
import torch

from digenrl.errors import ConfigError
from digenrl.models import load_model
from digenrl.models.lora import (
    apply_lora,
    enable_full_finetune,
    load_trainable,
    load_trainable_state_dict,
    reference,
    sampling,
    save_trainable,
    trainable_parameters,
    trainable_state_dict,
)


def _inputs(model, seed=0):
    cond = model.encode_prompts(["a cat", "a dog"])
    x = model.prepare_latents(2, torch.Generator().manual_seed(seed))
    return x, torch.tensor([0.8, 0.3]), cond


def _perturb(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def base_out():
    m = load_model("qwenimage", "tiny", seed=0)
    x, s, c = _inputs(m)
    with torch.no_grad():
        return m.velocity(x, s, c)


def test_lora_starts_equal_to_reference_then_differs(base_out):
    m = load_model("qwenimage", "tiny", seed=0)
    params = apply_lora(m, rank=4)
    assert params and all("lora_" in n for n, p in m.transformer.named_parameters() if p.requires_grad)
    assert all(p.requires_grad for p in params)
    # only the default Qwen targets are wrapped: attention + img_mlp + txt_mlp, 12 per block
    assert len(params) == 2 * 12 * 2
    x, s, c = _inputs(m)
    with torch.no_grad():
        v0 = m.velocity(x, s, c)
    torch.testing.assert_close(v0, base_out, rtol=0, atol=0)  # B = 0: policy == reference at step 0
    _perturb(params)
    with torch.no_grad():
        v1 = m.velocity(x, s, c)
    assert (v1 - base_out).abs().max() > 1e-3
    with reference(m):
        vref = m.velocity(x, s, c)
        assert not torch.is_grad_enabled()
    torch.testing.assert_close(vref, base_out, rtol=0, atol=0)
    # gotcha 2: requires_grad restored, adapter re-enabled
    assert all(p.requires_grad for p in params)
    with torch.no_grad():
        torch.testing.assert_close(m.velocity(x, s, c), v1, rtol=0, atol=0)


def test_lora_gradients_reach_only_lora():
    m = load_model("qwenimage", "tiny", seed=0)
    params = apply_lora(m, rank=4)
    _perturb(params)  # B = 0 would zero the gradient of A
    x, s, c = _inputs(m)
    m.velocity(x, s, c).pow(2).mean().backward()
    named = [(n, p) for n, p in m.transformer.named_parameters() if "lora_" in n]
    # the last block's text-stream outputs (text queries, to_add_out, txt_mlp) never reach the image output
    dead = tuple(f"transformer_blocks.1.{t}" for t in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp"))
    for n, p in named:
        if n.startswith(dead):
            assert p.grad is None or p.grad.abs().sum() == 0, n
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert all(p.grad is None for n, p in m.transformer.named_parameters() if "lora_" not in n)


def _base_weights(model):
    return {n: p.detach().clone() for n, p in model.transformer.named_parameters() if "lora_" not in n}


def test_sampling_merges_lora_and_restores_the_base_weights_bit_for_bit():
    m = load_model("qwenimage", "tiny", seed=0)
    params = apply_lora(m, rank=4)
    _perturb(params)
    x, s, c = _inputs(m)
    with torch.no_grad():
        unmerged = m.velocity(x, s, c)
    m.velocity(x, s, c).square().mean().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    before = _base_weights(m)
    with sampling(m):
        inside = _base_weights(m)
        merged = m.velocity(x, s, c)
        assert not merged.requires_grad
    changed = [n for n in before if not torch.equal(before[n], inside[n])]
    assert changed and all(n.endswith("base_layer.weight") for n in changed)  # merged into the targets only
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-6)
    after = _base_weights(m)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # Training after sampling: the adapter is active again, with the same forward and gradients as before.
    for p in params:
        p.grad = None
    out = m.velocity(x, s, c)
    out.square().mean().backward()
    assert torch.equal(out.detach(), unmerged)
    assert any(g is not None for g in grads)
    assert all((p.grad is None and g is None) or torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


def test_sampling_leaves_bf16_weights_unmerged():
    m = load_model("qwenimage", "tiny", seed=0, dtype=torch.bfloat16)
    _perturb(apply_lora(m, rank=4))
    before = _base_weights(m)
    with sampling(m):
        assert all(torch.equal(before[n], p) for n, p in _base_weights(m).items())


def test_trainable_state_dict_roundtrip_into_fresh_replica(tmp_path):
    m = load_model("qwenimage", "tiny", seed=0)
    params = apply_lora(m, rank=4, seed=0)
    _perturb(params)
    sd = trainable_state_dict(m)
    assert sd and all("lora_" in k for k in sd)
    assert sum(v.numel() for v in sd.values()) == sum(p.numel() for p in params)
    replica = load_model("qwenimage", "tiny", seed=0)
    apply_lora(replica, rank=4, seed=7)  # different A init: the load must overwrite everything
    x, s, c = _inputs(m)
    with torch.no_grad():
        assert not torch.equal(replica.velocity(x, s, c), m.velocity(x, s, c))
    load_trainable_state_dict(replica, sd)
    with torch.no_grad():
        torch.testing.assert_close(replica.velocity(x, s, c), m.velocity(x, s, c), rtol=0, atol=0)
    # the same through a safetensors file
    f = tmp_path / "lora.safetensors"
    save_trainable(m, f)
    third = load_model("qwenimage", "tiny", seed=0)
    apply_lora(third, rank=4, seed=3)
    load_trainable(third, f)
    with torch.no_grad():
        torch.testing.assert_close(third.velocity(x, s, c), m.velocity(x, s, c), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_trainable(third, tmp_path / "nope.safetensors")
    # strictness: a wrong-rank dict is rejected by name, never half-loaded
    other = load_model("qwenimage", "tiny", seed=0)
    apply_lora(other, rank=2)
    with pytest.raises(ValueError, match="shape mismatch"):
        load_trainable_state_dict(other, sd)
    with pytest.raises(ValueError, match="missing"):
        load_trainable_state_dict(other, {})


def test_full_finetune_reference_is_frozen_copy(base_out, tmp_path):
    m = load_model("qwenimage", "tiny", seed=0)
    params = enable_full_finetune(m)
    assert len(params) == len(list(m.transformer.parameters()))
    _perturb(params)
    x, s, c = _inputs(m)
    with torch.no_grad():
        assert (m.velocity(x, s, c) - base_out).abs().max() > 1e-3
    live = m.transformer
    with reference(m):
        torch.testing.assert_close(m.velocity(x, s, c), base_out, rtol=0, atol=0)
    assert m.transformer is live and all(p.requires_grad for p in params)
    f = tmp_path / "full.safetensors"
    save_trainable(m, f)
    replica = load_model("qwenimage", "tiny", seed=5)
    enable_full_finetune(replica)
    load_trainable(replica, f)
    with torch.no_grad():
        torch.testing.assert_close(replica.velocity(x, s, c), m.velocity(x, s, c), rtol=0, atol=0)
    lora_model = load_model("qwenimage", "tiny", seed=0)
    apply_lora(lora_model)
    with pytest.raises(ConfigError, match="'full' weights"):
        load_trainable(lora_model, f)


def test_errors_name_the_problem():
    m = load_model("qwenimage", "tiny", seed=0)
    with pytest.raises(ConfigError, match="no trainable mode"):
        trainable_state_dict(m)
    with pytest.raises(ConfigError, match="target_modules"):
        apply_lora(m, target_modules=["no_such_proj"])
    apply_lora(m)
    with pytest.raises(ConfigError, match="already set up"):
        enable_full_finetune(m)
    assert trainable_parameters(m)
