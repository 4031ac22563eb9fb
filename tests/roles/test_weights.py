"""Weight buckets, the versioned store on rollout actors, and digests (real tiny model, one process)."""

from __future__ import annotations

import pytest
import torch

from digenrl.policy import build_model
from digenrl.roles.weights import WeightStore, pack_buckets, state_digest, unpack_buckets
from digenrl.config import config_from_dict
from digenrl.errors import ProtocolError, StalenessViolation
from digenrl.models.lora import trainable_state_dict


def test_buckets_round_trip_bit_exact_and_split_by_dtype_and_size() -> None:
    g = torch.Generator().manual_seed(0)
    sd = {
        "a": torch.randn(300, 200, generator=g),  # 234 KiB: its own bucket at 0.1 MiB
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(5),
        "d": torch.randn(3, 4, generator=g),
        "e": torch.randn(2, generator=g).to(torch.bfloat16),
    }
    layout, buckets = pack_buckets(sd, bucket_mb=0.1)
    assert [e[0] for e in layout] == list(sd)
    assert {b.dtype for b in buckets} == {torch.float32, torch.bfloat16, torch.int64}
    assert len(buckets) == 4  # a | b+e | c | d (a filled the first float bucket)
    out = unpack_buckets(layout, buckets)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k].view(-1).view(torch.uint8) if v.dtype != torch.bfloat16 else out[k].float(),
                           v.view(-1).view(torch.uint8) if v.dtype != torch.bfloat16 else v.float())
    assert state_digest(out) == state_digest(sd)


def test_unpack_rejects_malformed_layouts_naming_the_entry() -> None:
    layout, buckets = pack_buckets({"w": torch.ones(4)})
    with pytest.raises(ProtocolError, match="'w' does not fit"):
        unpack_buckets([["w", "f32", [5], 0, 0]], buckets)
    with pytest.raises(ProtocolError, match="bad dtype"):
        unpack_buckets([["w", "complex", [4], 0, 0]], buckets)
    with pytest.raises(ProtocolError, match="malformed"):
        unpack_buckets([["w"]], buckets)


@pytest.fixture(scope="module")
def model():
    cfg = config_from_dict({"model": {"name": "qwenimage", "preset": "tiny"}})
    return build_model(cfg)[0]


def test_store_swaps_only_on_request_and_keeps_the_newest_versions(model) -> None:
    store = WeightStore(model, version=0, keep=3)
    v0 = store.digest()
    new = {k: v + 0.01 * (i + 1) for i, (k, v) in enumerate(trainable_state_dict(model).items())}
    store.stage(1, new)
    assert store.digest() == v0, "staging must not touch the weights a trajectory samples with"
    store.ensure(1)
    assert store.digest() == state_digest(new) != v0
    assert store.loaded == 1 and store.swaps == 1
    for v in (2, 3, 4):
        store.stage(v, new)
    assert store.versions == [1, 2, 3, 4]  # the three newest plus the loaded one
    store.ensure(4)
    store.stage(5, new)
    assert store.versions == [3, 4, 5]
    with pytest.raises(StalenessViolation, match="policy_version 0 is not on this rollout actor"):
        store.ensure(0)
    store.stage(4, trainable_state_dict(model))  # a re-published loaded version is reloaded
    store.stage(4, {k: torch.zeros_like(v) for k, v in new.items()})
    store.ensure(4)
    assert all(float(v.abs().sum()) == 0 for v in trainable_state_dict(model).values())
