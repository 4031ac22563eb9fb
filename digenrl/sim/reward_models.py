"""The learned reward models as the planner and the simulator see them: parameters, FLOPs and activations.

The learned rewards of ALGORITHM (c) are CLIP towers scoring at 224 px:

* ``clipscore``: ``openai/clip-vit-large-patch14`` (ViT-L/14 image tower + 12-layer text tower, 427.6 M
  parameters); scores image and prompt.
* ``pickscore``: ``yuvalkirstain/PickScore_v1``, the CLIP-H architecture of
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (986.1 M); image and prompt.
* ``hpsv2``: HPS v2.1, an OpenCLIP ViT-H/14 (counted as the HF CLIP-H above, ~986 M); image and prompt.
* ``aesthetic``: the CLIP-L image embedding into the LAION aesthetic MLP (768-1024-128-64-16-1, 0.93 M);
  flow_grpo loads the whole ``CLIPModel``, so the text tower is held but never run.

Rewards without a model on the devices: ``color``, ``shapes``, ``jpeg_*`` (a few host operations),
``ocr`` (PaddleOCR on the host CPU), ``remote`` and ``vlm_judge`` (their own servers).

Where the reward's model directory (``reward.models.<name>.path``; ``aesthetic``: ``clip_path``) holds a
transformers ``config.json`` of a ``CLIPModel`` (``vision_config``, ``text_config``, ``projection_dim``), the
architecture is read from it; otherwise (no path yet, or ``hpsv2``'s single checkpoint file) the published
one above is used, and :attr:`RewardModel.source` says which. A scoring call runs ``batch_size`` images
per forward (the table's key; the learned rewards' default 32).

FLOPs follow ``flops.py``'s convention (matrix products only, ``2 m n k``; the patch convolution; both
attention products), per scored image: the image tower on ``(224 / patch)^2 + 1`` tokens, the text tower
on its whole 77-token context, the two projections and any head. The text tower is charged to every image:
an upper bound, since the rewards embed each distinct prompt once (a group's samples share it; the text
tower is 7.6% of CLIP-L's FLOPs per image, 12.3% of CLIP-H's).
A test compares them with ``FlopCounterMode`` on a meta-device ``CLIPModel`` of the published configs.

Activations of a scoring batch (no gradient) are counted, not traced: the larger tower's peak inside an
MLP, ``B x T x (4 d + 3 m)`` elements (what transformers' CLIP holds there: the tower's input, the
layer's input, the residual and the MLP's input, then the MLP's hidden layer and the two temporaries of
``quick_gelu``), plus the ``B x 3 x 224 x 224`` pixel input. A test compares this with a traced
meta-device forward (``plan/trace.py``'s live bytes, attention as a fused kernel): equal for CLIP-L and CLIP-H.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["ClipSpec", "RewardModel", "CLIP_L", "CLIP_H", "PUBLISHED", "OFF_DEVICE", "SCORE_BATCH", "reward_model",
           "reward_models", "reward_flops", "model_path", "score_batch"]

_AESTHETIC_MLP = (768, 1024, 128, 64, 16, 1)  # LAION aesthetic predictor v2 (sac+logos+ava1-l14-linearMSE)
SCORE_BATCH = 32  # images per forward when the table sets no batch_size (rewards/clip.py, aesthetic.py, hps.py)
_CONFIG_KEY = {"aesthetic": "clip_path"}  # the table key of the directory holding the CLIPModel's config.json


@dataclass(frozen=True, slots=True)
class ClipSpec:
    """One CLIP model (transformers ``CLIPModel`` layout) and what scoring runs of it.

    Attributes:
        arch: display name.
        vision_width, vision_layers, vision_mlp, patch, image_size: the image tower.
        text_width, text_layers, text_mlp, text_tokens, vocab: the text tower.
        projection: the shared embedding width.
        text: whether scoring runs the text tower (``aesthetic`` scores the image alone).
        head: widths of an MLP head on the image embedding (``aesthetic``), else empty.
    """

    arch: str
    vision_width: int
    vision_layers: int
    vision_mlp: int
    text_width: int
    text_layers: int
    text_mlp: int
    projection: int
    patch: int = 14
    image_size: int = 224
    text_tokens: int = 77
    vocab: int = 49408
    text: bool = True
    head: tuple[int, ...] = ()

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2 + 1  # patches + the class token

    @property
    def params(self) -> int:
        """Every parameter of the ``CLIPModel`` (biases and norms included) plus the head's."""
        d, t = self.vision_width, self.text_width
        vision = (3 * self.patch**2 * d + d + self.image_tokens * d + 2 * d + 2 * d
                  + self.vision_layers * _layer_params(d, self.vision_mlp) + d * self.projection)
        text = (self.vocab * t + self.text_tokens * t + self.text_layers * _layer_params(t, self.text_mlp) + 2 * t
                + t * self.projection)
        head = sum(a * b + b for a, b in zip(self.head, self.head[1:]))
        return vision + text + 1 + head  # + logit_scale

    @property
    def flops_per_image(self) -> int:
        """Forward FLOPs of scoring one image (and its prompt, when the text tower runs)."""
        n = self.image_tokens
        vision = (2 * 3 * self.patch**2 * self.vision_width * (n - 1)
                  + self.vision_layers * _layer_flops(n, self.vision_width, self.vision_mlp)
                  + 2 * self.vision_width * self.projection)
        text = (self.text_layers * _layer_flops(self.text_tokens, self.text_width, self.text_mlp)
                + 2 * self.text_width * self.projection) if self.text else 0
        head = sum(2 * a * b for a, b in zip(self.head, self.head[1:]))
        return vision + text + head

    def activation_bytes(self, batch: int, nbytes: int) -> int:
        """Peak activation bytes of scoring ``batch`` images without gradient (see the module docstring)."""
        towers = [self.image_tokens * (4 * self.vision_width + 3 * self.vision_mlp)]
        if self.text:
            towers.append(self.text_tokens * (4 * self.text_width + 3 * self.text_mlp))
        return batch * (max(towers) + 3 * self.image_size**2) * nbytes


