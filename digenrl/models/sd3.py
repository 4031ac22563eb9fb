"""Stable Diffusion 3.5 (Medium, Large) behind the :class:`~digenrl.models.base.GeneratorModel` interface.

Layout (diffusers ``StableDiffusion3Pipeline``): ``x`` is the ``AutoencoderKL`` latent itself,
``[B, 16, H/8, W/8]`` (the ``SD3Transformer2DModel`` patchifies 2×2 inside). The transformer takes
``timestep = 1000·sigma`` in fp32 per row (the scheduler's ``timesteps``, which is what the pipeline feeds).
Guidance is true CFG with the pipeline's combination, both branches in one ``2B``-row forward in the
pipeline's order (negative rows first), so the adapter computes exactly what the pipeline does::

    v = v_u + w (v_c - v_u)

The negative prompt is ``""`` (the pipeline's default and flow_grpo's ``train_sd3.py``). With
``guidance_scale <= 1`` only the conditional branch runs.

Text: CLIP-L and CLIP-G (``CLIPTextModelWithProjection``) penultimate hidden states concatenated and
zero-padded to the T5 width, followed by T5-XXL's sequence, and the two CLIP projections concatenated as
the pooled vector (``StableDiffusion3Pipeline.encode_prompt``). Cond keys: ``prompt_embeds
[B, 77 + text_len, joint_attention_dim]``, ``pooled_embeds [B, 2048]`` and, with CFG, ``negative_embeds`` /
``negative_pooled_embeds``. ``text_len`` is T5's ``max_sequence_length`` (flow_grpo: 128); T5 is unmasked.

Sigmas: the pipeline's own ``scheduler.set_timesteps(num_inference_steps)`` (no ``sigmas=`` argument:
``linspace`` over the scheduler's ``[t(sigma_max), t(sigma_min)]``, then the static shift 3.0 of the SD3.5
checkpoints), on a private scheduler instance; ``mu`` only if a config turns dynamic shifting on.

Presets: ``tiny`` (2 joint blocks, the first with dual attention as in MMDiT-X, 2 heads × 16, joint dim 32;
8-channel VAE with 16 latent channels; byte-level CLIP/T5 tokenizers with random 2-layer CLIPs and a 1-layer
T5), ``small`` (4 blocks, 2 of them dual, 4 heads × 32, joint dim 64),
``pretrained``, ``random`` and ``full`` (variants ``medium`` and ``large``; ``models/full.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from digenrl.errors import ConfigError
from digenrl.models._common import (
    DiffusersGenerator,
    calculate_shift,
    check_num_steps,
    check_prompts,
    check_sigma,
    seeded,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import byte_clip_tokenizer, byte_t5_tokenizer, tiny_clip_text_model, tiny_t5_encoder
from digenrl.models.base import Cond

__all__ = ["SD3Model", "SD3_SCHEDULER_CONFIG", "build_sd3_pipeline", "sd3_sigmas"]

# stabilityai/stable-diffusion-3.5-medium and -large scheduler/scheduler_config.json
SD3_SCHEDULER_CONFIG: dict[str, Any] = dict(num_train_timesteps=1000, shift=3.0)
# stabilityai/stable-diffusion-3.5-* vae/config.json: 16 latent channels, no quant convs
SD3_VAE_SCALING = dict(scaling_factor=1.5305, shift_factor=0.0609)

NEGATIVE_PROMPT = ""

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        transformer=dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                         caption_projection_dim=32, pooled_projection_dim=24, pos_embed_max_size=32,
                         dual_attention_layers=(0,), qk_norm="rms_norm", sample_size=32),
        # CLIP-L and CLIP-G widths: their hidden states (8 + 16) are zero-padded to T5's 32 (768 + 1280 -> 4096),
        # their projections are the pooled vector (8 + 16 = pooled_projection_dim, as 768 + 1280 = 2048)
        clip=(8, 16), vae_channels=(8, 8, 8, 8), groups=4,
    ),
    "small": dict(
        transformer=dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                         caption_projection_dim=128, pooled_projection_dim=48, pos_embed_max_size=32,
                         dual_attention_layers=(0, 1), qk_norm="rms_norm", sample_size=32),
        clip=(16, 32), vae_channels=(16, 32, 32, 32), groups=8,
    ),
}


def build_sd3_pipeline(preset: str, seed: int) -> Any:
    """A randomly initialised ``StableDiffusion3Pipeline`` of the given preset (deterministic in ``seed``)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    if preset not in _PRESETS:
        raise ConfigError(f"model.preset: sd3 has no preset {preset!r}; allowed: {', '.join(_PRESETS)}, pretrained, "
                          "random (and full for `digenrl plan`)")
    p = _PRESETS[preset]
    tcfg = p["transformer"]
    latent = 16
    with seeded(seed):
        transformer = SD3Transformer2DModel(patch_size=2, in_channels=latent, out_channels=latent, **tcfg)
    n = len(p["vae_channels"])
    with seeded(seed + 1):
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=latent, block_out_channels=p["vae_channels"],
            down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
            layers_per_block=1, norm_num_groups=p["groups"], use_quant_conv=False, use_post_quant_conv=False,
            **SD3_VAE_SCALING,
        )
    clip_l_tok, clip_g_tok, t5_tok = byte_clip_tokenizer(), byte_clip_tokenizer(), byte_t5_tokenizer()
    with seeded(seed + 2):
        clip_l = tiny_clip_text_model(p["clip"][0], vocab_size=len(clip_l_tok), projection=True, layers=2)
    with seeded(seed + 3):
        clip_g = tiny_clip_text_model(p["clip"][1], vocab_size=len(clip_g_tok), projection=True, layers=2)
    with seeded(seed + 4):
        t5 = tiny_t5_encoder(tcfg["joint_attention_dim"], vocab_size=len(t5_tok))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=clip_l, tokenizer=clip_l_tok, text_encoder_2=clip_g, tokenizer_2=clip_g_tok,
        text_encoder_3=t5, tokenizer_3=t5_tok,
    )


