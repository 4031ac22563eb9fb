"""Sample grids a person can read (digenrl/telemetry/grid.py), their TensorBoard image and the W&B run."""

from __future__ import annotations

import glob
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from digenrl.errors import ConfigError
from digenrl.telemetry.grid import BACKGROUND, GAP, render_grid, tile_size
from digenrl.telemetry.metrics import MetricsLog

PROMPTS = ["a red circle on a blue background", "a green triangle on a yellow background"]


def _images(n: int, size: int = 32) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(0))


def test_tiles_are_the_samples_enlarged_and_captioned_with_prompt_and_reward(tmp_path: Path) -> None:
    images = _images(4)
    grid = render_grid(images, PROMPTS * 2, [0.78412, 0.1, 0.5, None], columns=2, tile_px=256, title="step 3")
    grid.save(tmp_path / "step_00003.png")
    png = np.asarray(Image.open(tmp_path / "step_00003.png").convert("RGB"))
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    record = json.loads((tmp_path / "step_00003.json").read_text())
    assert record["size"] == [png.shape[1], png.shape[0]] and record["prompts"] == PROMPTS * 2
    assert record["rewards"] == [0.78412, 0.1, 0.5, None] and record["reward_mean"] == pytest.approx(1.38412 / 3)
    (x, y, w, h), (_, y2, _, _) = record["tiles"][0], record["tiles"][2]
    assert (w, h) == (256, 256) and png.shape[1] == 2 * (256 + GAP) + GAP  # 32 px x 8, two columns
    for k, (tx, ty, tw, th) in enumerate(record["tiles"]):
        tile = png[ty : ty + th, tx : tx + tw]
        assert np.array_equal(tile, np.repeat(np.repeat(pixels[k], 8, axis=0), 8, axis=1))  # nearest, 8x8 blocks
    strip = png[y + h : y2 - GAP, x : x + w]  # the caption strip under tile 0: text on the background
    assert strip.shape[0] >= 3 * 12 and (np.abs(strip.astype(int) - BACKGROUND).sum(-1) > 100).mean() > 0.02
    assert (png[: y - GAP] != BACKGROUND).any()  # the title


def test_a_long_prompt_is_wrapped_and_cut_and_a_large_image_is_reduced() -> None:
    long = "a " + " ".join(["very"] * 60) + " long prompt"
    grid = render_grid(_images(2, 600), [long, "x"], [0.5, 0.25], tile_px=200)
    assert tile_size(600, 600, 200) == (200, 200, 0) and tile_size(32, 48, 256) == (160, 240, 5)
    assert [t[2:] for t in grid.tiles] == [[200, 200], [200, 200]]
    from digenrl.telemetry.grid import PROMPT_LINES, _font, _wrap
    from PIL import ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines = _wrap(long, _font(13), 194, draw, PROMPT_LINES)
    assert len(lines) == PROMPT_LINES and lines[-1].endswith("...")


def test_tensorboard_gets_the_grid_as_an_image_and_its_reward(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid = render_grid(_images(2), PROMPTS, [0.5, 0.25], tile_px=64)
    log = MetricsLog(tmp_path, tensorboard=True)
    log.image("samples", grid.array(), 4, "step 4", {"eval/reward_mean": 0.375})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert "samples" in events.Tags()["images"]
    (event,) = events.Images("samples")
    assert event.step == 4 and (event.width, event.height) == grid.image.size
    import io

    assert np.array_equal(np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")), grid.array())
    assert [(e.step, e.value) for e in events.Scalars("eval/reward_mean")] == [(4, 0.375)]


def wandb_records(out: Path) -> list[dict[str, Any]]:
    """The history rows of the offline W&B run under ``out/wandb`` (its ``run-*.wandb`` file: W&B's record log,
    32 KiB blocks of ``crc32 | length | type`` framed protobuf ``Record``s after a 7-byte header)."""
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(100):  # W&B's service writes the file: wait for its last record (WandbLog.close waits too)
        rows, done = _records(Path(path).read_bytes())
        if done:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"{path} has no exit record after 20 s")


def _records(data: bytes) -> tuple[list[dict[str, Any]], bool]:
    from wandb.proto import wandb_internal_pb2 as pb

    assert data[:4] == b":W&B"
    done = False
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
            done = done or record.WhichOneof("record_type") == "exit"
    return rows, done


def test_wandb_offline_run_holds_the_metrics_and_the_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed (.ci/run installs it)")
    from digenrl.telemetry.wandb_log import WandbLog

    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network in a test
    run = WandbLog(tmp_path, {"log": {"seed": 0}}, project="digenrl-test", mode="offline")
    log = MetricsLog(tmp_path, history=[], wandb=run)
    log.write({"step": 0, "reward_mean": 0.25, "bubble_ratio": {"overall": 0.5}, "parity_ratio": None})
    log.image("samples", render_grid(_images(2), PROMPTS, [0.5, 0.25], tile_px=64).array(), 1, "step 1",
              {"eval/reward_mean": 0.375})
    log.close()
    rows = wandb_records(tmp_path)
    assert rows[0]["_step"] == 0 and rows[0]["reward_mean"] == 0.25 and rows[0]["bubble_ratio/overall"] == 0.5
    assert rows[1]["_step"] == 1 and rows[1]["eval/reward_mean"] == 0.375 and rows[1]["samples/_type"] == "image-file"
    (media,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / rows[1]["samples/path"]))
    assert Image.open(media).size == (rows[1]["samples/width"], rows[1]["samples/height"])


def test_wandb_mode_auto_stays_offline_without_a_login_and_asks_no_server(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from digenrl.telemetry import wandb_log

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setattr(wandb_log, "_reachable", lambda *a, **k: pytest.fail("contacted a server"))
    mode, why = wandb_log.resolve_mode("auto")
    assert mode == "offline" and "not logged in" in why
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_log.resolve_mode("auto")[0] == "offline" and wandb_log.resolve_mode("online")[0] == "online"


def test_a_missing_wandb_is_one_line_naming_the_key_and_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from digenrl.config import config_from_dict
    from digenrl.recipes.preflight import check_logging, validation

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without the extra sees
    cfg = config_from_dict({"log": {"wandb": True}})
    with pytest.raises(ConfigError) as err:
        check_logging(cfg)
    assert "log.wandb" in str(err.value) and "pip install 'digenrl[wandb]'" in str(err.value)
    assert "\n" not in str(err.value)
    assert any("log.wandb" in p for p in validation(cfg).problems)
    with pytest.raises(ConfigError, match=r"log.wandb = true needs the wandb package"):
        MetricsLog.for_run(cfg.log, cfg.to_dict(), tmp_path)
    check_logging(config_from_dict({}))  # off: nothing to find
