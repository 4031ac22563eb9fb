"""Qwen-Image behind the :class:`~digenrl.models.base.GeneratorModel` interface (the default model).

Layout (diffusers ``QwenImagePipeline``): the VAE latent ``[B, 16, 1, H/8, W/8]`` is packed in 2×2
patches to ``x`` of shape ``[B, (H/16)(W/16), 64]``; the transformer takes ``timestep = sigma`` (the
pipeline's ``t/1000``) per row and ``img_shapes`` per row. Guidance is true CFG with the per-token
norm rescale of the pipeline::

    v = v_u + w (v_c - v_u);   v <- v * ||v_c|| / ||v||      (norms over the packed channel dim)

Both branches run in one batched forward of ``2B`` rows. The negative prompt is ``" "`` as in
flow_grpo. With ``guidance_scale <= 1`` only the conditional branch runs.

Presets (FEASIBILITY §2): ``tiny`` = "tiny8x" (2 layers, 4 heads × 16, joint dim 32; VAE base_dim 8,
z=16; byte ``Qwen2Tokenizer`` + a 2-layer Qwen2.5-VL text path of width 32), ``small`` = "small8x"
(4 layers, 4 × 32, joint dim 64). Both use the real Qwen-Image scheduler config (exponential dynamic
shift, ``shift_terminal = 0.02``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from digenrl.models._common import (
    DiffusersGenerator,
    check_num_steps,
    check_prompts,
    check_sigma,
    decode_causal_vae,
    flow_match_sigmas,
    pack_2x2,
    pad_tokens,
    seeded,
    unpack_2x2,
)
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._text import byte_qwen2_tokenizer, tiny_qwen25vl_text_encoder
from digenrl.models.base import Cond

__all__ = ["QwenImageModel", "QWEN_SCHEDULER_CONFIG", "build_qwenimage_pipeline"]

# The scheduler config shipped with Qwen/Qwen-Image (scheduler/scheduler_config.json).
QWEN_SCHEDULER_CONFIG: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(8, 4, 4)),
    "small": dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12)),
}
# "tiny4x": the tiny transformer over a VAE with one downsampling stage fewer (4x): at 32 px an 8x8
# latent, 16 image tokens instead of 4, so the transformer can place a form, not only a blob.
_PRESETS["tiny4x"] = _PRESETS["tiny"]
_VAE_STAGES: dict[str, dict[str, list]] = {
    "8x": dict(dim_mult=[1, 1, 1, 1], temperal_downsample=[False, True, True]),
    "4x": dict(dim_mult=[1, 1, 1], temperal_downsample=[False, True]),
}
_PRESET_VAE = {"tiny": "8x", "small": "8x", "tiny4x": "4x"}

NEGATIVE_PROMPT = " "


def build_qwenimage_pipeline(preset: str, seed: int) -> Any:
    """A randomly initialised ``QwenImagePipeline`` of the given preset (deterministic in ``seed``)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    cfg = _PRESETS[preset]
    z = 16
    with seeded(seed):
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z, out_channels=z, guidance_embeds=False, **cfg
        )
    with seeded(seed + 1):
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=z, num_res_blocks=1, **_VAE_STAGES[_PRESET_VAE[preset]],
            latents_mean=[0.0] * z, latents_std=[1.0] * z,
        )
    with seeded(seed + 2):
        text_encoder = tiny_qwen25vl_text_encoder(hidden_size=cfg["joint_attention_dim"])
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder,
        tokenizer=byte_qwen2_tokenizer(),
        transformer=transformer,
    )