def _layer_params(d: int, m: int) -> int:
    return 4 * (d * d + d) + 2 * 2 * d + d * m + m + m * d + d  # q, k, v, out; two norms; fc1, fc2


def _layer_flops(tokens: int, d: int, m: int) -> int:
    return 8 * tokens * d * d + 4 * tokens * tokens * d + 4 * tokens * d * m  # projections, QK^T and AV, MLP


# openai/clip-vit-large-patch14 config.json.
CLIP_L = ClipSpec("CLIP ViT-L/14", vision_width=1024, vision_layers=24, vision_mlp=4096, text_width=768,
                  text_layers=12, text_mlp=3072, projection=768)
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K config.json (PickScore_v1 fine-tunes this architecture).
CLIP_H = ClipSpec("CLIP ViT-H/14", vision_width=1280, vision_layers=32, vision_mlp=5120, text_width=1024,
                  text_layers=24, text_mlp=4096, projection=1024)

PUBLISHED: dict[str, ClipSpec] = {
    "clipscore": CLIP_L,
    "pickscore": CLIP_H,
    "hpsv2": replace(CLIP_H, arch="OpenCLIP ViT-H/14 (HPS v2.1)"),
    "aesthetic": replace(CLIP_L, arch="CLIP ViT-L/14 + aesthetic MLP", text=False, head=_AESTHETIC_MLP),
}
# Where the rewards without a model on the devices run.
OFF_DEVICE: dict[str, str] = {
    "color": "a few host operations", "shapes": "a few host operations",
    "edit_consistency": "a few host operations",
    "jpeg_compressibility": "host JPEG encoding", "jpeg_incompressibility": "host JPEG encoding",
    "ocr": "PaddleOCR on the host CPU", "remote": "its own server", "vlm_judge": "its own server",
}


