"""What the learned rewards share: their tables, strict offline loading, and CLIP's preprocessing in torch.

**Tables.** Each learned reward reads its own ``[reward.models.<name>]`` table, a plain dict; every
problem with it (a missing or wrong path, a file of another architecture, a missing extra) is a
:class:`~digenrl.errors.ConfigError` naming the key, raised by the cheap checks ``digenrl validate``
runs (``check_*`` functions: ``config.json`` and state-dict headers, never the weights) and again by
the loaders. Weights load from local paths only (``local_files_only=True``, a path that is no
directory or file is refused before any library sees it, so nothing is ever looked up on a hub).

**Preprocessing.** The published CLIP processors (transformers' ``CLIPImageProcessor``, open_clip's
validation transform, OpenAI's ``_transform``) take a PIL image: resize its shortest side to ``S`` with
PIL's antialiased bicubic (the long side to ``int(S * long / short)``), center-crop, scale to [0, 1],
normalise per channel. :class:`ClipPixels` does the same with torch ops on the decoded ``[0, 1]``
float tensors, batched, on the reward's device: ``F.interpolate(mode="bicubic", antialias=True)`` is
torch's port of PIL's antialiased bicubic (``a = -0.5``), clamped to [0, 1] as the processor's uint8
image is. The one difference is that PIL resamples in two passes, rounding and clipping to uint8 after
each, where torch stays in float: on a uint8-exact image the two differ by at most 2.4/255 per pixel
before normalisation (mean ~0.3/255), i.e. <= 0.0375 after it (tests/rewards/test_learned.py asserts
it against transformers' processors and open_clip's transform), and not at all when no resize is needed
(the short side already the target). The crop offset follows the library replicated:
``(H - h) // 2`` in transformers, ``round((H - h) / 2)`` in torchvision's ``CenterCrop`` (open_clip).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from digenrl.errors import ConfigError
from digenrl.rewards.base import as_frames, check_batch

__all__ = ["ClipPixels", "TableSpec", "check_table", "resolve_dtype", "table_path", "clip_config", "hf_weights_present",
           "processor_files", "load_clip_model", "load_state_dict_file", "state_dict_shapes", "score_batches",
           "embed_unique", "features_of", "one_line", "three_floats", "TextImageReward"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``reward.dtype``: ``""`` is bf16 on CUDA and fp32 elsewhere.

    Raises:
        ConfigError: an unknown dtype name.
    """
    if not dtype:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"reward.dtype: {dtype!r} is not allowed; allowed: '', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


# ---------------------------------------------------------------------------------------------- tables

@dataclass(frozen=True)
class TableSpec:
    """The keys of one ``[reward.models.<name>]`` table: ``{key: (type, help)}`` and which are required."""

    keys: Mapping[str, tuple[type, str]]
    required: tuple[str, ...] = ()


def check_table(name: str, table: Mapping[str, Any], spec: TableSpec, *, required: bool = True) -> None:
    """Unknown keys, wrong types and (with ``required``) missing required keys, each naming its key.

    Raises:
        ConfigError: ``reward.models.<name>.<key>: ...``.
    """
    prefix = f"reward.models.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{prefix}: must be a table, got {table!r}")
    for key, value in table.items():
        if key not in spec.keys:
            raise ConfigError(f"{prefix}.{key}: unknown key; allowed in [{prefix}]: {', '.join(spec.keys)}")
        tp, what = spec.keys[key]
        ok = isinstance(value, tp) and not isinstance(value, bool)
        if tp is int:
            ok = ok and value >= 1
        if not ok or (tp is str and not value):
            raise ConfigError(f"{prefix}.{key}: must be {what}, got {value!r}")
    for key in spec.required if required else ():
        if key not in table:
            raise ConfigError(f"{prefix}.{key}: the {name!r} reward needs it: {spec.keys[key][1]}")


def table_path(name: str, table: Mapping[str, Any], key: str, kind: str, hint: str = "") -> Path:
    """``table[key]`` as an existing local directory (``kind="dir"``) or file (``"file"``).

    Raises:
        ConfigError: the key is missing, or the path is not an existing directory/file (``hint`` says
            what to download where).
    """
    raw = table.get(key)
    full, tail = f"reward.models.{name}.{key}", f"; {hint}" if hint else ""
    if not raw:
        raise ConfigError(f"{full}: the {name!r} reward needs it{': ' + hint if hint else ''}")
    path = Path(str(raw)).expanduser()
    what = "a directory" if kind == "dir" else "a file"
    if not path.exists():
        raise ConfigError(f"{full}: {str(path)!r} does not exist; it must be {what} on this host (weights load from "
                          f"local paths only, never from a hub){tail}")
    if not (path.is_dir() if kind == "dir" else path.is_file()):
        raise ConfigError(f"{full}: {str(path)!r} is not {what}{tail}")
    return path


