"""Far pools in `plan --fleet`: refused, limited or used, with the figures; a link's prediction for the tiny run."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.models.lora import trainable_state_dict
from digenrl.plan.fleet import plan_fleet
from digenrl.plan.links import _auto_note, admit_far_pool, config_link_bytes, config_transfer, predict_far_rollout
from digenrl.policy import build_model
from digenrl.sim.link_traffic import LinkBytes
from digenrl.sim.links import Link
from digenrl.sim.measured import MeasuredCost
from digenrl.sim.user import Pool, fleet_pools

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_FULL = LinkBytes(publication=23.8e9, row=0.0, sample=4e6, latent=2e5, gradient=0.0)


def test_a_far_pool_that_cannot_receive_a_version_within_a_step_is_refused() -> None:
    pool = Pool("L40S", 16, link=Link(100e6))
    n, line = admit_far_pool(pool, _FULL, step_s=65.0, sample_s=1.0, what="full weights, bfloat16")
    assert n == 0
    # 23.8 GB x 8 / 100 Mbit/s = 1904 s against a 65 s step
    assert line.startswith("16xL40S@100mbit refused") and "23.8 GB" in line and "1.9e+03 s" in line
    assert "65 s" in line and f"{65.0 * 12.5e6 / 23.8e9:.2g} of those bytes" in line


def test_a_far_pool_is_limited_to_the_samples_its_link_carries_back() -> None:
    # 1 Gbit/s carries 125 MB/s x 60 s = 7.5 GB a step; a device makes 60 samples of 4 MB = 240 MB: 31 of them
    pool = Pool("L40S", 40, link=Link(1e9))
    small = LinkBytes(publication=0.85e9, row=0.0, sample=4e6, latent=2e5, gradient=0.0)
    n, line = admit_far_pool(pool, small, step_s=60.0, sample_s=1.0, what="LoRA adapter, bfloat16")
    assert n == 31 and "limited to 31 of 40" in line and "0.24 GB a step" in line
    n, line = admit_far_pool(Pool("L40S", 16, link=Link(1e9)), small, step_s=60.0, sample_s=1.0, what="LoRA")
    assert n == 16 and "admitted" in line and "6.8 s over 1gbit" in line


def _flux_full():
    return load_config(CONFIGS / "flux.toml", ['model.finetune="full"'])


@pytest.mark.slow
def test_plan_refuses_a_far_pool_behind_100mbit_for_full_fine_tuning() -> None:
    result = plan_fleet(_flux_full(), fleet_pools("16xH100+16xL40S@100mbit"), top=1, batches=3, final_batches=4)
    assert all(sum(n for t, n in c.rollout.items() if t == "L40S") == 0 for c in result.candidates)
    refused = [u for u in result.unused if u.startswith("16xL40S@100mbit refused")]
    assert refused and "23.8 GB (full weights, bfloat16)" in refused[0] and "over 100mbit" in refused[0]


@pytest.mark.slow
def test_plan_uses_a_far_pool_behind_10gbit_and_says_what_the_link_costs() -> None:
    result = plan_fleet(_flux_full(), fleet_pools("16xH100+16xL40S@10gbit"), top=1, batches=3, final_batches=4)
    best = result.best
    assert best.rollout.get("L40S") == 16 and "L40S" not in best.trainer
    assert best.links["L40S"]["publication_s"] == pytest.approx(23.8e9 * 8 / 10e9, rel=0.01)
    notes = " ".join(result.notes)
    assert "16xL40S@10gbit admitted" in notes and "the far pools are worth it" in notes and "L40S link 10gbit" in notes


def test_predict_far_rollout_for_the_tiny_default() -> None:
    cfg = load_config(CONFIGS / "tiny-qwenimage.toml", ['model.init=""'])
    model, _ = build_model(cfg)
    published = sum(t.numel() * t.element_size() for t in trainable_state_dict(model).values())  # what is sent
    fits = {"rollout": (2e-3, 1e-4), "reward": (1e-3, 1e-5), "train": (2e-3, 3e-4), "optim": (5e-3, 0.0),
            "publish": (2e-3, 0.0)}
    costs = MeasuredCost(fits)
    slow, fast = (predict_far_rollout(cfg, bps, latency_s=0.001, costs=costs, batches=5) for bps in (1e6, 500e6))
    assert slow["publication_bytes"] == published
    assert slow["publication_s"] == pytest.approx(published * 8 / 1e6 + 0.001)
    assert fast["publication_s"] == pytest.approx(published * 8 / 500e6 + 0.001)
    # the lead trainer's PUBLISH holds it for its own 2 ms, the crossing and the reply's 1 ms back (more when an
    # upload was ahead of the reply); so no far rollout ever waits for its version
    for got in (slow, fast):
        assert got["publish_s"] >= 2e-3 + got["publication_s"] + 0.001 - 1e-9
        assert got["far_wait_per_step_s"] == 0.0
    # a far REWARD scores its fragment (1 ms + 10 us a sample), uploads it to the trainer's store and awaits the
    # reply: the median one has no publication ahead of its reply
    samples = cfg.schedule.fragment_groups * cfg.rollout.group_size  # a fragment's
    upload = samples * fast["sample_bytes"] * 8 / 500e6 + 0.001
    assert fast["reward_s"] == pytest.approx(1e-3 + 1e-5 * samples + upload + 0.001, rel=1e-6)
    # at 1 Mbit/s the far pool's uploads (4.3 MB a step) fill the link: the step is the link's, not the compute's
    assert slow["step_s"] > 10 * slow["step_s_unlinked"] and slow["step_s"] > 10 * slow["publication_s"]
    assert fast["step_s_unlinked"] < fast["step_s"] < slow["step_s"]


def test_the_planner_prices_a_publication_as_the_run_sends_it() -> None:
    tiny = CONFIGS / "tiny-qwenimage.toml"
    plain = load_config(tiny, ['model.init=""'])
    full = config_link_bytes(plain).publication
    assert config_transfer(plain) is None  # weights_compression = auto, no slow link: sent in full
    fast = load_config(tiny, ['model.init=""', "transport.rollout_link_gbit=1"])  # auto: int8 from 1 Gbit/s
    sent = config_transfer(fast)
    assert sent is not None and sent.name == "int8"
    assert sent.ratio == pytest.approx((1 + 4 / 4096) / 4)  # fp32 weights: a byte each, a float32 scale per 4096
    assert predict_far_rollout(fast, 1e9)["publication_bytes"] == pytest.approx(full * sent.ratio)
    slow = config_transfer(load_config(tiny, ['model.init=""', "transport.rollout_link_gbit=0.5"]))
    assert slow is not None and slow.name == "topk" and slow.ratio == pytest.approx(0.01 * (5 + 4 / 4096) / 4)
    # a far pool the config's rollout_link_gbit does not know of: priced in full, and the note says what to set
    note = _auto_note(plain, [Pool("L40S", 16, link=Link(1e9))])
    assert note is not None and "(none)" in note and "--set transport.rollout_link_gbit=1 " in note
    assert "int8 deltas (0.25 of the bytes)" in note
    assert _auto_note(fast, [Pool("L40S", 16, link=Link(2e9))]) is None  # both int8
