"""CLIPScore and PickScore: a transformers ``CLIPModel`` scoring image-text agreement.

Both load a local ``CLIPModel`` directory and its ``CLIPProcessor`` (tokenizer + image processor)
through transformers, strictly offline, once per reward object, on ``reward.device`` in ``reward.dtype``;
images are preprocessed as the processor does, in torch on the reward's device
(:class:`~digenrl.rewards._learned.ClipPixels`); embeddings are compared in fp32.

* ``clipscore`` — CLIP-S of Hessel et al., "CLIPScore: A Reference-free Evaluation Metric for Image
  Captioning" (EMNLP 2021), eq. 1: ``2.5 * max(cos(E_image, E_text), 0)``, in [0, 2.5]. The paper used
  ViT-B/32; the weights named here are ``openai/clip-vit-large-patch14`` (any CLIPModel directory
  works). The paper's ``w = 2.5`` only rescales; torchmetrics' ``CLIPScore`` uses 100 instead.
* ``pickscore`` — PickScore (Kirstain et al., "Pick-a-Pic", NeurIPS 2023; yuvalkirstain/PickScore):
  ``logit_scale.exp() * cos(E_image, E_text)`` of ``yuvalkirstain/PickScore_v1`` (a CLIP-ViT-H-14
  CLIPModel), ~18-24 for typical images. Its weights ship no processor: ``processor_path`` names a
  directory of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, whose processor PickScore's code uses.

Flow-GRPO (ALGORITHM (c)) divides PickScore by 26, a constant factor that ``reward.weights`` carries
(``pickscore = 0.0385``) and per-group advantage normalisation cancels for a single reward; its clipscore is
CLIP's logits / 30 (``100 * cos / 30``, without Hessel's clamp at 0). Prompts longer than the model's 77
tokens are truncated, as both papers' code does. Videos score the mean over frames.
``[reward.models.clipscore]`` / ``[reward.models.pickscore]`` keys: ``path`` (required), ``processor_path``
(default ``path``), ``batch_size`` (frames per forward, default 32).

Not yet run on a GPU or at real size: CUDA placement is tested through its meta-device twin, bf16 not at all
(tests/rewards/test_learned.py runs tiny fp32 instances on the CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from digenrl.rewards._learned import (ClipPixels, TableSpec, TextImageReward, check_table, clip_config, features_of,
                                      hf_weights_present, load_clip_model, processor_files, resolve_dtype, table_path)

__all__ = ["ClipScore", "PickScore", "CLIP_TABLE", "clipscore", "pickscore", "check_clipscore", "check_pickscore"]

CLIP_TABLE = TableSpec(
    keys={
        "path": (str, "a local directory holding a transformers CLIPModel (config.json and weights), e.g. a "
                      "download of openai/clip-vit-large-patch14 (clipscore) or yuvalkirstain/PickScore_v1 (pickscore)"),
        "processor_path": (str, "a local directory holding the CLIP processor (preprocessor_config.json and the "
                                "tokenizer); default: path"),
        "batch_size": (int, "an integer >= 1 (images per forward pass)"),
    },
    required=("path",),
)

_HINTS = {
    "clipscore": "download openai/clip-vit-large-patch14 (config, weights, processor) and set its directory",
    "pickscore": "download yuvalkirstain/PickScore_v1 and set its directory",
}
_PROCESSOR_HINTS = {
    "pickscore": "PickScore_v1 ships no processor: set processor_path to a download of "
                 "laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its tokenizer and preprocessor_config.json)",
}


def _paths(name: str, table: Mapping[str, Any]) -> tuple[Any, Any]:
    """The checked model and processor directories (cheap: JSON and file names only).

    Raises:
        ConfigError: naming ``reward.models.<name>.path`` or ``.processor_path``.
    """
    check_table(name, table, CLIP_TABLE)
    path = table_path(name, table, "path", "dir", _HINTS.get(name, ""))
    clip_config(name, "path", path)
    hf_weights_present(name, "path", path)
    key = "processor_path" if "processor_path" in table else "path"
    proc = table_path(name, table, key, "dir", _PROCESSOR_HINTS.get(name, ""))
    processor_files(name, key, proc, _PROCESSOR_HINTS.get(name, ""))
    return path, proc


def check_clipscore(table: Mapping[str, Any]) -> None:
    """The preflight of ``clipscore``: the directories and their config files, no weights read.

    Raises:
        ConfigError: naming the key.
    """
    _paths("clipscore", table)


def check_pickscore(table: Mapping[str, Any]) -> None:
    """The preflight of ``pickscore`` (as :func:`check_clipscore`).

    Raises:
        ConfigError: naming the key.
    """
    _paths("pickscore", table)


class _ClipReward(TextImageReward):
    """A CLIPModel, its tokenizer and its preprocessing; ``combine(cos)`` makes the score.

    Raises:
        ConfigError: a missing or wrong path, or a directory of another architecture (the key named).
    """

    name = "clip"

    def __init__(self, table: Mapping[str, Any], device: str = "cpu", dtype: str = "") -> None:
        from transformers import CLIPProcessor

        path, proc_path = _paths(self.name, table)
        self.device, self.dtype = device, resolve_dtype(dtype, device)
        self.batch_size = int(table.get("batch_size", 32))
        self.model = load_clip_model(self.name, "path", path, device, self.dtype)
        processor = CLIPProcessor.from_pretrained(str(proc_path), local_files_only=True)
        key = "processor_path" if "processor_path" in table else "path"
        self.pixels = ClipPixels.from_hf(processor.image_processor, f"reward.models.{self.name}.{key}")
        self.tokenizer = processor.tokenizer
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised fp32 text embeddings ``[P, D]`` on the reward's device."""
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        out = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                           attention_mask=tokens["attention_mask"].to(self.device))
        return torch.nn.functional.normalize(features_of(out).float(), dim=-1)

    def image_features(self, frames: torch.Tensor) -> torch.Tensor:
        """L2-normalised fp32 image embeddings ``[N, D]`` of frames ``[N, 3, H, W]`` in [0, 1] (on the device)."""
        out = self.model.get_image_features(pixel_values=self.pixels(frames).to(self.dtype))
        return torch.nn.functional.normalize(features_of(out).float(), dim=-1)


class ClipScore(_ClipReward):
    """CLIP-S (Hessel et al. 2021): ``2.5 * max(cos, 0)`` (module docstring)."""

    name = "clipscore"
    w = 2.5

    def combine(self, cos: torch.Tensor) -> torch.Tensor:
        return self.w * cos.clamp(min=0)


class PickScore(_ClipReward):
    """PickScore (Kirstain et al. 2023): ``logit_scale.exp() * cos`` (module docstring)."""

    name = "pickscore"

    def combine(self, cos: torch.Tensor) -> torch.Tensor:
        return self.model.logit_scale.float().exp() * cos


def clipscore(table: Mapping[str, Any], device: str, dtype: str) -> ClipScore:
    """The registry's factory of ``clipscore``."""
    return ClipScore(table, device, dtype)


def pickscore(table: Mapping[str, Any], device: str, dtype: str) -> PickScore:
    """The registry's factory of ``pickscore``."""
    return PickScore(table, device, dtype)