class QwenImageModel(DiffusersGenerator):
    """Qwen-Image adapter; see the module docstring for layout and guidance.

    Args:
        pipe: a ``QwenImagePipeline`` (random tiny, or loaded from local weights).
        height, width: image size in pixels; multiples of ``2 * vae_scale_factor`` (16 at 8×).
        guidance_scale: true-CFG scale ``w`` (flow_grpo uses 4.0); ``<= 1`` means conditional only.
        text_len: prompt embeddings are padded/truncated to this many tokens (masked), so that
            conditionings of different batches concatenate.

    Raises:
        ConfigError: the image size is not a multiple of the packed patch size.
    """

    name = "qwenimage"

    def __init__(self, pipe: Any, *, height: int, width: int, guidance_scale: float = 4.0, text_len: int = 64) -> None:
        super().__init__(pipe, height=height, width=width, guidance_scale=guidance_scale, text_len=text_len)
        from digenrl.errors import ConfigError

        self.vae_scale_factor = 2 ** len(pipe.vae.temperal_downsample)
        mult = 2 * self.vae_scale_factor
        if self.height % mult or self.width % mult:
            raise ConfigError(f"model.resolution: height/width must be multiples of {mult}, got {self.height}x{self.width}")
        self.z_dim = pipe.vae.config.z_dim
        self.lat_h = self.height // self.vae_scale_factor
        self.lat_w = self.width // self.vae_scale_factor
        self.latent_shape = ((self.lat_h // 2) * (self.lat_w // 2), 4 * self.z_dim)
        # The pipeline's default drop index (34) is specific to the real tokenizer; computing it from
        # the tokenizer in use makes the byte-level tiny tokenizer drop exactly the template, too.
        prefix = pipe.prompt_template_encode.split("{}")[0]
        pipe.prompt_template_encode_start_idx = len(pipe.tokenizer(prefix).input_ids)

    # -- GeneratorModel -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """``prompt_embeds [B, text_len, D]`` + ``prompt_mask [B, text_len]``; negatives too when CFG is on.

        Raises:
            ValueError: ``prompts`` is empty or not a list of strings.
        """
        check_prompts(prompts)
        device = self.device
        # the pipeline encodes up to 1024 tokens anyway; truncating here lets pad_tokens warn about it
        emb, mask = self.pipe.encode_prompt(prompt=list(prompts), device=device, max_sequence_length=1024)
        emb, mask = pad_tokens(emb.to(self.dtype), mask, self.text_len)
        cond: Cond = {"prompt_embeds": emb, "prompt_mask": mask}
        if self.guidance_scale > 1.0:
            nemb, nmask = self.pipe.encode_prompt(prompt=[NEGATIVE_PROMPT], device=device, max_sequence_length=1024)
            nemb, nmask = pad_tokens(nemb.to(self.dtype), nmask, self.text_len)
            cond["negative_embeds"] = nemb.expand(len(prompts), -1, -1).contiguous()
            cond["negative_mask"] = nmask.expand(len(prompts), -1).contiguous()
        return cond

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Packed Gaussian noise ``[batch, tokens, 4·z]`` drawn exactly as ``QwenImagePipeline.prepare_latents``."""
        noise = torch.randn((batch, 1, self.z_dim, self.lat_h, self.lat_w), generator=generator, dtype=torch.float32)
        return pack_2x2(noise[:, 0]).to(self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule for ``num_steps`` steps at this resolution: ``[N+1]``, 1 → 0.02 → 0.

        Raises:
            ValueError: ``num_steps < 2`` (``shift_terminal`` makes the stock one-step schedule NaN).
        """
        check_num_steps(num_steps)
        return flow_match_sigmas(self.pipe.scheduler.config, num_steps, image_seq_len=self.latent_shape[0])

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided velocity at ``x`` ``[B, tokens, 64]`` with per-row ``sigma`` ``[B]``; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``, or CFG is on and ``cond`` has no negative branch.
        """
        sigma = check_sigma(x, sigma)
        b = x.shape[0]
        if self.guidance_scale <= 1.0:
            return self.transformer_forward(x, sigma, cond["prompt_embeds"], cond["prompt_mask"]).to(x.dtype)
        if "negative_embeds" not in cond:
            raise ValueError("guidance_scale > 1 needs cond['negative_embeds'] (encode prompts with CFG on)")
        out = self.transformer_forward(
            torch.cat([x, x]),
            torch.cat([sigma, sigma]),
            torch.cat([cond["prompt_embeds"], cond["negative_embeds"]]),
            torch.cat([cond["prompt_mask"], cond["negative_mask"]]),
        ).float()
        v_c, v_u = out[:b], out[b:]
        return qwen_true_cfg(v_c, v_u, self.guidance_scale).to(x.dtype)

    def transformer_forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One plain transformer call (no guidance): the conditional output for ``embeds``."""
        b = x.shape[0]
        img_shapes = [[(1, self.lat_h // 2, self.lat_w // 2)]] * b
        dt = self.dtype
        return self.pipe.transformer(
            hidden_states=x.to(dt),
            timestep=sigma.to(dt),
            encoder_hidden_states=embeds.to(dt),
            encoder_hidden_states_mask=mask,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1]: unpack, undo the per-channel latent normalisation, VAE decode."""
        img = decode_causal_vae(self.pipe.vae, unpack_2x2(x.float(), self.lat_h, self.lat_w)[:, :, None])[:, :, 0]
        return (img.float() / 2 + 0.5).clamp(0, 1)

    # -- construction ---------------------------------------------------------------------------

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
    ) -> QwenImageModel:
        """Build the ``tiny``/``small`` preset, load ``pretrained`` weights from ``path`` (offline), or build
        the published architecture with ``random`` weights (``variant``, ``layers``, ``text_encoder``: see
        ``models/_random.py``). ``pretrained`` and ``random`` share their defaults and all after loading."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        pipe = preset_pipeline(cls.name, preset, QwenImagePipeline,
                               lambda: FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG),
                               lambda: build_qwenimage_pipeline(preset, seed), path=path, device=device, dtype=dtype,
                               seed=seed, variant=variant, layers=layers, text_encoder=text_encoder)
        h, w, length = preset_size(preset, resolution, text_len, real=((512, 512), 512), built_text_len=32)
        return cls(pipe, height=h, width=w, guidance_scale=4.0 if guidance_scale is None else guidance_scale,
                   text_len=length)


def qwen_true_cfg(v_c: torch.Tensor, v_u: torch.Tensor, scale: float) -> torch.Tensor:
    """``v_u + w (v_c − v_u)`` rescaled per token to the conditional branch's norm (over the last dim)."""
    comb = v_u + scale * (v_c - v_u)
    return comb * (torch.linalg.vector_norm(v_c, dim=-1, keepdim=True) / torch.linalg.vector_norm(comb, dim=-1, keepdim=True))