def clip_config(name: str, key: str, path: Path) -> dict[str, Any]:
    """``path/config.json`` of a transformers ``CLIPModel`` directory (cheap: JSON only).

    Raises:
        ConfigError: no or unreadable ``config.json``, or a model type other than ``clip``.
    """
    full = f"reward.models.{name}.{key}"
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{full}: {str(path)!r} holds no config.json; it must be a transformers CLIPModel "
                          "directory (config.json and the weights, as save_pretrained writes them)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{full}: cannot read {str(cfg_file)!r}: {exc}") from None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type != "clip":
        archs = cfg.get("architectures") if isinstance(cfg, dict) else None
        raise ConfigError(f"{full}: {str(path)!r} holds a {model_type!r} model ({archs or 'no architectures'}), "
                          "not a CLIPModel (model_type 'clip')")
    return cfg


def hf_weights_present(name: str, key: str, path: Path) -> None:
    """A weights file (or a sharded index) beside ``config.json``.

    Raises:
        ConfigError: none found.
    """
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any((path / n).is_file() for n in names):
        raise ConfigError(f"reward.models.{name}.{key}: {str(path)!r} holds no weights ({', '.join(names)})")


def processor_files(name: str, key: str, path: Path, hint: str = "", *, tokenizer: bool = True) -> None:
    """An image processor config and (``tokenizer``) a tokenizer in ``path``, as ``CLIPProcessor`` reads them.

    Raises:
        ConfigError: one of them is missing (``hint`` says where to find them).
    """
    full, tail = f"reward.models.{name}.{key}", f"; {hint}" if hint else ""
    if not any((path / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")):
        raise ConfigError(f"{full}: {str(path)!r} holds no preprocessor_config.json (the CLIP image processor){tail}")
    if tokenizer and not ((path / "tokenizer.json").is_file() or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())):
        raise ConfigError(f"{full}: {str(path)!r} holds no tokenizer (tokenizer.json, or vocab.json and merges.txt){tail}")


def load_clip_model(name: str, key: str, path: Path, device: str, dtype: torch.dtype) -> Any:
    """A transformers ``CLIPModel`` from a local directory, every weight present, in eval mode.

    Raises:
        ConfigError: not a CLIP directory, or weights missing or of other shapes than its config.
    """
    from transformers import CLIPModel

    clip_config(name, key, path)
    hf_weights_present(name, key, path)
    try:
        loaded: Any = CLIPModel.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"reward.models.{name}.{key}: cannot load a CLIPModel from {str(path)!r}: "
                          f"{one_line(exc, 300)}") from None
    model, info = loaded
    bad = [*info.get("missing_keys", ()), *(m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", ()))]
    if bad:
        raise ConfigError(f"reward.models.{name}.{key}: the weights in {str(path)!r} do not fit its config.json "
                          f"(missing or of another shape: {sorted(bad)[:4]}{' ...' if len(bad) > 4 else ''})")
    return model.to(device=device, dtype=dtype).eval()


def load_state_dict_file(name: str, key: str, path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or (``.pt``/``.pth``/``.bin``) ``torch.load(weights_only=True)``;
    a ``{"state_dict": ...}`` checkpoint is unwrapped and a DDP ``module.`` prefix dropped.

    Raises:
        ConfigError: the file cannot be read as a state dict of tensors.
    """
    return _read_state_dict(name, key, path, mmap=False)


def state_dict_shapes(name: str, key: str, path: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a state-dict file without reading its tensors (a safetensors header; a ``.pt``
    memory-mapped, so only its pickled index is read).

    Raises:
        ConfigError: the file cannot be read as a state dict.
    """
    full = f"reward.models.{name}.{key}"
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return {k.removeprefix("module."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as exc:  # any unreadable file is the same config problem, named once
            raise ConfigError(f"{full}: cannot read {str(path)!r} as a state dict: {one_line(exc)}") from None
    return {k: tuple(v.shape) for k, v in _read_state_dict(name, key, path, mmap=True).items()}


def _read_state_dict(name: str, key: str, path: Path, *, mmap: bool) -> dict[str, torch.Tensor]:
    full = f"reward.models.{name}.{key}"
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(path))
        else:
            try:
                obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                obj = torch.load(str(path), map_location="cpu", weights_only=True)  # the legacy format cannot map
    except Exception as exc:  # any unreadable file is the same config problem, named once
        raise ConfigError(f"{full}: cannot read {str(path)!r} as a state dict: {one_line(exc)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"{full}: {str(path)!r} is not a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut at ``limit`` characters."""
    return " ".join(str(exc).split())[:limit]


# ------------------------------------------------------------------------------------- preprocessing

def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` for the dicts of transformers 4 and the ``SizeDict`` of 5 (attribute or item)."""
    if obj is None:
        return None
    if isinstance(obj, int):
        return obj
    value = getattr(obj, key, None)
    if value is None and isinstance(obj, Mapping):
        value = obj.get(key)
    return value


@dataclass(frozen=True)
class ClipPixels:
    """CLIP's image preprocessing as torch ops (see the module docstring): shortest side to ``size``
    (bicubic, antialiased), center crop to ``crop``, per-channel normalisation.

    Args:
        size: the shortest side after resizing.
        crop: ``(height, width)`` of the center crop (each <= ``size``).
        mean: per-channel mean.
        std: per-channel std.
        crop_offset: ``"floor"`` (transformers) or ``"round"`` (torchvision's CenterCrop, open_clip).
    """

    size: int
    crop: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_offset: str = "floor"

    @classmethod
    def from_hf(cls, processor: Any, where: str) -> ClipPixels:
        """The preprocessing of a transformers CLIP image processor, checked to be the one replicated.

        Raises:
            ConfigError: naming ``where``: a processor that does not resize the shortest side with
                bicubic, center-crop, rescale by 1/255 and normalise.
        """
        size, crop = _field(processor.size, "shortest_edge"), processor.crop_size
        crop_hw = (_field(crop, "height"), _field(crop, "width")) if not isinstance(crop, int) else (crop, crop)
        ok = (processor.do_resize and isinstance(size, int) and int(processor.resample) == 3 and processor.do_center_crop
              and all(isinstance(v, int) and 0 < v <= size for v in crop_hw) and processor.do_rescale
              and math.isclose(processor.rescale_factor, 1 / 255) and processor.do_normalize)
        if not ok:
            raise ConfigError(f"{where}: its image processor does not preprocess as CLIP does (shortest side, bicubic, "
                              f"center crop, /255, normalise): size={processor.size}, crop_size={crop}, "
                              f"resample={processor.resample}")
        return cls(size, (int(crop_hw[0]), int(crop_hw[1])), three_floats(processor.image_mean),
                   three_floats(processor.image_std))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` in [0, 1] -> ``[N, 3, crop_h, crop_w]`` normalised (fp32, on the input's device)."""
        x = images.float()
        h, w = x.shape[-2:]
        short, long = (h, w) if h <= w else (w, h)
        new_long = int(self.size * long / short)
        new_h, new_w = (self.size, new_long) if h <= w else (new_long, self.size)
        if (new_h, new_w) != (h, w):
            x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
        ch, cw = self.crop
        if self.crop_offset == "round":
            top, left = int(round((new_h - ch) / 2.0)), int(round((new_w - cw) / 2.0))
        else:
            top, left = (new_h - ch) // 2, (new_w - cw) // 2
        x = x[..., top:top + ch, left:left + cw]
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std


def three_floats(values: Any) -> tuple[float, float, float]:
    """A per-channel mean/std (three values, or one for every channel) as floats."""
    v = [float(x) for x in (values if isinstance(values, Sequence) else [values] * 3)]
    return (v[0], v[1], v[2])


# ----------------------------------------------------------------------------------------- scoring

def features_of(out: Any) -> torch.Tensor:
    """The projected embeddings of ``get_image_features``/``get_text_features``: a tensor (transformers 4)
    or an output whose ``pooler_output`` holds them (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def embed_unique(prompts: Sequence[str], embed: Callable[[list[str]], torch.Tensor],
                 batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings of the distinct prompts (a group's samples share one) and each prompt's row in them."""
    index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    distinct, rows = list(index), torch.tensor([index[p] for p in prompts])
    with torch.inference_mode():
        chunks = [embed(distinct[i:i + batch_size]) for i in range(0, len(distinct), batch_size)]
    return torch.cat(chunks), rows


def score_batches(images: torch.Tensor, device: str, batch_size: int,
                  score_frames: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Score a checked batch ``[B, 3, H, W]`` (videos ``[B, 3, F, H, W]``: the mean over frames) in chunks
    of ``batch_size`` frames moved to ``device``; ``score_frames(frames, samples)`` scores one chunk, whose
    frame ``k`` belongs to sample ``samples[k]``.

    Returns:
        fp32 scores ``[B]`` on the CPU.
    """
    frames, f = as_frames(images)
    owner = torch.arange(frames.shape[0]) // f
    out = []
    with torch.inference_mode():
        for i in range(0, frames.shape[0], batch_size):
            chunk = frames[i:i + batch_size].to(device, non_blocking=True)  # the reward's own device, once
            out.append(score_frames(chunk, owner[i:i + batch_size]).float().cpu())
    scores = torch.cat(out) if out else torch.zeros(0)
    return scores.reshape(-1, f).mean(dim=1)


class TextImageReward:
    """A reward that scores the cosine of a sample's image features and its prompt's text features (CLIP-family
    models): subclasses give ``text_features``/``image_features`` (L2-normalised, on ``device``), ``name``,
    ``device``, ``batch_size`` and may turn the cosine into their score with ``combine``."""

    name = "text-image"
    device = "cpu"
    batch_size = 32

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def image_features(self, frames: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, cos: torch.Tensor) -> torch.Tensor:
        """The score of each frame from its cosine (default: the cosine)."""
        return cos

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score a batch (videos: the mean over frames); fp32 ``[B]`` on the CPU.

        Raises:
            RewardError: a malformed batch.
        """
        check_batch(images, prompts, self.name)
        text, rows = embed_unique(prompts, self.text_features, self.batch_size)

        def frames_score(frames: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
            return self.combine((self.image_features(frames) * text[rows[samples].to(text.device)]).sum(dim=-1))

        return score_batches(images, self.device, self.batch_size, frames_score)