@dataclass(frozen=True, slots=True)
class RewardModel:
    """One weighted reward's model: its architecture and where the numbers come from."""

    reward: str
    spec: ClipSpec
    source: str

    @property
    def params(self) -> int:
        return self.spec.params

    @property
    def flops_per_image(self) -> int:
        return self.spec.flops_per_image


def _table(reward: Any, name: str) -> Mapping[str, Any]:
    table = (getattr(reward, "models", None) or {}).get(name)
    return table if isinstance(table, Mapping) else {}


def model_path(reward: Any, name: str) -> str:
    """The directory of reward ``name``'s CLIPModel in a ``[reward]`` table: ``reward.models.<name>.path``
    (``aesthetic``: ``clip_path``); ``""`` where there is none."""
    return str(_table(reward, name).get(_CONFIG_KEY.get(name, "path"), "") or "")


def score_batch(reward: Any, name: str) -> int:
    """Images reward ``name`` scores per forward (``reward.models.<name>.batch_size``, else :data:`SCORE_BATCH`)."""
    return int(_table(reward, name).get("batch_size", SCORE_BATCH))


def _from_config(name: str, base: ClipSpec, config: dict[str, Any], where: str) -> ClipSpec:
    """``base`` with the architecture of a transformers ``CLIPModel`` ``config.json`` (its missing keys
    at ``CLIPTextConfig`` / ``CLIPVisionConfig`` defaults)."""
    v, t = config.get("vision_config") or {}, config.get("text_config") or {}
    return replace(base, arch=f"{base.arch.split(' (')[0]} from {where}",
                   vision_width=int(v.get("hidden_size", 768)), vision_layers=int(v.get("num_hidden_layers", 12)),
                   vision_mlp=int(v.get("intermediate_size", 3072)), patch=int(v.get("patch_size", 32)),
                   image_size=int(v.get("image_size", 224)), text_width=int(t.get("hidden_size", 512)),
                   text_layers=int(t.get("num_hidden_layers", 12)), text_mlp=int(t.get("intermediate_size", 2048)),
                   text_tokens=int(t.get("max_position_embeddings", 77)), vocab=int(t.get("vocab_size", 49408)),
                   projection=int(config.get("projection_dim", 512)))


def reward_model(name: str, path: str = "") -> RewardModel | None:
    """The model reward ``name`` scores with (``None``: it has none on the devices; :data:`OFF_DEVICE`).

    ``path``: ``reward.models.<name>.path``; its ``config.json`` gives the architecture when it is a
    ``CLIPModel`` config, else the published architecture is used.
    """
    base = PUBLISHED.get(name)
    if base is None:
        return None
    config = Path(path) / "config.json" if path else None
    if config is not None and config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            return RewardModel(name, base, f"published size of {base.arch} ({config} unreadable: {exc})")
        if isinstance(data, dict) and "vision_config" in data:
            return RewardModel(name, _from_config(name, base, data, str(config)), f"read from {config}")
        return RewardModel(name, base, f"published size of {base.arch} ({config} is not a CLIPModel config)")
    why = f"no config.json in {path}" if path else f"reward.models.{name}.{_CONFIG_KEY.get(name, 'path')} not set"
    return RewardModel(name, base, f"published size of {base.arch} ({why})")


def reward_models(reward: Any) -> list[RewardModel]:
    """The models of a ``[reward]`` table's weighted rewards (weight 0: not built, not counted)."""
    out = []
    for name, weight in reward.weights.items():
        model = reward_model(name, model_path(reward, name)) if weight else None
        if model is not None:
            out.append(model)
    return out


def reward_flops(reward: Any) -> float:
    """FLOPs to score one decoded sample with every weighted reward of a ``[reward]`` table (0: none on a device)."""
    return float(sum(m.flops_per_image for m in reward_models(reward)))
