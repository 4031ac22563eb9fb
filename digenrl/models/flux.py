"""FLUX.1 behind the :class:`~digenrl.models.base.GeneratorModel` interface.

Layout (diffusers ``FluxPipeline``): the ``AutoencoderKL`` latent ``[B, C, H/8, W/8]`` is packed 2×2 to
``x`` of shape ``[B, (H/16)(W/16), 4C]``, with ``img_ids`` from the latent grid and ``txt_ids = 0``.
The transformer takes ``timestep = sigma`` (the pipeline's ``t/1000``) per row. FLUX.1-dev is
guidance-distilled: one forward pass with the guidance embedding (3.5 by default), no CFG.

Text: CLIP pooled output + T5 sequence (``FluxPipeline.encode_prompt``). The tiny presets pair
byte-level ``CLIPTokenizer``/``T5Tokenizer`` with random ``CLIPTextModel``/``T5EncoderModel``.
Cond keys: ``prompt_embeds [B, text_len, D]`` and ``pooled_embeds [B, P]`` (T5 is unmasked in FLUX).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.models._common import (
    DiffusersGenerator,
    check_num_steps,
    check_prompts,
    check_sigma,
    flow_match_sigmas,
    pack_2x2,
    seeded,
    unpack_2x2,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import byte_clip_tokenizer, byte_t5_tokenizer, tiny_clip_text_model, tiny_t5_encoder
from digenrl.models.base import Cond

__all__ = ["FluxModel", "FLUX_SCHEDULER_CONFIG", "build_flux_pipeline"]

# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
FLUX_SCHEDULER_CONFIG: dict[str, Any] = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, num_train_timesteps=1000,
    shift=3.0, use_dynamic_shifting=True,
)

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        transformer=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                         joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
        latent=4, vae_channels=(8, 8, 8, 8), groups=4,
    ),
    "small": dict(
        transformer=dict(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4,
                         joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=(8, 12, 12)),
        latent=16, vae_channels=(16, 32, 32, 32), groups=8,
    ),
}


def build_flux_pipeline(preset: str, seed: int) -> Any:
    """A randomly initialised ``FluxPipeline`` of the given preset (deterministic in ``seed``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    p = _PRESETS[preset]
    tcfg = p["transformer"]
    with seeded(seed):
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=4 * p["latent"], guidance_embeds=True, **tcfg)
    n = len(p["vae_channels"])
    with seeded(seed + 1):
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=p["latent"], block_out_channels=p["vae_channels"],
            down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
            layers_per_block=1, norm_num_groups=p["groups"], use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.1159, scaling_factor=0.3611,
        )
    clip_tok, t5_tok = byte_clip_tokenizer(), byte_t5_tokenizer()
    with seeded(seed + 2):
        clip = tiny_clip_text_model(tcfg["pooled_projection_dim"], vocab_size=len(clip_tok))
        t5 = tiny_t5_encoder(tcfg["joint_attention_dim"], vocab_size=len(t5_tok))
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG), vae=vae.eval(), text_encoder=clip,
        tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer,
    )


class FluxModel(DiffusersGenerator):
    """FLUX.1 adapter; see the module docstring.

    Args:
        pipe: a ``FluxPipeline``.
        height, width: image size in pixels (multiples of ``2 * vae_scale_factor``).
        guidance_scale: the guidance-embedding value (3.5 for FLUX.1-dev).
        text_len: T5 sequence length (``max_sequence_length`` of the pipeline, ≤ 512).

    Raises:
        ConfigError: bad image size, or a transformer without a guidance embedding.
    """

    name = "flux"

    def __init__(self, pipe: Any, *, height: int, width: int, guidance_scale: float = 3.5, text_len: int = 32) -> None:
        super().__init__(pipe, height=height, width=width, guidance_scale=guidance_scale, text_len=text_len)
        self.vae_scale_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        mult = 2 * self.vae_scale_factor
        if self.height % mult or self.width % mult:
            raise ConfigError(f"model.resolution: height/width must be multiples of {mult}, got {self.height}x{self.width}")
        if not pipe.transformer.config.guidance_embeds:
            raise ConfigError("model: this FLUX transformer has no guidance embedding (FLUX.1-schnell is not supported)")
        self.channels = pipe.transformer.config.in_channels // 4
        self.lat_h = self.height // self.vae_scale_factor
        self.lat_w = self.width // self.vae_scale_factor
        self.latent_shape = ((self.lat_h // 2) * (self.lat_w // 2), 4 * self.channels)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """``prompt_embeds [B, text_len, D]`` (T5) and ``pooled_embeds [B, P]`` (CLIP).

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
        """
        check_prompts(prompts)
        emb, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                 max_sequence_length=self.text_len)
        return {"prompt_embeds": emb.to(self.dtype), "pooled_embeds": pooled.to(self.dtype)}

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Packed Gaussian noise ``[batch, tokens, 4C]`` drawn exactly as ``FluxPipeline.prepare_latents``."""
        noise = torch.randn((batch, self.channels, self.lat_h, self.lat_w), generator=generator, dtype=torch.float32)
        return pack_2x2(noise).to(self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``FluxPipeline``'s schedule: ``linspace(1, 1/N, N)`` with dynamic shift ``mu(seq_len)``, then 0."""
        check_num_steps(num_steps)
        return flow_match_sigmas(self.pipe.scheduler.config, num_steps, image_seq_len=self.latent_shape[0])

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """One forward with the guidance embedding at per-row ``sigma`` ``[B]``; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``.
        """
        sigma = check_sigma(x, sigma)
        dt = self.dtype
        b, L = x.shape[0], cond["prompt_embeds"].shape[1]
        img_ids = self.pipe._prepare_latent_image_ids(b, self.lat_h // 2, self.lat_w // 2, x.device, dt)
        txt_ids = torch.zeros(L, 3, device=x.device, dtype=dt)
        guidance = torch.full((b,), self.guidance_scale, device=x.device, dtype=torch.float32)
        out = self.pipe.transformer(
            hidden_states=x.to(dt), timestep=sigma.to(dt), guidance=guidance,
            pooled_projections=cond["pooled_embeds"].to(dt), encoder_hidden_states=cond["prompt_embeds"].to(dt),
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]
        return out.to(x.dtype)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1]: unpack, ``z / scaling + shift``, VAE decode."""
        vae = self.pipe.vae
        lat = unpack_2x2(x.float(), self.lat_h, self.lat_w).to(vae.dtype)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
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
    ) -> FluxModel:
        """Build the ``tiny``/``small`` preset, load ``pretrained`` weights from ``path`` (offline), or build
        the published architecture with ``random`` weights (``variant``, ``layers``, ``text_encoder``: see
        ``models/_random.py``). ``pretrained`` and ``random`` share their defaults and all after loading."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        pipe = preset_pipeline(cls.name, preset, FluxPipeline, lambda: FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
                               lambda: build_flux_pipeline(preset, seed), path=path, device=device, dtype=dtype,
                               seed=seed, variant=variant, layers=layers, text_encoder=text_encoder)
        h, w, length = preset_size(preset, resolution, text_len, real=((512, 512), 512), built_text_len=32)
        return cls(pipe, height=h, width=w, guidance_scale=3.5 if guidance_scale is None else guidance_scale,
                   text_len=length)
