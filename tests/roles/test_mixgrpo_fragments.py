"""MixGRPO on the fragment engine: the version that samples a fragment decides its window, the Flash tail's solver
state travels with a fragment handed over mid-way, and a fragment re-run from noise is bit for bit the same."""

from __future__ import annotations

import pytest
import torch

from digenrl.config import config_from_dict
from digenrl.policy import build_model
from digenrl.rl.flash import run_tail
from digenrl.rl.rollout import rollout_steps
from digenrl.rl.noise import transition_noise
from digenrl.roles.fragments import FragmentData, FragmentEngine

PROMPTS = ["a red square", "a blue circle", "a green square", "a white circle"]
GEO = [3, 0, 1, 3, 0, 2, 2]  # batch 3, fragment 0: prompts 1-2, both members of each group


def _cfg(flash: bool):
    return config_from_dict({"model": {"name": "qwenimage", "preset": "tiny", "text_len": 32},
                             "rollout": {"num_steps": 8, "group_size": 2, "prompts_per_batch": 4},
                             "train": {"algorithm": "mixgrpo"},
                             "mixgrpo": {"window": 2, "shift_every": 3, "flash": flash}})


@pytest.fixture(scope="module", params=[False, True], ids=["mixgrpo", "flash"])
def engines(request):
    cfg = _cfg(request.param)
    return cfg, FragmentEngine(cfg, build_model(cfg)[0]), FragmentEngine(cfg, build_model(cfg)[0])


@pytest.mark.parametrize("version", [0, 4, 11, 15])
def test_a_fragment_trains_its_versions_window(engines, version: int) -> None:
    cfg, a, _ = engines
    frag = a.fresh(GEO, version, PROMPTS)
    a.advance([frag], 0, 8)
    start = {0: 0, 4: 1, 11: 3, 15: 0}[version]  # every 3 versions one step on, starts 0..N-2-W = 0..4, then 0
    t = frag.transitions()
    assert t["step"].tolist() == [start, start + 1] * 4 and t["sample"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(t["sigma"][:2], a.sigmas[start:start + 2].float())
    assert frag.x0 is None  # nothing of the solver's state leaves with a finished fragment


def test_handed_over_in_the_window_and_in_the_tail_is_bit_exact(engines) -> None:
    cfg, a, b = engines
    whole = a.fresh(GEO, 6, PROMPTS)  # start 2: SDE at steps 2-3, the tail from step 4
    a.advance([whole], 0, 8)
    for cut in (3, 4, 5):
        part = a.fresh(GEO, 6, PROMPTS)
        a.advance([part], 0, cut)
        moved = FragmentData.from_wire(part.to_wire())
        assert (moved.x0 is not None) == (cfg.mixgrpo.flash and cut >= 4)
        b.advance([moved], cut, 8)
        assert torch.equal(whole.x, moved.x), cut
        tw, tm = whole.transitions(), moved.transitions()
        assert all(torch.equal(tw[k], tm[k]) for k in tw)
    again = a.recompute(GEO, 6, PROMPTS, 5)  # its holder died mid-way: the same fragment from noise
    a.advance([again], 5, 8)
    assert torch.equal(again.x, whole.x)


def test_the_engine_samples_what_the_colocated_loop_samples(engines) -> None:
    """The recipe's path (``rollout_steps`` up to the tail, then ``run_tail``) on the same per-sample noise."""
    cfg, a, _ = engines
    algo, frag = a.algorithm, a.fresh(GEO, 6, PROMPTS)
    x, ids = frag.x.clone(), frag.sample_ids()
    plan = algo.step_plan(frag.prompt_ids(), ids, cfg.log.seed * 1_000_003 + GEO[0], 6)
    tail = algo.ode_tail(6)
    with algo.sampling():
        res = rollout_steps(a.model.velocity, x, frag.cond, a.sigmas, plan, 0, 8 if tail is None else tail[0],
                            noise_level=cfg.rollout.noise_level,
                            noise=lambda i: transition_noise(cfg.log.seed, GEO[0], ids, i, x, active=plan.stochastic[:, i]))
        clean = res.x if tail is None else run_tail(a.model.velocity, res.x, frag.cond, tail[1], res.x0, tail[0], 8)[0]
    a.advance([frag], 0, 8)
    assert torch.allclose(frag.x, clean, atol=1e-5)  # (the engine merges LoRA for sampling: last-bit differences)
    assert torch.equal(frag.transitions()["step"], res.transitions.step[torch.argsort(res.transitions.sample, stable=True)])
    if tail is not None:  # Flash: 4 + max(int(5 x 0.4), 2) - 1 = 5 forwards instead of 8
        assert tail[0] == 4 and tail[1].shape[0] == 6 and algo.window.forwards(6) == 5