def sd3_sigmas(scheduler_config: Any, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The ``num_steps + 1`` sigmas ``StableDiffusion3Pipeline`` samples with, ending in 0.

    A private scheduler from ``scheduler_config`` gets the pipeline's own call, ``set_timesteps(num_steps)``
    (plus ``mu`` from ``image_seq_len`` when the config shifts dynamically, with the pipeline's defaults).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs: dict[str, Any] = {}
    if sched.config.get("use_dynamic_shifting", None):
        kwargs["mu"] = calculate_shift(
            image_seq_len, sched.config.get("base_image_seq_len", 256), sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.16))
    with np.errstate(invalid="ignore", divide="ignore"):
        sched.set_timesteps(num_steps, **kwargs)
    return sched.sigmas.to(torch.float32).clone()


class SD3Model(DiffusersGenerator):
    """Stable Diffusion 3.5 adapter; see the module docstring for layout and guidance.

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (random tiny, random real size, or loaded from local weights).
        height, width: image size in pixels; multiples of ``patch_size * vae_scale_factor`` (16).
        guidance_scale: true-CFG scale ``w`` (flow_grpo's SD3.5-M recipes: 4.5); ``<= 1`` means conditional only.
        text_len: T5 tokens (``max_sequence_length``); the sequence is 77 CLIP tokens plus these.

    Raises:
        ConfigError: the image size is not a multiple of the patch size in pixels.
    """

    name = "sd3"

    def __init__(self, pipe: Any, *, height: int, width: int, guidance_scale: float = 4.5, text_len: int = 128) -> None:
        super().__init__(pipe, height=height, width=width, guidance_scale=guidance_scale, text_len=text_len)
        self.vae_scale_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        self.patch = pipe.transformer.config.patch_size
        mult = self.patch * self.vae_scale_factor
        if self.height % mult or self.width % mult:
            raise ConfigError(f"model.resolution: height/width must be multiples of {mult}, "
                              f"got {self.height}x{self.width}")
        self.channels = pipe.transformer.config.in_channels
        self.lat_h = self.height // self.vae_scale_factor
        self.lat_w = self.width // self.vae_scale_factor
        self.latent_shape = (self.channels, self.lat_h, self.lat_w)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """``prompt_embeds [B, 77 + text_len, D]`` and ``pooled_embeds [B, 2048]``; the ``""`` branch too with CFG.

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
        """
        check_prompts(prompts)
        emb, pooled = self._encode(list(prompts))
        cond: Cond = {"prompt_embeds": emb, "pooled_embeds": pooled}
        if self.guidance_scale > 1.0:
            nemb, npooled = self._encode([NEGATIVE_PROMPT])
            cond["negative_embeds"] = nemb.expand(len(prompts), -1, -1).contiguous()
            cond["negative_pooled_embeds"] = npooled.expand(len(prompts), -1).contiguous()
        return cond

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        emb, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
                                                    do_classifier_free_guidance=False,
                                                    max_sequence_length=self.text_len)
        return emb.to(self.dtype), pooled.to(self.dtype)

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Gaussian noise ``[batch, 16, H/8, W/8]`` drawn exactly as ``StableDiffusion3Pipeline.prepare_latents``."""
        noise = torch.randn((batch, self.channels, self.lat_h, self.lat_w), generator=generator, dtype=torch.float32)
        return noise.to(self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule for ``num_steps`` steps: ``[N+1]``, 1 → 0 with the checkpoint's shift."""
        check_num_steps(num_steps)
        tokens = (self.lat_h // self.patch) * (self.lat_w // self.patch)
        return sd3_sigmas(self.pipe.scheduler.config, num_steps, image_seq_len=tokens)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided velocity at ``x`` ``[B, 16, h, w]`` with per-row ``sigma`` ``[B]``; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``, or CFG is on and ``cond`` has no negative branch.
        """
        sigma = check_sigma(x, sigma)
        b = x.shape[0]
        if self.guidance_scale <= 1.0:
            return self.transformer_forward(x, sigma, cond["prompt_embeds"], cond["pooled_embeds"]).to(x.dtype)
        if "negative_embeds" not in cond:
            raise ValueError("guidance_scale > 1 needs cond['negative_embeds'] (encode prompts with CFG on)")
        # the pipeline's batch order: negative rows first
        out = self.transformer_forward(
            torch.cat([x, x]), torch.cat([sigma, sigma]),
            torch.cat([cond["negative_embeds"], cond["prompt_embeds"]]),
            torch.cat([cond["negative_pooled_embeds"], cond["pooled_embeds"]]),
        ).float()
        v_u, v_c = out[:b], out[b:]
        return (v_u + self.guidance_scale * (v_c - v_u)).to(x.dtype)

    def transformer_forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
                            pooled: torch.Tensor) -> torch.Tensor:
        """One plain transformer call (no guidance). The timestep stays fp32, as the pipeline passes it."""
        dt = self.dtype
        return self.pipe.transformer(
            hidden_states=x.to(dt), timestep=sigma * self.pipe.scheduler.config.num_train_timesteps,
            encoder_hidden_states=embeds.to(dt), pooled_projections=pooled.to(dt), return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1]: ``z / scaling + shift``, VAE decode."""
        vae = self.pipe.vae
        lat = x.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(lat, return_dict=False)[0]
        return (img.float() / 2 + 0.5).clamp(0, 1)

    @classmethod
    def create(
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
    ) -> SD3Model:
        """Build the ``tiny``/``small`` preset, load ``pretrained`` weights from ``path`` (offline), or build the published
        architecture (``variant`` ``medium`` / ``large``) with ``random`` weights (``layers``, ``text_encoder``: see
        ``models/_random.py``). ``pretrained`` and ``random`` share their defaults: 512 px (flow_grpo's SD3.5-M
        resolution) and 128 T5 tokens (its ``max_sequence_length``).

        Raises:
            ConfigError: a preset sd3 does not have, or a bad path / size.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        pipe = preset_pipeline(cls.name, preset, StableDiffusion3Pipeline,
                               lambda: FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
                               lambda: build_sd3_pipeline(preset, seed), path=path, device=device, dtype=dtype,
                               seed=seed, variant=variant, layers=layers, text_encoder=text_encoder)
        h, w, length = preset_size(preset, resolution, text_len, real=((512, 512), 128), built_text_len=16)
        return cls(pipe, height=h, width=w, guidance_scale=4.5 if guidance_scale is None else guidance_scale,
                   text_len=length)
