"""Sample grids a person can read (issue 37 item 6): a fixed evaluation (same prompts, same noise, the trained
weights' ODE) every ``log.image_every`` versions, captioned, the same picture to TensorBoard and W&B; a run trains
the same numbers with them on or off, in the colocated loop and the actors alike."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from digenrl.config import Config, load_config
from digenrl.models.lora import load_trainable, sampling
from digenrl.policy import build_model
from digenrl.recipes.checkpoint import find_checkpoint
from digenrl.recipes.colocated import train
from digenrl.recipes.disaggregated import arun_disaggregated
from digenrl.rewards import make_reward
from digenrl.roles.evaluation import EVAL_BATCH, evaluation_prompts
from digenrl.rl.noise import initial_latents
from digenrl.telemetry.grid import BACKGROUND

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-qwenimage.toml"
SMALL = ["rollout.prompts_per_batch=2", "rollout.group_size=2", "placement.threads=1", "train.iterations=2",
         "log.checkpoint_every=1", "log.keep_checkpoints=3", "log.images_per_grid=4"]
Run = tuple[Path, list[dict]]  # the colocated run's directory and metrics
TIMING = {"time", "seconds", "samples_per_s", "bubble_ratio", "t_rollout", "t_decode", "t_reward", "t_train"}


def _cfg(schedule: str, *overrides: str) -> Config:
    actors = ["transport.actors=inproc", "schedule.fragment_groups=1", "schedule.train_pack=4"]
    return load_config(TINY, [f"schedule.name={schedule}", *SMALL, *(actors if schedule != "colocated" else []),
                              *overrides])


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


def _grid(out: Path, step: int) -> tuple[np.ndarray, dict]:
    png = out / "samples" / f"step_{step:05d}.png"
    return np.asarray(Image.open(png).convert("RGB")), json.loads(png.with_suffix(".json").read_text())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "trainable.safetensors"))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("grids") / "on"
    return out, train(_cfg("colocated", "log.image_every=1", "log.tensorboard=true"), out_dir=out)


def test_grids_show_the_same_prompts_at_every_step_captioned_at_a_readable_size(colocated: Run) -> None:
    out, _ = colocated
    cfg = _cfg("colocated")
    from digenrl.data.prompts import load_prompts

    asked = evaluation_prompts(load_prompts(cfg.data.prompt_set), cfg.log.seed, 4)
    records = [_grid(out, step)[1] for step in (0, 1, 2)]  # version 0 (the start), each step, the last
    assert sorted(p.name for p in (out / "samples").iterdir()) == [f"step_0000{k}.{e}" for k in range(3) for e in
                                                                    ("json", "png")]
    assert all(r["prompts"] == asked for r in records) and len(set(asked)) == 4
    assert all(r["kind"] == "fixed" and r["solver"] == "euler" and r["steps"] == 3 for r in records)
    png, record = _grid(out, 2)
    assert [t[2:] for t in record["tiles"]] == [[256, 256]] * 4  # 32 px samples, 8x nearest
    assert png.shape[1] == record["size"][0] >= 2 * 256 and png.shape[0] > 2 * 256 + 2 * 40  # two rows + captions
    for (x, y, w, h), below in zip(record["tiles"][:2], record["tiles"][2:], strict=True):
        strip = png[y + h : below[1], x : x + w]  # prompt and reward, written on the background
        assert (np.abs(strip.astype(int) - BACKGROUND).sum(-1) > 100).mean() > 0.02
    assert records[0]["rewards"] != records[2]["rewards"]  # two optimizer steps moved the weights


def test_a_tile_is_the_fixed_sample_of_that_versions_weights(colocated: Run) -> None:
    """Decoded here, independently of the grid: the checkpoint's weights, the tile's own seeded noise, Euler."""
    out, _ = colocated
    cfg = _cfg("colocated")
    model, _ = build_model(cfg)
    load_trainable(model, out / "checkpoints" / "step-000002" / "trainable.safetensors")
    png, record = _grid(out, 2)
    k = 3
    with torch.no_grad(), sampling(model):
        x = initial_latents(model, cfg.log.seed, EVAL_BATCH, [k])
        cond = model.encode_prompts([record["prompts"][k]])
        sig = model.sigmas(cfg.rollout.num_steps)
        for i in range(cfg.rollout.num_steps):
            x = x + (sig[i + 1] - sig[i]) * model.velocity(x, sig[i].expand(1), cond)
        image = model.decode(x)
    pixels = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy().astype(int)
    tx, ty, tw, th = record["tiles"][k]
    tile = png[ty : ty + th, tx : tx + tw].astype(int)
    assert np.abs(tile[::8, ::8] - pixels).max() <= 1  # merged-LoRA rounding at most
    assert record["rewards"][k] == pytest.approx(float(make_reward("shapes").score(image, [record["prompts"][k]])[0]),
                                                 abs=1e-3)


def test_tensorboard_holds_the_grids_at_their_steps(colocated: Run) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = colocated
    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert [e.step for e in events.Images("samples")] == [0, 1, 2]
    means = {e.step: e.value for e in events.Scalars("eval/reward_mean")}
    assert means[2] == pytest.approx(_grid(out, 2)[1]["reward_mean"])
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1]


def test_grids_on_or_off_the_colocated_loop_trains_the_same_bits(colocated: Run, tmp_path: Path) -> None:
    out, history = colocated
    off = train(_cfg("colocated", "log.image_every=0"), out_dir=tmp_path / "off")
    assert _numbers(off) == _numbers(history)
    a, b = _weights(out), _weights(tmp_path / "off")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "off" / "samples").exists()


async def test_an_actor_run_shows_the_colocated_loops_tiles_and_trains_the_same_with_them(colocated: Run,
                                                                                        tmp_path: Path) -> None:
    """Sampled on the trainer (no VAE there under `disaggregated`), decoded and scored on the rollout actor."""
    out, history = colocated
    on = await arun_disaggregated(_cfg("disaggregated", "log.image_every=1"), tmp_path / "on")
    off = await arun_disaggregated(_cfg("disaggregated", "log.image_every=0"), tmp_path / "off")
    assert _numbers(on) == _numbers(off)
    a, b = (load_file(str(find_checkpoint(tmp_path / d) / "trainable.safetensors")) for d in ("on", "off"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for step in (0, 1, 2):
        actors, colocated_png = _grid(tmp_path / "on", step), _grid(out, step)
        assert actors[1]["prompts"] == colocated_png[1]["prompts"]
        assert actors[1]["rewards"] == pytest.approx(colocated_png[1]["rewards"], abs=1e-4)
        # the same picture up to float rounding (another process's kernels: a tile pixel may round the other way)
        assert np.abs(actors[0].astype(int) - colocated_png[0].astype(int)).max() <= 2


def test_rollout_grids_caption_the_steps_own_samples(tmp_path: Path) -> None:
    history = train(_cfg("colocated", "log.image_every=1", "log.samples=rollout", "log.checkpoint_every=0",
                         "train.iterations=1"), out_dir=tmp_path)
    _, record = _grid(tmp_path, 0)
    assert record["kind"] == "rollout" and len(record["prompts"]) == 4  # the batch: 2 prompts x 2
    assert record["prompts"][0] == record["prompts"][1] != record["prompts"][2]  # a row per group
    assert record["reward_mean"] == pytest.approx(history[0]["reward_mean"])


def test_wandb_offline_run_of_a_tiny_run_holds_its_metrics_and_grids(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed (.ci/run installs it)")
    from typer.testing import CliRunner

    from digenrl_cli.main import app
    from tests.telemetry.test_grid import wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network in a test
    with contextlib.suppress(ImportError):  # wandb.init prints a Weave hint where openai is imported (the [judge] extra)
        import openai  # noqa: F401
    out = tmp_path / "run"
    sets = [*SMALL, "schedule.name=colocated", "train.iterations=1", "log.image_every=1", "log.wandb=true",
            "log.wandb_mode=offline", "log.wandb_project=digenrl-test"]
    res = CliRunner().invoke(app, ["run", str(TINY), "--out", str(out), *(a for kv in sets for a in ("--set", kv))])
    assert res.exit_code == 0, res.output
    assert "step 1/1 reward " in res.output and "wandb:" not in res.output  # W&B leaves the run's stdout alone
    rows = wandb_records(out)
    metrics = [r for r in rows if "reward_mean" in r]
    grids = [r for r in rows if r.get("samples/_type") == "image-file"]
    line = json.loads((out / "metrics.jsonl").read_text())
    assert [r["_step"] for r in metrics] == [0] and metrics[0]["reward_mean"] == pytest.approx(line["reward_mean"])
    assert [r["_step"] for r in grids] == [0, 1]
    assert grids[1]["eval/reward_mean"] == pytest.approx(_grid(out, 1)[1]["reward_mean"])
    media = sorted((next((out / "wandb").glob("offline-run-*")) / "files" / "media" / "images").glob("samples_*.png"))
    assert len(media) == 2 and Image.open(media[-1]).size == tuple(_grid(out, 1)[1]["size"])
