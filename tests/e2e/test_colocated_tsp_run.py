"""`schedule.name = "colocated-tsp"`: the colocated schedule on hybrid trainer actors (each samples, scores and
trains, TSP-packed), run for real on the tiny default, trains as the single-process colocated loop does."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config import load_config
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import run_disaggregated

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"


@pytest.mark.slow  # 50 s on this loaded 2-core host (two runs of two steps)
def test_colocated_tsp_actors_train_as_the_colocated_loop() -> None:
    """Two steps of the tiny default at 8 prompts x 8 a batch, in two fragments of 4 prompts and training tokens of
    32 rows: the same samples (per-sample noise), rewards and update as the loop's whole-batch passes, up to the
    float rounding of other batch sizes."""
    base = ["train.iterations=2", "log.live=false", "rollout.prompts_per_batch=8", "schedule.fragment_groups=4",
            "schedule.train_pack=32"]
    actors = run_disaggregated(load_config(TINY, [*base, "schedule.name='colocated-tsp'", "placement.rollout=0",
                                                  "transport.actors='inproc'"]), write_files=False)
    loop = train(load_config(TINY, [*base, "schedule.name='colocated'"]), write_files=False)
    assert [m["step"] for m in actors] == [0, 1]
    for a, b in zip(actors, loop, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)  # step 1: after the update
        assert a["reward_std"] == pytest.approx(b["reward_std"], abs=1e-6)
        assert a["rows_trained"] == b["rows_trained"] == 8 * 8 * 1 and a["max_staleness"] == 0
        assert a["grad_norm"] > 0 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-9)
        assert a["adv_abs_mean"] == pytest.approx(b["adv_abs_mean"], abs=1e-6)
    # the one hybrid device alternates phases: both appear in its bubble accounting
    assert set(actors[0]["bubble_ratio"]) >= {"trainer-0", "overall"}
