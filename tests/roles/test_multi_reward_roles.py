"""``reward.normalize = "per_reward"`` with two rewards: the colocated loop and on-policy actors (GAP, one-sample
fragments scored apart, per-reward scores assembled by the coordinator) take the same advantages and step."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio
import torch

from digenrl.actors import ActorSystem
from digenrl.config import config_from_dict
from digenrl.data.prompts import load_prompts
from digenrl.recipes.disaggregated import start_cluster, tiny_cpu_cost
from digenrl.rl.advantages import reward_advantages
from digenrl.roles.coordinator import Coordinator

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONF = {
    "model": {"name": "qwenimage", "preset": "tiny"},
    "rollout": {"num_steps": 4, "group_size": 2, "prompts_per_batch": 4},
    "train": {"iterations": 1, "lr": 1e-2, "clip_range": 1e-2, "adv_std": "group"},
    "reward": {"weights": {"color": 1.0, "jpeg_compressibility": 0.5}, "normalize": "per_reward"},
    "log": {"seed": 3},
    "schedule": {"name": "gap"},
    "transport": {"actors": "inproc"},
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    cfg = config_from_dict(CONF)
    async with ActorSystem(transport="inproc") as system:
        yield cfg, await start_cluster(system, cfg)


class _KeepsScores(Coordinator):
    """The coordinator, keeping the scores and advantages of its one batch (its books are dropped at the step)."""

    scores: tuple[list[float], dict[str, list[float]]]
    advantages: torch.Tensor

    def _step_metrics(self, batch: int, book: Any, optim: dict[str, Any]) -> dict[str, Any]:
        ids = sorted(book.rewards)
        self.scores = ([book.rewards[i] for i in ids], {n: [v[i] for i in ids] for n, v in book.components.items()})
        self.advantages = torch.tensor([book.adv[i][0] for i in ids])
        return super()._step_metrics(batch, book, optim)


def _advantages(cfg: Any, scores: tuple[list[float], dict[str, list[float]]]) -> Any:
    """What reward.normalize = "per_reward" makes of a batch's scores (the one function both paths call)."""
    r, g = cfg.reward, cfg.rollout
    groups = torch.arange(g.prompts_per_batch).repeat_interleave(g.group_size)
    return reward_advantages(torch.tensor(scores[0], dtype=torch.float64), groups,
                             components={n: torch.tensor(v, dtype=torch.float64) for n, v in scores[1].items()},
                             weights=r.weights, normalize=r.normalize, penalty=r.penalty, std=cfg.train.adv_std,
                             clip=cfg.train.adv_clip)


async def test_colocated_loop_and_actors_take_the_same_per_reward_advantages(cluster) -> None:
    from digenrl.data.images import reward_inputs
    from digenrl.recipes.colocated import iteration, setup
    from digenrl.roles.fragments import FragmentEngine, probe_velocity

    cfg, c = cluster
    coord = _KeepsScores(cfg, "gap", c.devices, c.refs, load_prompts("color"),
                         options={"fragment_groups": 1, "fragment_members": 1}, cost=tiny_cpu_cost(),
                         is_dead=c.is_dead)
    actors = (await coord.run())[0]
    run = setup(cfg)
    before = probe_velocity(FragmentEngine(cfg, run.model), 0)
    local, images, prompts = iteration(run, 0)
    texts, sources = reward_inputs(prompts, images, run.reward.uses_sources)  # the loop's scores, once more
    scored = run.reward.score(images, texts, sources=sources).tolist()
    loop = (scored, {n: s.tolist() for n, s in run.reward.inner.last_components.items()})
    assert {"reward/color", "reward/jpeg_compressibility"} <= set(actors) & set(local)
    # The same advantages: each path takes reward_advantages of its scores, the coordinator from one-sample
    # fragments assembled in arrival order, the loop from the whole batch at once.
    assert torch.equal(coord.advantages, _advantages(cfg, coord.scores).advantages)
    assert local["adv_abs_mean"] == _advantages(cfg, loop).stats["adv_abs_mean"]
    # The same scores, to what fp32 promises: the loop decodes one batch of 8 samples and the actors 8 batches of
    # one, through GEMMs of other shapes, whose sums round differently on each CPU's kernels (a few ulps). The JPEG
    # size counts whole bytes of uint8 pixels, 2e-6 of reward each: a pixel rounded the other way moves it a few.
    torch.testing.assert_close(torch.tensor(loop[1]["color"]), torch.tensor(coord.scores[1]["color"]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(loop[1]["jpeg_compressibility"]),
                               torch.tensor(coord.scores[1]["jpeg_compressibility"]), atol=1e-5, rtol=0)
    for key in ("reward_mean", "reward_std", "zero_std_ratio"):  # each sample's weighted sum: 1e-6 + 0.5 * 1e-5
        assert local[key] == pytest.approx(actors[key], abs=6e-6), key
    # Not adv_abs_mean across the paths at 1e-6: in a two-sample group whose scores lie 2d apart, A = d / (|d| + eps)
    # moves eps / (|d| + eps)^2 times as far as d does: 600x in this batch's colour group 3 (d = 1.9e-4), so two ulps
    # of colour made 0.8059463 vs 0.8059377 on an AVX2 CPU (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    # MKL_ENABLE_INSTRUCTIONS=AVX2 gives exactly those on an AVX-512 one), and one JPEG byte in a group spread less
    # than eps moves it 4e-3 (ONEDNN_MAX_CPU_ISA=AVX MKL_ENABLE_INSTRUCTIONS=AVX). It follows from the scores.
    # Two per-reward advantages: |A| is not 1 as one standardised reward of a two-sample group would give.
    assert local["adv_abs_mean"] != pytest.approx(1.0, abs=1e-3)
    # The step is linear in the advantages (ratio 1, no KL yet): the two steps lie apart about as far, relative, as
    # the advantages the two paths took (up to 2% where a JPEG byte moved, as above; 0 where the scores agree).
    moved = float((_advantages(cfg, loop).advantages - coord.advantages).abs().max()) / local["adv_abs_mean"]
    assert local["grad_norm"] > 0
    assert local["grad_norm"] == pytest.approx(actors["grad_norm"], rel=1e-4 + 4 * moved)
    stepped = probe_velocity(FragmentEngine(cfg, run.model), 0)
    apart = float((await c.refs["trainer-0"].probe_velocity.call() - stepped).norm())
    assert apart <= (1e-4 + 4 * moved) * float((stepped - before).norm())
