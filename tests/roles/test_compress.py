"""Compressed transfer to a far rollout pool (digenrl/roles/compress.py): weight deltas with error feedback, the
receivers' view checked by digest and by an independent error computation, fragments packed for the link, and a
tiny async1 run with compression on (rollout weights within the bound after every sync, learning as without)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.errors import ConfigError, ProtocolError
from digenrl.roles.compress import DeltaChain, decode_fragment, encode_fragment, rebuild
from digenrl.roles.fragments import FragmentData, FragmentEngine
from digenrl.roles.weights import pack_buckets, state_digest, unpack_buckets
from digenrl.sim.compression import choose_samples_compression, choose_weights_compression, weight_bytes_ratio

PROMPTS = ["a red square", "a blue circle"]


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.lora_A": torch.randn(64, 300, generator=g) * 0.1, "a.lora_B": torch.zeros(300, 64),
            "b.lora_A": (torch.randn(16, 500, generator=g) * 0.1).to(torch.bfloat16), "steps": torch.arange(3)}


def _trajectory(versions: int, seed: int = 1):
    """An Adam-like walk: every step moves each weight by ~1e-3 (bf16 weights rounded as a trainer would hold them)."""
    g = torch.Generator().manual_seed(seed)
    sd = _weights()
    for v in range(versions):
        yield v, sd
        sd = {k: (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype) if t.is_floating_point()
              else t + 1 for k, t in sd.items()}


def _np_error(exact: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Max-abs and relative L2 error of a receiver's weights, computed apart from the chain (numpy, float64)."""
    w = np.concatenate([exact[k].double().numpy().ravel() for k in exact if exact[k].is_floating_point()])
    h = np.concatenate([held[k].double().numpy().ravel() for k in exact if exact[k].is_floating_point()])
    return float(np.abs(w - h).max()), float(np.linalg.norm(w - h) / np.linalg.norm(w))


