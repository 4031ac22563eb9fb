"""The activation tracer: live bytes of what operators create, depth extrapolation exact."""

from __future__ import annotations

import pytest
import torch

from digenrl.plan.trace import LiveBytes, fused_attention, trace_extrapolated, trace_pass, transformer_inputs


def test_live_bytes_counts_created_tensors_and_frees_them() -> None:
    with torch.device("meta"):
        lin = torch.nn.Linear(1000, 500).to(torch.bfloat16)
    x = torch.empty(4, 1000, device="meta", dtype=torch.bfloat16)
    mode = LiveBytes()
    with torch.no_grad(), mode:
        a = lin(x)  # 4 x 500 bf16: the weight's transpose is a view of a tensor made before the trace
        b = a.relu()  # another 4000 bytes
        del a
        c = b * 2  # reuses nothing: a third tensor, while a is gone
    assert mode.peak == 2 * 4 * 500 * 2
    assert mode.live == 2 * 4 * 500 * 2 and c.shape == b.shape


def test_fused_attention_keeps_no_score_matrix() -> None:
    q = torch.empty(1, 2, 4096, 64, device="meta", dtype=torch.bfloat16)
    mode = LiveBytes()
    with fused_attention(), mode:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    # the output and one fp32 log-sum-exp per query and head; the math path would hold 2 x 4096^2 scores
    assert mode.peak == out.numel() * 2 + 2 * 4096 * 4


@pytest.mark.parametrize("name", ["qwenimage", "flux", "wan21", "hunyuanvideo"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_depth_extrapolation_equals_the_full_trace(name: str, checkpointing: bool) -> None:
    import importlib

    module = {"qwenimage": "qwenimage", "flux": "flux", "wan21": "wan", "hunyuanvideo": "hunyuan"}[name]
    build = getattr(importlib.import_module(f"digenrl.models.{module}"), f"build_{module}_pipeline")
    tr = build("small", 0).transformer
    cls = type(tr)
    with torch.device("meta"):  # deeper than the preset, so the extrapolation has something to do
        tr = cls.from_config({**dict(tr.config), "num_layers": 5}).to(torch.bfloat16)

    def make(t: torch.nn.Module) -> dict:
        return transformer_inputs(name, t, 3, 64, 64, 5 if name in ("wan21", "hunyuanvideo") else 1, 16, torch.bfloat16)

    full = trace_pass(name, tr, make(tr), train=True, checkpointing=checkpointing)
    assert trace_extrapolated(name, tr, make, train=True, checkpointing=checkpointing) == pytest.approx(full, rel=0.01)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dual", [(), (0, 1, 2)], ids=["mmdit", "mmdit-x"])
def test_sd3_depth_extrapolation_equals_the_full_trace(dual: tuple, checkpointing: bool) -> None:
    """SD3.5 Large's plain stack, and Medium's (MMDiT-X) dual-attention blocks first, then plain ones."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        tr = SD3Transformer2DModel(num_layers=6, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                   caption_projection_dim=128, pooled_projection_dim=32, pos_embed_max_size=16,
                                   dual_attention_layers=dual, qk_norm="rms_norm").to(torch.bfloat16)

    def make(t: torch.nn.Module) -> dict:
        return transformer_inputs("sd3", t, 3, 64, 64, 1, 16, torch.bfloat16)

    full = trace_pass("sd3", tr, make(tr), train=True, checkpointing=checkpointing)
    assert trace_extrapolated("sd3", tr, make, train=True, checkpointing=checkpointing) == pytest.approx(full, rel=0.01)
