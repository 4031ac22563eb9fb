"""Wan2.1 (text-to-image with one frame, or a few frames of video) behind the GeneratorModel interface.

Layout (diffusers ``WanPipeline``): ``x`` is the unpacked VAE latent ``[B, 16, F', H/8, W/8]`` with
``F' = (num_frames − 1)/4 + 1`` (the transformer patchifies 1×2×2 itself). The transformer takes the
timestep in scheduler units, ``t = 1000·sigma``, per row. Guidance is plain CFG over two branches
(``v_u + w (v_c − v_u)``, w = 4.5 as flow_grpo's Wan config), both in one batched forward; the
negative prompt is ``""``.

Sigmas come from Wan's ``UniPCMultistepScheduler`` config (flow sigmas, ``flow_shift = 3``, final sigma
zero) via ``set_timesteps`` on a private instance; only its sigmas are used, never ``step``: the sampler
is first order on them (Euler at noise level 0), as flow_grpo's Wan sampler, where the stock pipeline
steps UniPC's 2nd-order predictor-corrector. The stock pipeline also feeds the scheduler's int64
timesteps, ``1000·sigma`` truncated (999.999 -> 999); this adapter feeds the exact ``1000·sigma``
so that any per-row sigma (e.g. packed training rows) maps to the same input at rollout and training.
``tests/models/test_oracle.py`` pins both differences against the stock pipeline (UniPC at order 1).

Text: ``UMT5EncoderModel`` (tiny: random, with a byte-level ``T5Tokenizer``); embeddings are
zero-padded to ``text_len`` exactly as the pipeline does (Wan attends to the zero padding, no mask).
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
    decode_causal_vae,
    seeded,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import byte_t5_tokenizer, tiny_umt5_encoder
from digenrl.models.base import Cond

__all__ = ["WanModel", "WAN_SCHEDULER_CONFIG", "build_wan_pipeline"]

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler config (the parts that shape the sigmas)
WAN_SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    final_sigmas_type="zero", solver_order=2, sample_max_value=1.0,
)

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=2),
    "small": dict(num_attention_heads=4, attention_head_dim=24, text_dim=64, ffn_dim=256, num_layers=2),
}

NEGATIVE_PROMPT = ""


def build_wan_pipeline(preset: str, seed: int) -> Any:
    """A randomly initialised ``WanPipeline`` of the given preset (deterministic in ``seed``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    cfg = _PRESETS[preset]
    with seeded(seed):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **cfg,
        )
    with seeded(seed + 1):
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    tok = byte_t5_tokenizer()
    with seeded(seed + 2):
        te = tiny_umt5_encoder(cfg["text_dim"], vocab_size=len(tok))
    return WanPipeline(tokenizer=tok, text_encoder=te, transformer=transformer, vae=vae.eval(),
                       scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG))