def _sync(chain: DeltaChain, versions: int, receivers=("far-0",), bucket_mb: float = 0.05):
    """Publish ``versions`` versions to receivers that rebuild each from the one they hold; yields per version the
    publication, the exact weights and each receiver's weights."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for v, sd in _trajectory(versions):
        layout, buckets = pack_buckets(sd, bucket_mb)
        pub = chain.plan(v, layout, buckets, list(receivers))
        for r in pub.full_to:
            held[r] = {k: t.clone() for k, t in unpack_buckets(layout, pub.view).items()}
        for r in pub.delta_to:
            held[r] = rebuild(held[r], layout, pub.delta)
        chain.delivered(pub, [])
        yield pub, sd, dict(held)


@pytest.mark.parametrize("method", ["int8", "topk"])
def test_error_feedback_keeps_the_receivers_within_the_bound_and_without_it_they_drift(method: str) -> None:
    versions, rel = 60, {}
    for feedback in (True, False):
        chain = DeltaChain(method, topk_fraction=0.25, max_error=float("inf"), error_feedback=feedback)
        errors = []
        for pub, exact, held in _sync(chain, versions):
            max_abs, r = _np_error(exact, held["far-0"])
            assert pub.stats["max_abs"] == pytest.approx(max_abs, rel=1e-5, abs=1e-12)  # the trainer's own report
            assert pub.stats["rel"] == pytest.approx(r, rel=1e-4, abs=1e-12)
            assert state_digest(held["far-0"]) == pub.stats["digest"]  # bit for bit what the trainer thinks
            errors.append(r)
        rel[feedback] = errors
    fb, drift = np.array(rel[True][1:]), np.array(rel[False][1:])
    assert fb.max() < 3 * fb[:20].max(), "with error feedback the error must stay flat"
    assert drift[-1] > 2 * drift[10] and drift[-1] > 5 * fb[-20:].max(), (drift[[10, -1]], fb[-20:].max())


def test_past_the_bound_a_publication_goes_full_and_newcomers_get_the_view_in_full() -> None:
    chain = DeltaChain("topk", topk_fraction=0.5, max_error=4e-3)
    pubs = list(_sync(chain, 6, receivers=("far-0", "far-1")))
    assert [p.stats["method"] for p, _, _ in pubs] == ["full"] + ["topk"] * 5
    for pub, exact, held in pubs:
        assert 0 < pub.stats["rel"] <= 4e-3 or pub.stats["method"] == "full"
        assert _np_error(exact, held["far-0"])[1] <= 4e-3
        assert state_digest(held["far-0"]) == state_digest(held["far-1"]) == pub.stats["digest"]
    # a jump a top-k delta cannot carry within the bound goes as int8; one that int8 cannot either goes exact
    g = torch.Generator().manual_seed(7)
    for amp, method in ((0.01, "int8"), (0.5, "full")):
        jumped = {k: t + amp * torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t
                  for k, t in pubs[-1][1].items()}
        layout, buckets = pack_buckets(jumped, 0.05)
        pub = chain.plan(6, layout, buckets, ["far-0", "far-1"])
        assert pub.stats["method"] == method and pub.stats["rel"] <= 4e-3
        chain.delivered(pub, [])
    assert pub.stats["rel"] == 0 and pub.full_to == ["far-0", "far-1"] and pub.stats["digest"] == state_digest(jumped)
    # a newcomer, and an actor that missed a version, get the view itself: the pool stays on one chain
    pub = chain.plan(7, layout, buckets, ["far-0", "far-2"])
    assert pub.delta_to == ["far-0"] and pub.full_to == ["far-2"] and pub.base == 6
    chain.delivered(pub, ["far-0"])  # far-0 died on the way: it is no holder any more
    assert chain.holders == {"far-2"}


def test_int8_publications_cost_a_quarter_of_float32_and_topk_its_fraction() -> None:
    chain = DeltaChain("int8")
    pubs = [p for p, _, _ in _sync(chain, 3, bucket_mb=64)]
    full, delta = pubs[0].stats, pubs[2].stats
    assert full["bytes"] == full["full_bytes"]
    ratio = delta["bytes"] / delta["full_bytes"]
    # float32 and bf16 weights at one byte each (+ one float32 scale per 4096), the int64 bucket as it is
    assert ratio < 0.40, ratio
    assert weight_bytes_ratio("int8", 4) == pytest.approx(0.25, rel=1e-2) and weight_bytes_ratio("topk", 2, 0.01) == pytest.approx(0.025, rel=1e-3)


def test_a_delta_that_does_not_fit_the_held_version_is_refused() -> None:
    sd = _weights()
    layout, buckets = pack_buckets(sd, 64)
    chain = DeltaChain("int8")
    chain.plan(0, layout, buckets, ["r"])
    chain.delivered(chain.plan(0, layout, buckets, ["r"]), [])
    pub = chain.plan(1, layout, buckets, ["r"])
    with pytest.raises(ProtocolError, match="'a.lora_A' does not match the held version"):
        rebuild({k: v for k, v in sd.items() if k != "a.lora_A"}, layout, pub.delta)
    with pytest.raises(ProtocolError, match="malformed layout"):
        rebuild(sd, [["a.lora_A"]], pub.delta)


def test_auto_chooses_by_the_link_and_the_keys_are_validated() -> None:
    assert choose_weights_compression(0) == "none" == choose_weights_compression(100e9)
    assert choose_weights_compression(10e9) == "int8" and choose_weights_compression(0.1e9) == "topk"
    assert choose_samples_compression(0) == "none" and choose_samples_compression(1e9) == "bf16"
    far = config_from_dict({"transport": {"rollout_link_gbit": 0.5}}).transport
    assert (far.weights_codec, far.samples_codec) == ("topk", "bf16")
    assert config_from_dict({}).transport.weights_codec == "none"
    assert config_from_dict({"transport": {"rollout_link_gbit": 1, "weights": "gloo"}}).transport.weights_codec == "none"
    with pytest.raises(ConfigError, match="transport.weights_compression = 'int8' needs transport.weights = 'zmq'"):
        config_from_dict({"transport": {"weights_compression": "int8", "weights": "gloo"}})
    with pytest.raises(ConfigError, match="transport.topk_fraction: must be in"):
        config_from_dict({"transport": {"topk_fraction": 0}})
    with pytest.raises(ConfigError, match="transport.samples_compression: 'zstd' is not allowed"):
        config_from_dict({"transport": {"samples_compression": "zstd"}})
    with pytest.raises(ConfigError, match="transport.weights_max_error"):
        config_from_dict({"transport": {"weights_max_error": -1}})


def _finished(algorithm: str) -> tuple[FragmentData, FragmentEngine]:
    from digenrl.policy import build_model

    cfg = config_from_dict({"model": {"name": "qwenimage", "preset": "tiny", "text_len": 32},
                            "rollout": {"num_steps": 3, "group_size": 2, "prompts_per_batch": 2},
                            "train": {"algorithm": algorithm}})
    engine = FragmentEngine(cfg, build_model(cfg)[0])
    frag = engine.fresh([0, 0, 0, 2, 0, 2, 2], 0, PROMPTS)
    engine.advance([frag], 0, 3)
    return frag, engine


def test_transitions_travel_losslessly_and_clean_latents_in_bf16() -> None:
    from digenrl.transport.compress import encoded_nbytes

    coupled, _ = _finished("flow_grpo")
    wire = coupled.to_wire(with_latents=False)
    for method in ("lossless", "bf16"):  # bf16 never touches a coupled algorithm's transitions
        back = FragmentData.from_wire(decode_fragment(encode_fragment(wire, method)))
        assert all(torch.equal(back.transitions()[k], v) for k, v in coupled.transitions().items())
        assert all(torch.equal(back.cond[k], v) for k, v in coupled.cond.items())
    packed = encode_fragment(wire, "lossless")
    assert encoded_nbytes(packed) < encoded_nbytes(wire)
    nft, _ = _finished("nft")
    wire = nft.to_wire(with_latents=False)
    back = FragmentData.from_wire(decode_fragment(encode_fragment(wire, "bf16"))).transitions()
    y = nft.transitions()["y"]
    assert torch.equal(back["y"], y.to(torch.bfloat16).float()) and not torch.equal(back["y"], y)
    assert torch.equal(back["probe"], nft.transitions()["probe"])  # the parity probe stays exact
    assert decode_fragment(wire) is wire  # nothing packed: nothing to do
