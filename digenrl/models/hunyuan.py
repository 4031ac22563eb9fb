"""HunyuanVideo behind the :class:`~digenrl.models.base.GeneratorModel` interface.

Layout (diffusers ``HunyuanVideoPipeline``): ``x`` is the VAE latent ``[B, C, F', H/8, W/8]`` with
``F' = (num_frames − 1)/4 + 1``; ``latent = z · scaling_factor``. The transformer takes
``t = 1000·sigma`` per row. HunyuanVideo is guidance-distilled: one forward with
``guidance = 1000·g`` (g = 6.0 by default, DanceGRPO's value), no CFG.

Text: a Llama hidden state (third from last, the prompt template's prefix cropped) with its
attention mask, plus the pooled CLIP output. The tiny presets pair a byte-level ``LlamaTokenizer``
and ``CLIPTokenizer`` with random ``LlamaModel``/``CLIPTextModel``; the template's crop length is
computed from the tokenizer in use (95 is only right for the real one).
Cond keys: ``prompt_embeds [B, text_len, D]``, ``prompt_mask [B, text_len]``, ``pooled_embeds [B, P]``.

Sigmas: ``FlowMatchEulerDiscreteScheduler`` (static ``shift``, 7.0 in the hub config) applied to
``linspace(1, 0, N+1)[:-1]`` as the pipeline does, then 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from digenrl.errors import ConfigError
from digenrl.models._common import (
    DiffusersGenerator,
    check_num_steps,
    check_prompts,
    check_sigma,
    seeded,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import byte_clip_tokenizer, byte_llama_tokenizer, tiny_clip_text_model, tiny_llama_model
from digenrl.models.base import Cond

__all__ = ["HunyuanVideoModel", "build_hunyuan_pipeline"]

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        transformer=dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                         num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
                         text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        latent=4, vae_channels=(8, 8, 8, 8), groups=4,
    ),
    "small": dict(
        transformer=dict(in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=32, num_layers=2,
                         num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1,
                         text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 12, 12)),
        latent=16, vae_channels=(16, 32, 32, 32), groups=8,
    ),
}


def build_hunyuan_pipeline(preset: str, seed: int) -> Any:
    """A randomly initialised ``HunyuanVideoPipeline`` of the given preset (deterministic in ``seed``)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    p = _PRESETS[preset]
    tcfg = p["transformer"]
    with seeded(seed):
        transformer = HunyuanVideoTransformer3DModel(guidance_embeds=True, **tcfg)
    with seeded(seed + 1):
        vae = AutoencoderKLHunyuanVideo(latent_channels=p["latent"], block_out_channels=p["vae_channels"],
                                        layers_per_block=1, norm_num_groups=p["groups"], spatial_compression_ratio=8,
                                        temporal_compression_ratio=4)
    llama_tok, clip_tok = byte_llama_tokenizer(), byte_clip_tokenizer()
    with seeded(seed + 2):
        llama = tiny_llama_model(tcfg["text_embed_dim"], vocab_size=len(llama_tok))
        clip = tiny_clip_text_model(tcfg["pooled_projection_dim"], vocab_size=len(clip_tok))
    return HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=llama_tok, transformer=transformer, vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=clip, tokenizer_2=clip_tok,
    )


