"""Tiny instances of the learned rewards' published models, saved in the published layouts.

* a transformers ``CLIPModel`` (random weights, ``save_pretrained``) beside the files of
  ``openai/clip-vit-large-patch14``'s processor: ``preprocessor_config.json`` in its published form and a
  CLIP BPE tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``) written here from a small
  byte-level vocabulary, so nothing is downloaded;
* the LAION aesthetic MLP's state dict (the published module's keys; its first layer takes the tiny
  CLIP's ``projection_dim`` instead of ViT-L/14's 768);
* an open_clip CLIP of a tiny architecture registered from a JSON config, and an HPSv2-style checkpoint
  ``{"state_dict": ...}`` of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from digenrl.rewards.aesthetic import AestheticMlp

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
SIZE = 32  # the tiny models' image size: a 32x32 image is preprocessed without any resampling


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP's printable stand-ins of the 256 bytes (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


MERGES = [("r", "e"), ("re", "d</w>"), ("c", "i"), ("ci", "r"), ("b", "l"), ("bl", "u"), ("blu", "e</w>")]


def _vocab() -> dict[str, int]:
    chars = _byte_alphabet()
    return {c: i for i, c in enumerate([*chars, *(c + "</w>" for c in chars), *(a + b for a, b in MERGES),
                                        "<|startoftext|>", "<|endoftext|>"])}


def tokenizer_files(root: Path) -> int:
    """A CLIP tokenizer in the published files; returns its vocabulary size."""
    vocab = _vocab()
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}
    (root / "special_tokens_map.json").write_text(json.dumps(special))
    (root / "tokenizer_config.json").write_text(json.dumps({**special, "model_max_length": 77,
                                                           "tokenizer_class": "CLIPTokenizer"}))
    return len(vocab)


def preprocessor_config(root: Path, size: int = SIZE) -> None:
    """``preprocessor_config.json`` as openai/clip-vit-large-patch14 publishes it (with ``size`` for 224)."""
    (root / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": size, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": OPENAI_MEAN, "image_std": OPENAI_STD,
        "resample": 3, "size": size}))


def tiny_clip_dir(root: Path, *, projection_dim: int = 24, processor: bool = True, seed: int = 0) -> Path:
    """A random tiny ``CLIPModel`` saved with ``save_pretrained`` (+ its processor files unless ``processor``
    is False, as PickScore_v1 ships none)."""
    from transformers import CLIPConfig, CLIPModel

    root.mkdir(parents=True, exist_ok=True)
    vocab_size = len(_vocab())
    if processor:
        tokenizer_files(root)
        preprocessor_config(root)
    eos = vocab_size - 1
    cfg = CLIPConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=eos - 1, eos_token_id=eos,
                         pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=SIZE, patch_size=8),
        projection_dim=projection_dim)
    torch.manual_seed(seed)
    model = CLIPModel(cfg)
    with torch.no_grad():
        model.logit_scale.fill_(3.1)  # not the init value, so a score that ignores it differs
    model.save_pretrained(root)
    return root


def tiny_other_model_dir(root: Path) -> Path:
    """A transformers model of another architecture (a CLIP vision tower alone: ``clip_vision_model``)."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    root.mkdir(parents=True, exist_ok=True)
    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=SIZE, patch_size=8, projection_dim=24)
    CLIPVisionModelWithProjection(cfg).save_pretrained(root)
    preprocessor_config(root)
    tokenizer_files(root)
    return root


def tiny_mlp_file(path: Path, input_size: int = 24, seed: int = 1) -> Path:
    """The aesthetic MLP's state dict (random) as ``.pt`` (``torch.save``) or ``.safetensors``."""
    torch.manual_seed(seed)
    state = AestheticMlp(input_size).state_dict()
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    return path


TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": SIZE, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}


def tiny_hps(root: Path, seed: int = 0) -> tuple[str, Path]:
    """Register the tiny open_clip architecture ``digenrl-tiny-hps`` and write an HPSv2-style checkpoint of
    random weights; returns (architecture, checkpoint path)."""
    import open_clip

    root.mkdir(parents=True, exist_ok=True)
    (root / "digenrl-tiny-hps.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(root / "digenrl-tiny-hps.json")
    torch.manual_seed(seed)
    model = open_clip.create_model("digenrl-tiny-hps")
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, root / "HPS_tiny.pt")
    return "digenrl-tiny-hps", root / "HPS_tiny.pt"


def open_clip_or_skip() -> Any:
    """``open_clip``, or skip the test: the [rewards] extra is missing, or (a CPU torch with PyPI's CUDA
    torchvision) it cannot be imported."""
    import pytest

    try:
        import open_clip
    except Exception as exc:  # ImportError, or torchvision's RuntimeError against a CPU torch
        pytest.skip(f"open_clip cannot be imported here ({type(exc).__name__}: {str(exc)[:80]}); "
                    "pip install 'digenrl[rewards]' with a torchvision built for this torch")
    return open_clip


def smooth_uint8_images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """``[n, 3, h, w]`` in [0, 1] whose uint8 round trip is exact (k / 255), smooth enough to resample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, max(2, h // 6), max(2, w // 6), generator=g)
    x = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
    x = x + 0.08 * torch.rand(n, 3, h, w, generator=g)  # some detail for the resize to act on
    return (x.clamp(0, 1) * 255).round() / 255


def to_pil(images: torch.Tensor) -> list[Any]:
    """uint8-exact ``[n, 3, h, w]`` -> PIL images."""
    from PIL import Image

    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arr]
