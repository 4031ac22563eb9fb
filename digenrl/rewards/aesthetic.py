"""The LAION aesthetic score: the improved aesthetic predictor's MLP over CLIP ViT-L/14 image embeddings.

The published predictor (christophschuhmann/improved-aesthetic-predictor, weights
``sac+logos+ava1-l14-linearMSE.pth``) is an MLP without activations, ``768 -> 1024 -> 128 -> 64 -> 16 -> 1``
with dropout, over the L2-normalised image embedding of OpenAI's CLIP ViT-L/14; it predicts the mean
human rating on a 1-10 scale (typical images score 4-7). :class:`AestheticMlp` is that module
(``nn.Sequential`` named ``layers``, in the published order), so the published state dict loads by
key, strictly; its first layer takes the CLIP's ``projection_dim`` (768 for ViT-L/14; the tests use a
tiny CLIP). The embedding comes from a transformers ``CLIPModel`` directory (``openai/clip-vit-large-patch14``,
the same weights as OpenAI's package) through ``get_image_features``, preprocessed as its image
processor does (in torch, :class:`~digenrl.rewards._learned.ClipPixels`).

Two paths: ``[reward.models.aesthetic] path`` is the MLP's state dict (``.safetensors``, or ``.pt`` /
``.pth`` read with ``torch.load(weights_only=True)``), ``clip_path`` the CLIP directory; ``batch_size``
(default 32) frames per forward. The CLIP runs on ``reward.device`` in ``reward.dtype``, the MLP in fp32
there. Videos score the mean over frames. The prompt is not used.

Not yet run on a GPU or at real size: CUDA placement is tested through its meta-device twin, bf16 not at all
(tests/rewards/test_learned.py runs tiny fp32 instances on the CPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from digenrl.errors import ConfigError
from digenrl.rewards._learned import (ClipPixels, TableSpec, check_table, clip_config, features_of, hf_weights_present,
                                      load_clip_model, load_state_dict_file, processor_files, resolve_dtype,
                                      score_batches, state_dict_shapes, table_path)
from digenrl.rewards.base import check_batch

__all__ = ["AestheticMlp", "AestheticReward", "AESTHETIC_TABLE", "aesthetic", "check_aesthetic", "mlp_shapes"]

AESTHETIC_TABLE = TableSpec(
    keys={
        "path": (str, "the LAION aesthetic MLP's state dict (sac+logos+ava1-l14-linearMSE.pth from "
                      "christophschuhmann/improved-aesthetic-predictor, or a .safetensors of it)"),
        "clip_path": (str, "a local directory of the transformers CLIPModel whose image embeddings the MLP reads "
                           "(a download of openai/clip-vit-large-patch14, with its preprocessor_config.json)"),
        "batch_size": (int, "an integer >= 1 (images per forward pass)"),
    },
    required=("path", "clip_path"),
)


class AestheticMlp(nn.Module):
    """The published MLP (no activations, as released): ``input_size -> 1024 -> 128 -> 64 -> 16 -> 1``."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, input_size]`` -> ``[N, 1]``."""
        return self.layers(x)


def mlp_shapes(input_size: int) -> dict[str, tuple[int, ...]]:
    """Every key of :class:`AestheticMlp`'s state dict and its shape."""
    return {k: tuple(v.shape) for k, v in AestheticMlp(input_size).state_dict().items()}


def _check_mlp(shapes: Mapping[str, tuple[int, ...]], input_size: int, where: str) -> None:
    want = mlp_shapes(input_size)
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    wrong = [k for k in want if k in shapes and tuple(shapes[k]) != want[k]]
    if missing or extra or wrong:
        what = (f"{wrong[0]} is {list(shapes[wrong[0]])}, expected {list(want[wrong[0]])}" if wrong else
                f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}")
        raise ConfigError(f"{where} is not the LAION aesthetic MLP over a {input_size}-wide CLIP embedding "
                          f"(clip_path's projection_dim): {what}")


def _paths(table: Mapping[str, Any]) -> tuple[Any, Any, int]:
    """The checked MLP file, CLIP directory and the CLIP's embedding width (cheap: JSON only).

    Raises:
        ConfigError: naming ``reward.models.aesthetic.path`` or ``.clip_path``.
    """
    check_table("aesthetic", table, AESTHETIC_TABLE)
    clip_path = table_path("aesthetic", table, "clip_path", "dir", AESTHETIC_TABLE.keys["clip_path"][1])
    cfg = clip_config("aesthetic", "clip_path", clip_path)
    hf_weights_present("aesthetic", "clip_path", clip_path)
    processor_files("aesthetic", "clip_path", clip_path, tokenizer=False)
    path = table_path("aesthetic", table, "path", "file", AESTHETIC_TABLE.keys["path"][1])
    return path, clip_path, int(cfg.get("projection_dim", 512))


def check_aesthetic(table: Mapping[str, Any]) -> None:
    """The preflight of ``aesthetic``: both paths, the CLIP's config.json and the MLP's keys and shapes
    (a safetensors header or a memory-mapped ``.pt``; no weights read).

    Raises:
        ConfigError: naming the key.
    """
    path, _, width = _paths(table)
    _check_mlp(state_dict_shapes("aesthetic", "path", path), width, f"reward.models.aesthetic.path: {str(path)!r}")


class AestheticReward:
    """The LAION aesthetic predictor on a CLIP image embedding (module docstring).

    Raises:
        ConfigError: a missing or wrong path, or a file of another architecture (the key named).
    """

    name = "aesthetic"

    def __init__(self, table: Mapping[str, Any], device: str = "cpu", dtype: str = "") -> None:
        from transformers import AutoImageProcessor

        path, clip_path, width = _paths(table)
        state = load_state_dict_file("aesthetic", "path", path)
        _check_mlp({k: tuple(v.shape) for k, v in state.items()}, width, f"reward.models.aesthetic.path: {str(path)!r}")
        self.device, self.dtype = device, resolve_dtype(dtype, device)
        self.batch_size = int(table.get("batch_size", 32))
        self.clip = load_clip_model("aesthetic", "clip_path", clip_path, device, self.dtype)
        self.mlp = AestheticMlp(width)
        self.mlp.load_state_dict(state, strict=True)
        self.mlp.to(device).eval()
        processor = AutoImageProcessor.from_pretrained(str(clip_path), local_files_only=True)
        self.pixels = ClipPixels.from_hf(processor, "reward.models.aesthetic.clip_path")

    def embeddings(self, frames: torch.Tensor) -> torch.Tensor:
        """L2-normalised fp32 CLIP image embeddings ``[N, D]`` of frames ``[N, 3, H, W]`` in [0, 1]."""
        out = self.clip.get_image_features(pixel_values=self.pixels(frames).to(self.dtype))
        return torch.nn.functional.normalize(features_of(out).float(), dim=-1)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """The predicted rating of each sample (videos: the mean over frames); fp32 ``[B]`` on the CPU.

        Raises:
            RewardError: a malformed batch.
        """
        check_batch(images, prompts, self.name)
        return score_batches(images, self.device, self.batch_size,
                             lambda frames, _: self.mlp(self.embeddings(frames)).squeeze(-1))


def aesthetic(table: Mapping[str, Any], device: str, dtype: str) -> AestheticReward:
    """The registry's factory of ``aesthetic``."""
    return AestheticReward(table, device, dtype)
