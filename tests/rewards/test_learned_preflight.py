"""A learned reward that cannot be built here is refused by ``digenrl validate`` (and ``digenrl run``, with the
same line, before anything starts) in one line naming its key: a missing or wrong path, a file of another
architecture, a missing extra, a CUDA ``reward.device`` without a GPU. The checks read config.json and
state-dict headers, never the weights."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _learned_fixtures import open_clip_or_skip, tiny_clip_dir, tiny_hps, tiny_mlp_file, tiny_other_model_dir
from digenrl.config import config_from_dict
from digenrl.errors import ConfigError
from digenrl_cli.main import app

CONFIG = "configs/tiny-qwenimage.toml"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("learned")
    tiny_clip_dir(root / "clip")
    tiny_clip_dir(root / "pickscore", processor=False)
    tiny_other_model_dir(root / "vision-only")
    tiny_mlp_file(root / "mlp.pt")
    tiny_mlp_file(root / "mlp-512.safetensors", input_size=512)
    torch.save({"weight": torch.zeros(3, 768)}, root / "not-the-mlp.pt")
    (root / "notes.txt").write_text("not a state dict")
    return root


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _line(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


# case -> (the --set items for the files' root, the start of the one line after "config error: ")
REFUSED: dict[str, tuple[Callable[[Path], list[str]], Callable[[Path], str]]] = {
    "path-missing": (
        lambda d: ["reward.weights={clipscore = 1.0}"],
        lambda d: "reward.models.clipscore.path: the 'clipscore' reward needs it: a local directory holding a "
                  "transformers CLIPModel"),
    "path-nowhere": (
        lambda d: ["reward.weights={clipscore = 1.0}", f"reward.models.clipscore.path='{d / 'nowhere'}'"],
        lambda d: f"reward.models.clipscore.path: '{d / 'nowhere'}' does not exist; it must be a directory on this "
                  "host (weights load from local paths only, never from a hub); download openai/clip-vit-large-patch14"),
    "path-a-file": (
        lambda d: ["reward.weights={clipscore = 1.0}", f"reward.models.clipscore.path='{d / 'mlp.pt'}'"],
        lambda d: f"reward.models.clipscore.path: '{d / 'mlp.pt'}' is not a directory"),
    "another-architecture": (
        lambda d: ["reward.weights={clipscore = 1.0}", f"reward.models.clipscore.path='{d / 'vision-only'}'"],
        lambda d: f"reward.models.clipscore.path: '{d / 'vision-only'}' holds a 'clip_vision_model' model "
                  "(['CLIPVisionModelWithProjection']), not a CLIPModel (model_type 'clip')"),
    "pickscore-without-processor": (
        lambda d: ["reward.weights={pickscore = 1.0}", f"reward.models.pickscore.path='{d / 'pickscore'}'"],
        lambda d: f"reward.models.pickscore.path: '{d / 'pickscore'}' holds no preprocessor_config.json (the CLIP "
                  "image processor); PickScore_v1 ships no processor: set processor_path to a download of "
                  "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
    "mlp-of-another-width": (
        lambda d: ["reward.weights={aesthetic = 1.0}", f"reward.models.aesthetic.path='{d / 'mlp-512.safetensors'}'",
                   f"reward.models.aesthetic.clip_path='{d / 'clip'}'"],
        lambda d: f"reward.models.aesthetic.path: '{d / 'mlp-512.safetensors'}' is not the LAION aesthetic MLP over a "
                  "24-wide CLIP embedding (clip_path's projection_dim): layers.0.weight is [1024, 512], expected [1024, 24]"),
    "mlp-of-another-module": (
        lambda d: ["reward.weights={aesthetic = 1.0}", f"reward.models.aesthetic.path='{d / 'not-the-mlp.pt'}'",
                   f"reward.models.aesthetic.clip_path='{d / 'clip'}'"],
        lambda d: f"reward.models.aesthetic.path: '{d / 'not-the-mlp.pt'}' is not the LAION aesthetic MLP over a "
                  "24-wide CLIP embedding (clip_path's projection_dim): missing ['layers.0.bias', 'layers.0.weight', "),
    "mlp-not-a-state-dict": (
        lambda d: ["reward.weights={aesthetic = 1.0}", f"reward.models.aesthetic.path='{d / 'notes.txt'}'",
                   f"reward.models.aesthetic.clip_path='{d / 'clip'}'"],
        lambda d: f"reward.models.aesthetic.path: cannot read '{d / 'notes.txt'}' as a state dict:"),
    "hpsv2-without-the-extra": (
        lambda d: ["reward.weights={hpsv2 = 1.0}", f"reward.models.hpsv2.path='{d / 'mlp.pt'}'"],
        lambda d: "reward.weights.hpsv2: the 'hpsv2' reward needs open_clip, which is not installed; install it with "
                  "`pip install 'digenrl[rewards]'` (open-clip-torch, ftfy)"),
    "unknown-key": (
        lambda d: ["reward.weights={shapes = 1.0}", "reward.models.clipscore.paht='/models/clip'"],
        lambda d: "reward.models.clipscore.paht: unknown key; allowed in [reward.models.clipscore]: path, "
                  "processor_path, batch_size"),
    "a-table-for-a-reward-without-one": (
        lambda d: ["reward.models.shapes.path='/x'"],
        lambda d: "reward.models.shapes: the 'shapes' reward takes no settings, got {'path': '/x'}"),
    "unknown-reward": (
        lambda d: ["reward.models.imagereward.path='/x'"],
        lambda d: "reward.models.imagereward: unknown reward 'imagereward'; allowed: jpeg_compressibility,"),
    "dtype": (
        lambda d: ["reward.dtype=fp16"],
        lambda d: "reward.dtype: 'fp16' is not allowed; allowed: '', 'float32', 'bfloat16', 'float16'"),
}
RUN_TOO = {"path-nowhere", "another-architecture", "mlp-of-another-width", "hpsv2-without-the-extra"}


@pytest.mark.parametrize("case", list(REFUSED))
def test_validate_names_the_key_in_one_line(case: str, files: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "hpsv2-without-the-extra":
        monkeypatch.setitem(sys.modules, "open_clip", None)  # as if the [rewards] extra were not installed
    sets, expected = REFUSED[case]
    args = [CONFIG, *_sets(*sets(files))]
    code, line = _line(["validate", *args])
    assert code == 2, line
    assert line.startswith(f"config error: {expected(files)}"), line
    if case in RUN_TOO:  # run refuses with the same line, before it writes or starts anything
        run_code, run_line = _line(["run", "--out", str(tmp_path / "run"), *args])
        assert (run_code, run_line) == (code, line)
        assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host's message")
def test_a_cuda_reward_device_needs_a_gpu_here() -> None:
    code, line = _line(["validate", CONFIG, *_sets("reward.device=cuda:1")])
    assert code == 2
    assert line.startswith("config error: reward.device = 'cuda:1', but this host has no CUDA device; use 'cpu' or '' "
                           "(the actor's model.device, 'cpu')")


def test_validate_passes_the_learned_rewards_it_can_build(files: Path) -> None:
    sets = ["reward.weights={clipscore = 1.0, pickscore = 0.5, aesthetic = 0.1}",
            f"reward.models.clipscore.path='{files / 'clip'}'",
            f"reward.models.pickscore={{path = '{files / 'pickscore'}', processor_path = '{files / 'clip'}'}}",
            f"reward.models.aesthetic={{path = '{files / 'mlp.pt'}', clip_path = '{files / 'clip'}', batch_size = 8}}",
            "reward.device=cpu", "reward.dtype=float32"]
    code, line = _line(["validate", CONFIG, *_sets(*sets)])
    assert code == 0, line
    assert "ok" in line


def test_hpsv2_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    open_clip_or_skip()
    arch, ckpt = tiny_hps(tmp_path)
    code, line = _line(["validate", CONFIG, *_sets("reward.weights={hpsv2 = 1.0}", f"reward.models.hpsv2.path='{ckpt}'",
                                                   f"reward.models.hpsv2.model={arch}")])
    assert code == 0, line
    code, line = _line(["validate", CONFIG, *_sets("reward.weights={hpsv2 = 1.0}", f"reward.models.hpsv2.path='{ckpt}'")])
    assert code == 2
    assert line.startswith(f"config error: reward.models.hpsv2.path: '{ckpt}' is not a checkpoint of the open_clip "
                           "ViT-H-14 (reward.models.hpsv2.model): "), line


def test_the_config_carries_plain_tables_to_build_reward(files: Path) -> None:
    """RewardConfig.build_options: the tables as plain dicts, reward.device resolved against model.device."""
    cfg = config_from_dict({"reward": {"weights": {"clipscore": 1.0},
                                       "models": {"clipscore": {"path": str(files / "clip")}}}})
    opts = cfg.reward.build_options("cuda:0")
    assert opts["models"] == {"clipscore": {"path": str(files / "clip")}}
    assert (opts["device"], opts["dtype"]) == ("cuda:0", "")
    cfg = config_from_dict({"reward": {"weights": {"color": 1.0}, "device": "cpu"}})
    assert cfg.reward.build_options("cuda:0")["device"] == "cpu"
    with pytest.raises(ConfigError, match="reward.device: must be '' .*got 'gpu'"):
        config_from_dict({"reward": {"device": "gpu"}})