class HunyuanVideoModel(DiffusersGenerator):
    """HunyuanVideo adapter; see the module docstring.

    Args:
        pipe: a ``HunyuanVideoPipeline``.
        height, width: frame size in pixels (multiples of ``8 · patch_size``).
        num_frames: ``4k + 1`` frames; 1 means a single image.
        guidance_scale: the distilled guidance value ``g`` (the transformer receives ``1000·g``).
        text_len: Llama sequence length after the template crop.

    Raises:
        ConfigError: bad frame size or frame count.
    """

    name = "hunyuanvideo"

    def __init__(self, pipe: Any, *, height: int, width: int, num_frames: int = 1, guidance_scale: float = 6.0,
                 text_len: int = 32) -> None:
        super().__init__(pipe, height=height, width=width, num_frames=num_frames, guidance_scale=guidance_scale,
                         text_len=text_len)
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        self.sf_t = pipe.vae_scale_factor_temporal
        self.sf_s = pipe.vae_scale_factor_spatial
        mult = self.sf_s * pipe.transformer.config.patch_size
        if self.height % mult or self.width % mult:
            raise ConfigError(f"model.resolution: height/width must be multiples of {mult}, got {self.height}x{self.width}")
        if self.num_frames < 1 or (self.num_frames - 1) % self.sf_t:
            raise ConfigError(f"model.num_frames must be {self.sf_t}k+1 (1, {self.sf_t + 1}, ...), got {self.num_frames}")
        c = pipe.transformer.config.in_channels
        self.latent_shape = (c, (self.num_frames - 1) // self.sf_t + 1, self.height // self.sf_s, self.width // self.sf_s)
        template = DEFAULT_PROMPT_TEMPLATE["template"]
        # 95 is the crop for the real Llama tokenizer; recompute for whatever tokenizer this pipeline has
        crop = len(pipe.tokenizer(template.split("{}")[0]).input_ids)
        self.prompt_template = {"template": template, "crop_start": crop}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """``prompt_embeds``/``prompt_mask`` (Llama, cropped, ``text_len`` tokens) and ``pooled_embeds`` (CLIP).

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
        """
        check_prompts(prompts)
        emb, pooled, mask = self.pipe.encode_prompt(prompt=list(prompts), prompt_template=self.prompt_template,
                                                    device=self.device, max_sequence_length=self.text_len)
        return {"prompt_embeds": emb.to(self.dtype), "prompt_mask": mask.to(torch.long),
                "pooled_embeds": pooled.to(self.dtype)}

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Gaussian noise ``[batch, C, F', h, w]`` drawn as ``HunyuanVideoPipeline.prepare_latents``."""
        return torch.randn((batch, *self.latent_shape), generator=generator, dtype=torch.float32).to(self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``shift(linspace(1, 0, N+1)[:-1])`` from the scheduler config, then 0: ``[N+1]``."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        check_num_steps(num_steps)
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
        return sched.sigmas.to(torch.float32).clone()

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """One forward with ``guidance = 1000·g`` at per-row ``sigma`` ``[B]``; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``.
        """
        sigma = check_sigma(x, sigma)
        dt = self.dtype
        b = x.shape[0]
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        guidance = torch.full((b,), self.guidance_scale * 1000.0, device=x.device, dtype=dt)
        out = self.pipe.transformer(
            hidden_states=x.to(dt), timestep=t, encoder_hidden_states=cond["prompt_embeds"].to(dt),
            encoder_attention_mask=cond["prompt_mask"], pooled_projections=cond["pooled_embeds"].to(dt),
            guidance=guidance, return_dict=False,
        )[0]
        return out.to(x.dtype)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` for one frame, else ``[B, 3, F, H, W]``, in [0, 1]."""
        vae = self.pipe.vae
        video = vae.decode(x.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        video = (video.float() / 2 + 0.5).clamp(0, 1)
        return video[:, :, 0] if self.num_frames == 1 else video

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
        num_frames: int = 1,
        guidance_scale: float | None = None,
        text_len: int | None = None,
        variant: str = "",
        layers: int = 0,
        text_encoder: str = "model",
    ) -> HunyuanVideoModel:
        """Build the ``tiny``/``small`` preset, load ``pretrained`` weights from ``path`` (offline), or build
        the published architecture with ``random`` weights (``variant``, ``layers``, ``text_encoder``: see
        ``models/_random.py``). ``pretrained`` and ``random`` share their defaults and all after loading."""
        from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

        pipe = preset_pipeline(cls.name, preset, HunyuanVideoPipeline, lambda: FlowMatchEulerDiscreteScheduler(shift=7.0),
                               lambda: build_hunyuan_pipeline(preset, seed), path=path, device=device, dtype=dtype,
                               seed=seed, variant=variant, layers=layers, text_encoder=text_encoder)
        h, w, length = preset_size(preset, resolution, text_len, real=((480, 480), 256), built_text_len=32)
        return cls(pipe, height=h, width=w, num_frames=num_frames,
                   guidance_scale=6.0 if guidance_scale is None else guidance_scale, text_len=length)
