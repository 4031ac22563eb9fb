"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509) behind the GeneratorModel interface: prompt + input images.

A prompt is the record of a JSONL prompt file line (``data/prompts.py``: ``{"prompt": ..., "images": [paths]}``).
Its input images condition the generation twice, as in diffusers' ``QwenImageEditPipeline`` /
``QwenImageEditPlusPipeline``:

* **through the text encoder**: Qwen2.5-VL reads the instruction with the image(s) in the prompt template
  (``<|vision_start|><|image_pad|><|vision_end|>``, Plus: ``Picture k: ...`` per image); the kept hidden
  states (after the system prompt) include the image tokens', so the embeddings are longer than a text
  prompt's. The negative prompt ``" "`` is encoded with the same images (the pipelines do), so the
  negative branch is per sample too.
* **through the latents**: each input image is VAE-encoded (the distribution's mode, normalised per
  channel) and packed 2x2 like the noise, and its tokens are appended to the noisy tokens along the
  sequence. ``img_shapes`` lists the output grid, then each image's; the velocity is the output's first
  ``N`` tokens (the noise tokens').

``encode_prompts`` puts both into the :class:`Cond`: ``prompt_embeds``/``prompt_mask`` (and negatives)
plus ``image_latents`` ``[B, K·T_img, 64]``, so the trainer stores and replays the image conditioning as
it does the text's (``index_cond``/``cat_cond``/``repeat_cond`` work row-wise on every key). Its sizes are
fixed per run: every image is resized (Lanczos, stretching, the pipelines' ``VaeImageProcessor``) to one
size, :func:`image_size` of ``image_area`` at the output's aspect. The pipelines use 1024² for the VAE
images whatever the output size (at the input image's own aspect, which here is the output's), and so does
this adapter for the published models (``model.image_area`` = 0, :func:`conditioning_area`): a 512² run, as
flow_grpo's recipe, conditions on 4096 image tokens beside its 1024 noise tokens, as the stock pipeline does.
The tiny presets condition at the output's area (tiny runs stay tiny). The Plus pipeline's text-encoder images are 384² (``CONDITION_IMAGE_SIZE``), as here.

Variants (``model.variant``): ``"edit"`` (one input image, ``QwenImageEditPipeline``; the default) and
``"edit-plus"`` (``K >= 1`` images, ``QwenImageEditPlusPipeline``). Both share Qwen-Image's 20B transformer
architecture and scheduler config (``models/full.py``). A run's prompts all carry the same ``K``.

Presets: ``tiny`` is Qwen-Image's tiny transformer and VAE with a tiny Qwen2.5-VL that *does* see the image
(one vision block of width 16, the real patch-14 / merge-2 geometry, images smart-resized to at most 112²:
4-16 image tokens) through :class:`~digenrl.models._text.QwenVLByteProcessor` (transformers'
``Qwen2VLProcessor`` cannot be built without torchvision); ``pretrained`` (a local diffusers directory);
``random``/``full`` (the published architecture).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.models._common import (
    check_prompts,
    check_sigma,
    load_pipeline_offline,
    pack_2x2,
    pad_tokens,
    seeded,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import QwenVLByteProcessor, byte_qwen2vl_tokenizer, tiny_qwen25vl_text_encoder
from digenrl.models.base import Cond, cat_cond
from digenrl.models.qwenimage import (NEGATIVE_PROMPT, QWEN_SCHEDULER_CONFIG, QwenImageModel, build_qwenimage_pipeline,
                                      qwen_true_cfg)

__all__ = ["QwenImageEditModel", "EDIT_VARIANTS", "VAE_IMAGE_AREA", "conditioning_area", "image_size", "prompt_inputs", "build_qwenimage_edit_pipeline"]

EDIT_VARIANTS: tuple[str, ...] = ("edit-plus", "edit")  # "" = the last: "edit"
CONDITION_IMAGE_AREA = 384 * 384  # QwenImageEditPlusPipeline's text-encoder image size
VAE_IMAGE_AREA = 1024 * 1024  # both pipelines' VAE (latent conditioning) image size, whatever the output's
_TINY_VL_PIXELS = 112 * 112  # the tiny processor's max_pixels: at most 4x4 merged image tokens
_REAL_VL_PIXELS = 28 * 28 * 1280  # Qwen2VLImageProcessor's default max_pixels
_PIPELINE_DROP = 64  # QwenImageEdit(Plus)Pipeline.prompt_template_encode_start_idx (system-prompt tokens, real vocabulary)
_ASPECT_TOLERANCE = 0.02  # relative: an input image this close to the output's aspect is not called stretched

log = logging.getLogger(__name__)


def conditioning_area(preset: str, image_area: int, height: int, width: int) -> int:
    """Pixels of each conditioning image (VAE side): ``image_area`` when set, else the pipelines' 1024² for the
    published models (presets pretrained, random, full), the output's area for the tiny presets."""
    if image_area:
        return image_area
    return VAE_IMAGE_AREA if preset in ("pretrained", "random", "full") else height * width


def image_size(area: int, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` of ``area`` pixels at the aspect ``width / height``, both multiples of 32: the pipelines'
    ``calculate_dimensions`` (same operations, so the same rounding)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(h / 32) * 32, round(w / 32) * 32


def prompt_inputs(prompt: str, variant: str) -> tuple[str, list[Any]]:
    """The instruction and the RGB input images of an edit prompt record (``data/prompts.py``'s ``edit_prompt``;
    read here, as models sit beside ``data`` in the layers, not above it).

    Raises:
        ConfigError: a plain prompt (no record), no images, more than one for ``edit``, or an unreadable image.
    """
    try:
        rec = json.loads(prompt) if prompt.startswith("{") else None
    except json.JSONDecodeError:
        rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec.get("images"):
        raise ConfigError(f"qwenimage_edit: prompt {prompt[:60]!r} carries no input images; an edit model reads "
                          'a JSONL prompt file (data.prompt_file), one {"prompt": ..., "images": [...]} a line')
    if variant == "edit" and len(rec["images"]) != 1:
        raise ConfigError(f"qwenimage_edit: variant 'edit' takes one input image, prompt {rec['prompt'][:40]!r} has "
                          f"{len(rec['images'])}; model.variant = 'edit-plus' takes several")
    return rec["prompt"], [_read_rgb(str(p)) for p in rec["images"]]


@functools.lru_cache(maxsize=256)
def _read_rgb(path: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise ConfigError(f"qwenimage_edit: cannot read input image {path!r}: {exc}") from exc


def _vl_max_pixels(pipe: Any) -> int:
    """The attached processor's ``max_pixels``: the tiny presets' when the text encoder's vision tower is a tiny one
    (so a saved tiny model loads back with the same limits), else Qwen2-VL's default."""
    te = getattr(pipe, "text_encoder", None)
    vision = getattr(getattr(te, "config", None), "vision_config", None)
    return _TINY_VL_PIXELS if vision is not None and vision.hidden_size < 1280 else _REAL_VL_PIXELS


def _absent_processor(path: str | Path | None) -> dict[str, Any]:
    """``{"processor": None}`` for a directory saved without one (the tiny presets'), else ``{}``."""
    index = Path(path or "") / "model_index.json"
    if not index.is_file():
        return {}  # load_pipeline_offline names what is missing
    return {"processor": None} if json.loads(index.read_text()).get("processor") == [None, None] else {}


def _pipeline_class(variant: str) -> type:
    import diffusers

    return diffusers.QwenImageEditPlusPipeline if variant == "edit-plus" else diffusers.QwenImageEditPipeline


def _variant(variant: str) -> str:
    variant = variant or EDIT_VARIANTS[-1]
    if variant not in EDIT_VARIANTS:
        raise ConfigError(f"model.variant: qwenimage_edit has no variant {variant!r}; allowed: {', '.join(EDIT_VARIANTS)}")
    return variant


def build_qwenimage_edit_pipeline(preset: str, seed: int, variant: str = "edit") -> Any:
    """The tiny/small Qwen-Image pipeline's transformer and VAE in an edit pipeline, with a text encoder that sees
    images (deterministic in ``seed``; the same transformer and VAE weights as ``qwenimage``'s preset)."""
    base = build_qwenimage_pipeline(preset, seed)
    with seeded(seed + 2):
        text_encoder = tiny_qwen25vl_text_encoder(hidden_size=base.transformer.config.joint_attention_dim, vision=True)
    tok = byte_qwen2vl_tokenizer()
    # processor=None: registered as absent (it saves and loads as such); the adapter attaches its own
    return _pipeline_class(variant)(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder, tokenizer=tok,
                                    processor=None, transformer=base.transformer)


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit(-Plus) adapter; see the module docstring.

    Args:
        pipe: a ``QwenImageEditPipeline`` or ``QwenImageEditPlusPipeline``.
        height, width, guidance_scale, text_len: as :class:`QwenImageModel` (``text_len`` must hold the image
            tokens of the text encoder too).
        image_area: pixels of each conditioning image (VAE side); ``None`` = ``height · width``.

    Raises:
        ConfigError: the image size is not a multiple of the packed patch size.
    """

    name = "qwenimage_edit"

    def __init__(self, pipe: Any, *, height: int, width: int, guidance_scale: float = 4.0, text_len: int = 64,
                 image_area: int | None = None) -> None:
        super().__init__(pipe, height=height, width=width, guidance_scale=guidance_scale, text_len=text_len)
        self.plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
        self.variant = "edit-plus" if self.plus else "edit"
        if getattr(pipe, "processor", None) is None:  # not a pipeline attribute write: the config keeps it absent
            object.__setattr__(pipe, "processor", QwenVLByteProcessor(pipe.tokenizer, max_pixels=_vl_max_pixels(pipe)))
        # drop the system prompt only: the image tokens after it are part of the conditioning. The pipelines' 64 is
        # the real tokenizer's count (QwenImageModel set one counted up to "{}", past the image tokens: replaced)
        prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
        pipe.prompt_template_encode_start_idx = (_PIPELINE_DROP if len(pipe.tokenizer) > 1000 else
                                                 len(pipe.tokenizer(prefix).input_ids))
        self.image_hw = image_size(image_area or self.height * self.width, self.height, self.width)
        mult = 2 * self.vae_scale_factor
        if self.image_hw[0] % mult or self.image_hw[1] % mult:
            raise ConfigError(f"model: conditioning images of {self.image_hw} are not multiples of {mult}")
        self.image_tokens = (self.image_hw[0] // mult) * (self.image_hw[1] // mult)  # per input image
        self._told_aspect = False  # the stretched-input warning is given once per model

    # -- conditioning ---------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Text embeddings (with the images seen by the text encoder), negatives when CFG is on, and the images'
        packed latents ``image_latents [B, K·image_tokens, 64]``. One prompt at a time, as the Plus pipeline.

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
            ConfigError: a prompt without input images, an unreadable image, or (variant ``edit``) more than one.
        """
        check_prompts(prompts)
        return cat_cond([self._encode_one(p) for p in prompts])

    def _encode_one(self, prompt: str) -> Cond:
        text, images = prompt_inputs(prompt, self.variant)
        h, w = self.image_hw
        self._tell_if_stretched(text, images)
        proc = self.pipe.image_processor
        if self.plus:
            # the text encoder's images keep their own aspects (384² each), as the Plus pipeline's
            seen: Any = [proc.resize(img, *image_size(CONDITION_IMAGE_AREA, img.height, img.width)) for img in images]
            pixels = [proc.preprocess(img, h, w) for img in images]
        else:
            seen = proc.resize(images[0], h, w)
            pixels = [proc.preprocess(seen, h, w)]
        cond: Cond = {}
        for key, words in (("prompt", text), ("negative", NEGATIVE_PROMPT)):
            if key == "negative" and self.guidance_scale <= 1.0:
                break
            emb, mask = self.pipe.encode_prompt(prompt=[words], image=seen, device=self.device, max_sequence_length=1024)
            emb, mask = pad_tokens(emb.to(self.dtype), mask, self.text_len)
            cond.update({f"{key}_embeds": emb, f"{key}_mask": mask})
        cond["image_latents"] = torch.cat([self._image_latents(px) for px in pixels], dim=1)
        return cond

    def _tell_if_stretched(self, text: str, images: list[Any]) -> None:
        """Warn once when an input image's aspect is not the output's: the stock pipelines condition on it at its
        own aspect (and default the output to it); a run's batches need one size, so it is stretched here."""
        want = self.width / self.height
        off = [img for img in images if abs(img.width / img.height / want - 1) > _ASPECT_TOLERANCE]
        if off and not self._told_aspect:
            self._told_aspect = True
            img = off[0]
            log.warning("qwenimage_edit: input image of %dx%d (aspect %.3f) for %r is stretched to the output's "
                        "aspect %.3f (model.resolution = [%d, %d]); the stock pipelines keep an input's aspect and "
                        "make the output the same: set model.resolution to your images' aspect, or crop them "
                        "(said once)", img.width, img.height, img.width / img.height, text[:40], want,
                        self.height, self.width)

    def _image_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[1, 3, H, W]`` in [-1, 1] -> packed normalised latents ``[1, image_tokens, 64]`` (the pipelines' steps)."""
        lat = self.pipe._encode_vae_image(pixels[:, :, None].to(self.device, self.dtype), generator=None)
        return pack_2x2(lat[:, :, 0])

    def save_pretrained(self, path: str | Path) -> None:
        """As :meth:`DiffusersGenerator.save_pretrained`; an attached byte processor is no component and is not saved
        (``model_index.json`` lists ``processor`` as absent, and loading attaches one again)."""
        attached = isinstance(getattr(self.pipe, "processor", None), QwenVLByteProcessor)
        if attached:
            proc = self.pipe.processor
            object.__setattr__(self.pipe, "processor", None)
        try:
            super().save_pretrained(path)
        finally:
            if attached:
                object.__setattr__(self.pipe, "processor", proc)

    # -- the network ----------------------------------------------------------------------------

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided velocity of the noise tokens ``x`` ``[B, N, 64]`` given ``cond`` (with ``image_latents``).

        Raises:
            ValueError: ``sigma`` is not ``[B]``, ``cond`` has no ``image_latents``, or CFG is on without negatives.
        """
        sigma = check_sigma(x, sigma)
        if "image_latents" not in cond:
            raise ValueError("qwenimage_edit: cond has no 'image_latents' (encode prompts that carry input images)")
        img = cond["image_latents"]
        if self.guidance_scale <= 1.0:
            return self.edit_forward(x, sigma, cond["prompt_embeds"], cond["prompt_mask"], img).to(x.dtype)
        if "negative_embeds" not in cond:
            raise ValueError("guidance_scale > 1 needs cond['negative_embeds'] (encode prompts with CFG on)")
        b = x.shape[0]
        out = self.edit_forward(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                torch.cat([cond["prompt_embeds"], cond["negative_embeds"]]),
                                torch.cat([cond["prompt_mask"], cond["negative_mask"]]), torch.cat([img, img])).float()
        return qwen_true_cfg(out[:b], out[b:], self.guidance_scale).to(x.dtype)

    def edit_forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                     image_latents: torch.Tensor) -> torch.Tensor:
        """One plain transformer call over ``[x, image_latents]``; the output's first ``N`` (noise) tokens."""
        k = image_latents.shape[1] // self.image_tokens
        mult = 2 * self.vae_scale_factor
        grid = [(1, self.lat_h // 2, self.lat_w // 2)] + [(1, self.image_hw[0] // mult, self.image_hw[1] // mult)] * k
        dt = self.dtype
        out = self.pipe.transformer(
            hidden_states=torch.cat([x.to(dt), image_latents.to(dt)], dim=1),
            timestep=sigma.to(dt),
            encoder_hidden_states=embeds.to(dt),
            encoder_hidden_states_mask=mask,
            img_shapes=[grid] * x.shape[0],
            return_dict=False,
        )[0]
        return out[:, : x.shape[1]]

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(  # type: ignore[override]
        cls,
        preset: str,
        *,
        path: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        resolution: tuple[int, int] | None = None,
        guidance_scale: float | None = None,
        text_len: int | None = None,
        variant: str = "",
        layers: int = 0,
        text_encoder: str = "model",
        image_area: int | None = None,
    ) -> QwenImageEditModel:
        """Build the ``tiny``/``small`` preset of ``variant``, load ``pretrained`` weights (offline; the checkpoint's
        pipeline class decides the variant), or build the published architecture with ``random`` weights.
        ``image_area``: pixels of each conditioning image (``None``: :func:`conditioning_area`'s default)."""
        cfg = 4.0 if guidance_scale is None else guidance_scale
        if preset == "pretrained":
            import diffusers

            pipe = load_pipeline_offline(diffusers.DiffusionPipeline, path, dtype, device, **_absent_processor(path))
            if type(pipe).__name__ not in ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
                raise ConfigError(f"model.path: {str(path)!r} holds a {type(pipe).__name__}, not a Qwen-Image-Edit "
                                  "pipeline (QwenImageEditPipeline / QwenImageEditPlusPipeline)")
        else:
            from diffusers import FlowMatchEulerDiscreteScheduler

            variant = _variant(variant)
            pipe = preset_pipeline(cls.name, preset, _pipeline_class(variant),
                                   lambda: FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG),
                                   lambda: build_qwenimage_edit_pipeline(preset, seed, variant), path=path,
                                   device=device, dtype=dtype, seed=seed, variant=variant, layers=layers,
                                   text_encoder=text_encoder)
        # real size: the native 1024², and room for the text encoder's image tokens (1369 at 1024², 324 at 512²)
        h, w, length = preset_size(preset, resolution, text_len, real=((1024, 1024), 1536), built_text_len=128)
        return cls(pipe, height=h, width=w, guidance_scale=cfg, text_len=length,
                   image_area=conditioning_area(preset, image_area or 0, h, w))

