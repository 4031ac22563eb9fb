"""HPSv2.1: the Human Preference Score v2.1 (Wu et al. 2023, tgxs002/HPSv2) through open_clip.

HPSv2 is an open_clip CLIP ViT-H-14 fine-tuned on human preferences. Its checkpoint
(``HPS_v2.1_compressed.pt`` of the hub repo ``xswu/HPSv2``, a ``{"state_dict": ...}``) loads here through
the library it was published for: ``open_clip.create_model_and_transforms(model, pretrained=<that file>)``
(strict, ``torch.load(weights_only=True)``; a ``.safetensors`` of the same state dict works too). The score
is HPSv2's own (``hpsv2/img_score.py``): the image and text features, each L2-normalised by open_clip's
``CLIP.forward``, multiplied (``image_features @ text_features.T``, its diagonal), i.e. the cosine
``cos(E_image, E_text)`` without a logit scale, ~0.2-0.35 for typical images.

Images are preprocessed as open_clip's validation transform does (shortest side to 224, bicubic,
torchvision's CenterCrop, OpenAI's mean/std; in torch, :class:`~digenrl.rewards._learned.ClipPixels`);
prompts are tokenised by open_clip's tokenizer of that architecture (the BPE vocabulary ships in the
package). Videos score the mean over frames.

``[reward.models.hpsv2]``: ``path`` (the checkpoint file), ``model`` (the open_clip architecture,
default ``ViT-H-14``), ``batch_size`` (frames per forward, default 32). open_clip is the optional extra
``pip install 'digenrl[rewards]'`` (open-clip-torch, ftfy). It imports torchvision, which must be the
build for the installed torch: on a CPU-only torch, PyPI's torchvision (built for CUDA torch) cannot
load, so this reward needs a CUDA torch (or a CPU torchvision of the same release).

Not yet run on a GPU or at real size: CUDA placement is tested through its meta-device twin, bf16 not at all
(tests/rewards/test_learned.py runs tiny fp32 instances on the CPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.rewards._learned import (ClipPixels, TableSpec, TextImageReward, check_table, one_line, resolve_dtype,
                                      state_dict_shapes, table_path, three_floats)

__all__ = ["HpsV2Reward", "HPS_TABLE", "hpsv2", "check_hpsv2", "import_open_clip"]

HPS_TABLE = TableSpec(
    keys={
        "path": (str, "the HPSv2.1 checkpoint file (HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2)"),
        "model": (str, "an open_clip architecture name (HPSv2.1: 'ViT-H-14')"),
        "batch_size": (int, "an integer >= 1 (images per forward pass)"),
    },
    required=("path",),
)
_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# What open_clip's load_checkpoint adds, drops or reshapes itself before its strict load: not a mismatch.
_FIXED_BY_LOADER = ("logit_bias", "logit_scale", "positional_embedding", "visual.positional_embedding",
                    "text.transformer.embeddings.position_ids")


def import_open_clip() -> Any:
    """The ``open_clip`` module.

    Raises:
        ConfigError: naming ``reward.weights.hpsv2``: open_clip is not installed, or cannot be imported
            (a torchvision that is not the build for this torch).
    """
    if importlib.util.find_spec("open_clip") is None:
        raise ConfigError("reward.weights.hpsv2: the 'hpsv2' reward needs open_clip, which is not installed; install "
                          "it with `pip install 'digenrl[rewards]'` (open-clip-torch, ftfy)")
    try:
        import open_clip
    except Exception as exc:  # ImportError, or torchvision's RuntimeError against another torch build
        raise ConfigError(f"reward.weights.hpsv2: open_clip is installed but cannot be imported "
                          f"({type(exc).__name__}: {one_line(exc)}); its torchvision must be the "
                          f"build for this torch ({torch.__version__})") from None
    return open_clip


def _model_name(open_clip: Any, table: Mapping[str, Any]) -> str:
    """``reward.models.hpsv2.model``: a built-in open_clip architecture whose towers and tokenizer need no hub.

    Raises:
        ConfigError: an unknown name, or one built from hub files (an HF text tower or tokenizer, a timm tower).
    """
    name = str(table.get("model", "ViT-H-14"))
    cfg = open_clip.get_model_config(name) if "/" not in name and ":" not in name else None
    if cfg is None:
        raise ConfigError(f"reward.models.hpsv2.model: {name!r} is not an open_clip architecture (HPSv2.1: 'ViT-H-14')")
    if "multimodal_cfg" in cfg:
        raise ConfigError(f"reward.models.hpsv2.model: {name!r} is a CoCa model, not a CLIP (HPSv2.1: 'ViT-H-14')")
    hub = [k for k in ("hf_model_name", "hf_tokenizer_name") if k in cfg.get("text_cfg", {})]
    hub += [k for k in ("timm_model_name",) if k in cfg.get("vision_cfg", {})]
    if hub:
        raise ConfigError(f"reward.models.hpsv2.model: {name!r} builds from hub files ({', '.join(hub)}), which are "
                          "never downloaded here; use an architecture of open_clip's own towers (HPSv2.1: 'ViT-H-14')")
    return name


def check_hpsv2(table: Mapping[str, Any]) -> None:
    """The preflight of ``hpsv2``: the extra imports, the architecture exists, and the checkpoint's keys and
    shapes are that architecture's (against the model built on the meta device; no weights read).

    Raises:
        ConfigError: naming the key.
    """
    check_table("hpsv2", table, HPS_TABLE)
    path = table_path("hpsv2", table, "path", "file", HPS_TABLE.keys["path"][1])
    open_clip = import_open_clip()
    name = _model_name(open_clip, table)
    cfg = dict(open_clip.get_model_config(name))
    model_class = open_clip.CustomTextCLIP if cfg.pop("custom_text", False) else open_clip.CLIP
    with torch.device("meta"):  # the architecture's state dict without allocating or initialising it
        want = {k: tuple(v.shape) for k, v in model_class(**cfg).state_dict().items()}
    have = state_dict_shapes("hpsv2", "path", path)
    missing = sorted(k for k in set(want) - set(have) if k not in _FIXED_BY_LOADER)
    extra = sorted(k for k in set(have) - set(want) if k not in _FIXED_BY_LOADER)
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k] and k not in _FIXED_BY_LOADER)
    if missing or extra or wrong:
        what = (f"{wrong[0]} is {list(have[wrong[0]])}, expected {list(want[wrong[0]])}" if wrong else
                f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}")
        raise ConfigError(f"reward.models.hpsv2.path: {str(path)!r} is not a checkpoint of the open_clip {name} "
                          f"(reward.models.hpsv2.model): {what}")


class HpsV2Reward(TextImageReward):
    """HPSv2.1 (module docstring).

    Raises:
        ConfigError: a missing or wrong path, a checkpoint of another architecture, or open_clip missing.
    """

    name = "hpsv2"

    def __init__(self, table: Mapping[str, Any], device: str = "cpu", dtype: str = "") -> None:
        check_table(self.name, table, HPS_TABLE)
        path = table_path(self.name, table, "path", "file", HPS_TABLE.keys["path"][1])
        open_clip = import_open_clip()
        arch = _model_name(open_clip, table)
        self.device, self.dtype = device, resolve_dtype(dtype, device)
        self.batch_size = int(table.get("batch_size", 32))
        try:  # an absolute path is never one of open_clip's download tags
            model, _, _ = open_clip.create_model_and_transforms(
                arch, pretrained=str(path.resolve()), precision=_PRECISION[self.dtype], device=device,
                weights_only=True, output_dict=True)
        except Exception as exc:  # strict load errors, unpickling refusals: all a wrong file
            raise ConfigError(f"reward.models.hpsv2.path: cannot load {str(path)!r} into the open_clip {arch}: "
                              f"{type(exc).__name__}: {one_line(exc, 300)}") from None
        self.model = model.eval()
        self.tokenizer = open_clip.get_tokenizer(arch)
        self.pixels = self._pixels(open_clip.get_model_preprocess_cfg(model))
        self._input_dtype = self.model.visual.conv1.weight.dtype  # bf16/fp16 open_clip keeps some params fp32

    @staticmethod
    def _pixels(cfg: Mapping[str, Any]) -> ClipPixels:
        size = cfg.get("size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        if cfg.get("interpolation", "bicubic") != "bicubic" or cfg.get("resize_mode", "shortest") != "shortest" or h != w:
            raise ConfigError(f"reward.models.hpsv2.model: its preprocessing {dict(cfg)} is not the one replicated "
                              "(square, shortest side, bicubic)")
        return ClipPixels(int(h), (int(h), int(w)), three_floats(cfg["mean"]), three_floats(cfg["std"]), crop_offset="round")

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised fp32 text features ``[P, D]`` on the reward's device."""
        tokens = self.tokenizer(prompts).to(self.device)
        return self.model.encode_text(tokens, normalize=True).float()

    def image_features(self, frames: torch.Tensor) -> torch.Tensor:
        """L2-normalised fp32 image features ``[N, D]`` of frames ``[N, 3, H, W]`` in [0, 1] (on the device)."""
        return self.model.encode_image(self.pixels(frames).to(self._input_dtype), normalize=True).float()


def hpsv2(table: Mapping[str, Any], device: str, dtype: str) -> HpsV2Reward:
    """The registry's factory of ``hpsv2``."""
    return HpsV2Reward(table, device, dtype)