class WanModel(DiffusersGenerator):
    """Wan2.1 adapter; see the module docstring.

    Args:
        pipe: a ``WanPipeline``.
        height, width: frame size in pixels (multiples of 16).
        num_frames: ``4k + 1`` frames; 1 means a single image.
        guidance_scale: CFG scale; ``<= 1`` means conditional only.
        text_len: UMT5 sequence length.

    Raises:
        ConfigError: bad frame size or frame count.
    """

    name = "wan21"

    def __init__(self, pipe: Any, *, height: int, width: int, num_frames: int = 1, guidance_scale: float = 4.5,
                 text_len: int = 32) -> None:
        super().__init__(pipe, height=height, width=width, num_frames=num_frames, guidance_scale=guidance_scale,
                         text_len=text_len)
        self.sf_t = pipe.vae.config.scale_factor_temporal
        self.sf_s = pipe.vae.config.scale_factor_spatial
        mult = self.sf_s * pipe.transformer.config.patch_size[1]
        if self.height % mult or self.width % mult:
            raise ConfigError(f"model.resolution: height/width must be multiples of {mult}, got {self.height}x{self.width}")
        if self.num_frames < 1 or (self.num_frames - 1) % self.sf_t:
            raise ConfigError(f"model.num_frames must be {self.sf_t}k+1 (1, {self.sf_t + 1}, ...), got {self.num_frames}")
        self.z_dim = pipe.vae.config.z_dim
        self.latent_shape = (self.z_dim, (self.num_frames - 1) // self.sf_t + 1, self.height // self.sf_s,
                             self.width // self.sf_s)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """``prompt_embeds [B, text_len, D]``; ``negative_embeds`` too when CFG is on.

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
        """
        check_prompts(prompts)
        cfg = self.guidance_scale > 1.0
        emb, _ = self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                         max_sequence_length=self.text_len, device=self.device)
        cond: Cond = {"prompt_embeds": emb.to(self.dtype)}
        if cfg:
            neg, _ = self.pipe.encode_prompt(prompt=[NEGATIVE_PROMPT], do_classifier_free_guidance=False,
                                             max_sequence_length=self.text_len, device=self.device)
            cond["negative_embeds"] = neg.to(self.dtype).expand(len(prompts), -1, -1).contiguous()
        return cond

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Gaussian noise ``[batch, 16, F', h, w]`` drawn as ``WanPipeline.prepare_latents``."""
        return torch.randn((batch, *self.latent_shape), generator=generator, dtype=torch.float32).to(self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The UniPC flow sigmas (``flow_shift`` from the config), ``[N+1]`` ending in 0."""
        from diffusers import UniPCMultistepScheduler

        check_num_steps(num_steps)
        sched = UniPCMultistepScheduler.from_config(self.pipe.scheduler.config)
        sched.set_timesteps(num_steps)
        s = sched.sigmas.to(torch.float32).clone()
        if s.shape != (num_steps + 1,) or s[-1] != 0:
            raise ConfigError("model scheduler: Wan needs final_sigmas_type='zero' and flow sigmas")
        return s

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """CFG velocity at per-row ``sigma`` ``[B]``; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``, or CFG is on and ``cond`` has no negative branch.
        """
        sigma = check_sigma(x, sigma)
        if self.guidance_scale <= 1.0:
            return self.transformer_forward(x, sigma, cond["prompt_embeds"]).to(x.dtype)
        if "negative_embeds" not in cond:
            raise ValueError("guidance_scale > 1 needs cond['negative_embeds'] (encode prompts with CFG on)")
        b = x.shape[0]
        out = self.transformer_forward(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                       torch.cat([cond["prompt_embeds"], cond["negative_embeds"]])).float()
        v_c, v_u = out[:b], out[b:]
        return (v_u + self.guidance_scale * (v_c - v_u)).to(x.dtype)

    def transformer_forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """One plain transformer call with ``t = 1000·sigma`` per row (no guidance)."""
        dt = self.dtype
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        return self.pipe.transformer(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=embeds.to(dt),
                                     return_dict=False)[0]

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` for one frame, else ``[B, 3, F, H, W]``, in [0, 1] (latent de-normalised first)."""
        video = decode_causal_vae(self.pipe.vae, x)
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
    ) -> WanModel:
        """Build the ``tiny``/``small`` preset, load ``pretrained`` weights from ``path`` (offline), or build
        the published architecture with ``random`` weights (``variant``, ``layers``, ``text_encoder``: see
        ``models/_random.py``). ``pretrained`` and ``random`` share their defaults and all after loading."""
        from diffusers import UniPCMultistepScheduler, WanPipeline

        pipe = preset_pipeline(cls.name, preset, WanPipeline, lambda: UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
                               lambda: build_wan_pipeline(preset, seed), path=path, device=device, dtype=dtype,
                               seed=seed, variant=variant, layers=layers, text_encoder=text_encoder)
        h, w, length = preset_size(preset, resolution, text_len, real=((480, 832), 512), built_text_len=32)
        return cls(pipe, height=h, width=w, num_frames=num_frames,
                   guidance_scale=4.5 if guidance_scale is None else guidance_scale, text_len=length)
