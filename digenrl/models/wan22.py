"""Wan2.2 behind the GeneratorModel interface: A14B (two experts switched by noise level) and TI2V-5B (one transformer).

Both are diffusers ``WanPipeline``s (diffusers 0.42.1 runs Wan2.2 with ``transformer_2`` and ``boundary_ratio``,
or ``expand_timesteps``); everything not said here is Wan2.1's (``models/wan.py``): CFG over two branches
in one batched forward, the negative prompt ``""``, UMT5 embeddings zero-padded to ``text_len``, the exact
``t = 1000·sigma`` fed per row, the UniPC flow sigmas of the checkpoint's scheduler config.

**A14B** (``variant = "A14B"``, the default). Two transformers of Wan2.1-14B's architecture: the pipeline's
``transformer`` is the *high-noise* expert, ``transformer_2`` the *low-noise* one. ``WanPipeline.__call__``
runs ``transformer`` on every step whose timestep ``t >= boundary_ratio · num_train_timesteps`` (0.875 · 1000
for T2V-A14B) and ``transformer_2`` below, with guidance ``guidance_scale`` / ``guidance_scale_2``
respectively. This adapter decides per *row*, by the row's own sigma, with the same comparison
(``1000·σ >= 1000·boundary_ratio``): a rollout step is one expert for all its rows, as in the pipeline, and a
packed TSP training batch (rows of many steps) is split into each expert's rows, each expert runs on its
rows (its CFG branches in one forward), and the velocities are put back in row order. So a trained
transition always belongs to the expert of its sigma, and its log-prob is recomputed by the network that
sampled it. Which experts train (``model.train_experts``), how they are published, held in memory
(``model.expert_offload``) and where the SDE window lies (``rollout.window_expert``): see
``digenrl/models/experts.py`` and the README's Wan2.2 section.

**TI2V-5B** (``variant = "TI2V-5B"``). One transformer (in/out 48 channels) over the Wan2.2 VAE: 48 latent
channels, 16x spatial compression (``AutoencoderKLWan`` with ``is_residual``, ``patch_size = 2``,
``scale_factor_spatial = 16``), so a latent is ``[B, 48, F', H/16, W/16]`` and sizes are multiples of 32. The
pipeline sets ``expand_timesteps`` (per-token timesteps, for image conditioning); in text-to-video every
token has the row's timestep, and the adapter feeds the same value once per row (the transformer's
per-token path computes the same embedding for every token: equal within fp32 rounding, which
``tests/models/test_oracle.py`` checks against the stock pipeline).

Guidance follows ``WanPipeline``: both CFG branches run when ``guidance_scale > 1`` (the high-noise scale
decides, as the pipeline's ``do_classifier_free_guidance``), each expert combining them with its own scale.
Sources of the constants: diffusers ``scripts/convert_wan_to_diffusers.py`` (the Diffusers checkpoints'
scheduler ``flow_shift`` 3.0 for T2V-A14B and 5.0 for TI2V-5B, ``boundary_ratio = 0.875``, the TI2V VAE) and
Wan-Video/Wan2.2 ``wan/configs`` (guidance (4.0 high, 3.0 low) for T2V-A14B, 5.0 for TI2V-5B; 1280x704 for
TI2V-5B). The official repository samples T2V-A14B with shift 12; a checkpoint's own scheduler config
decides for ``pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from digenrl.errors import ConfigError
from digenrl.models._common import check_sigma, load_pipeline_offline, seeded
from digenrl.models._presets import preset_pipeline, preset_size
from digenrl.models._random import SECOND_EXPERT_SEED
from digenrl.models._text import byte_t5_tokenizer, tiny_umt5_encoder
from digenrl.models.base import Cond, index_cond
from digenrl.models.experts import ExpertSet
from digenrl.models.wan import _PRESETS, WanModel

__all__ = ["Wan22Model", "WAN22_VARIANTS", "TRAIN_EXPERTS", "build_wan22_pipeline", "wan22_scheduler_config",
           "wan22_pipeline_kwargs"]

WAN22_VARIANTS: tuple[str, ...] = ("TI2V-5B", "A14B")  # smallest first; "" = the largest (A14B)
TRAIN_EXPERTS: tuple[str, ...] = ("both", "high", "low")

_UNIPC = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
              final_sigmas_type="zero", solver_order=2, sample_max_value=1.0)
_FLOW_SHIFT = {"A14B": 3.0, "TI2V-5B": 5.0}
_PIPELINE = {"A14B": dict(boundary_ratio=0.875), "TI2V-5B": dict(expand_timesteps=True)}
_GUIDANCE = {"A14B": (4.0, 3.0), "TI2V-5B": (5.0, 5.0)}  # (high-noise / only expert, low-noise expert)
_RESOLUTION = {"A14B": (480, 832), "TI2V-5B": (704, 1280)}
_TINY_VAE: dict[str, dict[str, Any]] = {
    "A14B": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "TI2V-5B": dict(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                    patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4),
}


def _variant(variant: str) -> str:
    variant = variant or WAN22_VARIANTS[-1]
    if variant not in WAN22_VARIANTS:
        raise ConfigError(f"model.variant: wan22 has no variant {variant!r}; allowed: {', '.join(WAN22_VARIANTS)}")
    return variant


def wan22_scheduler_config(variant: str = "") -> dict[str, Any]:
    """The UniPC scheduler config of a Wan2.2 Diffusers checkpoint (``flow_shift`` 3.0 for A14B, 5.0 for TI2V-5B)."""
    return dict(_UNIPC, flow_shift=_FLOW_SHIFT[_variant(variant)])


def wan22_pipeline_kwargs(variant: str = "") -> dict[str, Any]:
    """``WanPipeline`` init arguments beyond the components: ``boundary_ratio`` (A14B) or ``expand_timesteps`` (TI2V-5B)."""
    return dict(_PIPELINE[_variant(variant)])


def build_wan22_pipeline(preset: str, seed: int, variant: str = "") -> Any:
    """A randomly initialised Wan2.2 ``WanPipeline`` of the tiny/small preset (deterministic in ``seed``).

    A14B: two experts of Wan's tiny architecture, ``transformer`` from ``seed`` and ``transformer_2`` from
    ``seed + SECOND_EXPERT_SEED``, over Wan2.1's (tiny) VAE. TI2V-5B: one transformer with 48 channels over a
    tiny Wan2.2 VAE (48 latent channels, 16x spatial).
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from digenrl.models.full import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

    variant = _variant(variant)
    channels = 48 if variant == "TI2V-5B" else 16

    def expert(s: int) -> Any:
        with seeded(s):
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), in_channels=channels, out_channels=channels, freq_dim=256, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **_PRESETS[preset])

    vae_kwargs = dict(_TINY_VAE[variant])
    if variant == "TI2V-5B":
        vae_kwargs.update(latents_mean=list(WAN22_LATENTS_MEAN), latents_std=list(WAN22_LATENTS_STD))
    transformer = expert(seed)
    with seeded(seed + 1):
        vae = AutoencoderKLWan(**vae_kwargs)
    tok = byte_t5_tokenizer()
    with seeded(seed + 2):
        te = tiny_umt5_encoder(_PRESETS[preset]["text_dim"], vocab_size=len(tok))
    extra = {"transformer_2": expert(seed + SECOND_EXPERT_SEED)} if variant == "A14B" else {}
    return WanPipeline(tokenizer=tok, text_encoder=te, transformer=transformer, vae=vae.eval(),
                       scheduler=UniPCMultistepScheduler(**wan22_scheduler_config(variant)),
                       **extra, **wan22_pipeline_kwargs(variant))


class Wan22Model(WanModel):
    """Wan2.2 adapter; see the module docstring.

    Args:
        pipe: a Wan2.2 ``WanPipeline`` (A14B: ``transformer_2`` and ``boundary_ratio`` set).
        height, width, num_frames, text_len: as :class:`~digenrl.models.wan.WanModel`.
        guidance_scale: CFG scale of the high-noise expert (the only expert of TI2V-5B).
        guidance_scale_2: CFG scale of the low-noise expert; ``None`` = ``guidance_scale`` (as the pipeline).
        train_experts: ``"both"``, ``"high"`` or ``"low"``: the experts ``model.transformer`` holds (what LoRA
            and the optimizer train); the others stay frozen. A one-transformer variant: ``"both"`` only.
        expert_offload: keep only the expert that runs on the device; the other's frozen weights wait in host
            memory (moved when a row of the other expert comes). Trained parameters (LoRA, a fully fine-tuned
            expert) never move.

    Raises:
        ConfigError: bad frame size or count, an unknown ``train_experts``, or ``train_experts`` /
            ``expert_offload`` for a one-transformer pipeline.
    """

    name = "wan22"

    def __init__(self, pipe: Any, *, height: int, width: int, num_frames: int = 1, guidance_scale: float = 4.0,
                 guidance_scale_2: float | None = None, text_len: int = 32, train_experts: str = "both",
                 expert_offload: bool = False) -> None:
        if pipe.transformer is None:
            raise ConfigError("model.path: this Wan2.2 pipeline has no `transformer` (high-noise expert)")
        super().__init__(pipe, height=height, width=width, num_frames=num_frames, guidance_scale=guidance_scale,
                         text_len=text_len)
        two = pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None
        self.experts: tuple[str, ...] = ("transformer", "transformer_2") if two else ("transformer",)
        self.boundary_ratio: float | None = float(pipe.config.boundary_ratio) if two else None
        self.guidance_scale_2 = float(guidance_scale if guidance_scale_2 is None else guidance_scale_2)
        if train_experts not in TRAIN_EXPERTS:
            raise ConfigError(f"model.train_experts: unknown value {train_experts!r}; allowed: {', '.join(TRAIN_EXPERTS)}")
        if not two and (train_experts != "both" or expert_offload):
            key = "model.train_experts" if train_experts != "both" else "model.expert_offload"
            raise ConfigError(f"{key}: this Wan2.2 pipeline has one transformer (TI2V-5B), no experts to choose "
                              "or swap; use the defaults (train_experts = 'both', expert_offload = false)")
        self.train_experts = train_experts
        self.expert_offload = bool(expert_offload)
        self.offload_device = torch.device("cpu")  # where an idle expert's frozen weights wait
        self.swaps = 0  # expert swaps made (expert_offload): each moves one expert's frozen weights each way
        self._home = super().device
        self._experts: ExpertSet | None = None
        if two:
            trained = {"both": self.experts, "high": ("transformer",), "low": ("transformer_2",)}[train_experts]
            for name in self.experts:
                if name not in trained:
                    getattr(pipe, name).requires_grad_(False)
            self._experts = ExpertSet({name: getattr(pipe, name) for name in trained})
            self._experts.home = self._home if expert_offload else None
        self._resident = self.experts[0]
        if self.expert_offload:
            self._move(self.experts[1], self.offload_device, everything=True)  # before anything is trained

    # -- what trains ------------------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        """What LoRA attaches to and the optimizer trains: the :class:`ExpertSet` of the trained experts (A14B),
        or the one transformer (TI2V-5B)."""
        return self._experts if self._experts is not None else self.pipe.transformer

    @transformer.setter
    def transformer(self, module: torch.nn.Module) -> None:
        # lora.reference() swaps the frozen reference copy in for full fine-tuning
        if self._experts is not None:
            self._experts = module  # type: ignore[assignment]
        else:
            self.pipe.transformer = module

    def expert(self, name: str) -> torch.nn.Module:
        """The module that runs expert ``name`` now: the trained one (or its reference copy), else the frozen one."""
        if self._experts is not None and name in self._experts._modules:
            return self._experts._modules[name]  # type: ignore[return-value]
        return getattr(self.pipe, name)

    @property
    def device(self) -> torch.device:
        """The device the model computes on: its transformer's, or (``expert_offload``) where the resident
        expert computes while the idle one's frozen weights wait on the host."""
        return self._home if self.expert_offload else super().device

    # -- which expert -----------------------------------------------------------------------------
    def expert_of(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's expert, ``[B]`` long: 0 (``transformer``, high noise) where ``1000·σ >= 1000·boundary_ratio``
        (the pipeline's ``t >= boundary_timestep``), else 1 (``transformer_2``); all 0 without experts."""
        sigma = torch.as_tensor(sigma)
        if self.boundary_ratio is None:
            return torch.zeros(sigma.shape, dtype=torch.long, device=sigma.device)
        n = self.pipe.scheduler.config.num_train_timesteps
        return (sigma.float() * n < self.boundary_ratio * n).long()

    def boundary_step(self, num_steps: int) -> int:
        """The first of ``num_steps`` denoising steps that the low-noise expert runs (``num_steps``: none does)."""
        return int((self.expert_of(self.sigmas(num_steps)[:-1]) == 0).sum())

    def guidance_of(self, name: str) -> float:
        """The CFG scale expert ``name`` combines its branches with."""
        return self.guidance_scale_2 if name == "transformer_2" else self.guidance_scale

    # -- velocity ---------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided velocity at per-row ``sigma`` ``[B]``, each row by the expert of its own sigma; same dtype as ``x``.

        Raises:
            ValueError: ``sigma`` is not ``[B]``, or CFG is on and ``cond`` has no negative branch.
            RuntimeError: rows of both experts under autograd with ``expert_offload`` (the trainer groups its
                passes by expert then; a swap inside a graph would move weights its backward still reads).
        """
        sigma = check_sigma(x, sigma)
        if self.guidance_scale > 1.0 and "negative_embeds" not in cond:
            raise ValueError("guidance_scale > 1 needs cond['negative_embeds'] (encode prompts with CFG on)")
        if len(self.experts) == 1:
            return self._guided(self.experts[0], x, sigma, cond)
        index = self.expert_of(sigma)
        groups = [(name, (index == k).nonzero().flatten()) for k, name in enumerate(self.experts)]
        groups = [(name, rows) for name, rows in groups if rows.numel()]
        if len(groups) == 1:
            return self._guided(groups[0][0], x, sigma, cond)
        if self.expert_offload and torch.is_grad_enabled():
            raise RuntimeError("model.expert_offload: a pass with gradients mixes rows of both experts; group rows "
                               "by expert (digenrl.models.experts.expert_rows) before the forward")
        outs = [self._guided(name, x[rows], sigma[rows], index_cond(cond, rows)) for name, rows in groups]
        order = torch.cat([rows for _, rows in groups])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return torch.cat(outs)[inverse]

    def _guided(self, name: str, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """One expert's CFG velocity over its rows (both branches in one forward when CFG is on)."""
        if self.guidance_scale <= 1.0:
            return self.transformer_forward(x, sigma, cond["prompt_embeds"], expert=name).to(x.dtype)
        b = x.shape[0]
        out = self.transformer_forward(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                       torch.cat([cond["prompt_embeds"], cond["negative_embeds"]]), expert=name).float()
        v_c, v_u = out[:b], out[b:]
        return (v_u + self.guidance_of(name) * (v_c - v_u)).to(x.dtype)

    def transformer_forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
                            expert: str = "transformer") -> torch.Tensor:
        """One plain call of expert ``expert`` with ``t = 1000·sigma`` per row (no guidance)."""
        self._use(expert)
        dt = self.dtype
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        return self.expert(expert)(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=embeds.to(dt),
                                   return_dict=False)[0]

    # -- expert_offload ---------------------------------------------------------------------------
    def _use(self, name: str) -> None:
        """Make expert ``name`` resident (``expert_offload``): the other's frozen weights go to the host first."""
        if not self.expert_offload or name == self._resident:
            return
        self._move(self._resident, self.offload_device)
        self._move(name, self._home, everything=True)
        self._resident = name
        self.swaps += 1

    def _move(self, name: str, device: torch.device, everything: bool = False) -> None:
        """Move expert ``name``'s parameters and buffers to ``device``: all of them (``everything``: coming back,
        or at construction), else only the frozen ones (LoRA and trained parameters stay by their optimizer)."""
        module = self.expert(name)
        with torch.no_grad():
            for pname, p in module.named_parameters():
                keep = not everything and (p.requires_grad or "lora_" in pname)
                if not keep and p.device != device:
                    p.data = p.data.to(device)
            for sub in module.modules():
                for key, buf in sub._buffers.items():
                    if buf is not None and buf.device != device:
                        sub._buffers[key] = buf.to(device)

    # -- construction -----------------------------------------------------------------------------
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
        num_frames: int = 1,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        text_len: int | None = None,
        variant: str = "",
        layers: int = 0,
        text_encoder: str = "model",
        train_experts: str = "both",
        expert_offload: bool = False,
    ) -> Wan22Model:
        """Build the ``tiny``/``small`` preset of ``variant`` (``""`` = A14B), load ``pretrained`` weights from
        ``path`` (offline; the checkpoint decides the variant: two experts or one), or build the published
        architecture with ``random`` weights. Guidance and size default to the variant's published ones."""
        from diffusers import UniPCMultistepScheduler, WanPipeline

        if preset == "pretrained":
            # with expert_offload the low-noise expert never visits the device before it is needed
            pipe = load_pipeline_offline(WanPipeline, path, dtype, "cpu" if expert_offload else device)
            if expert_offload:
                for name, part in pipe.components.items():
                    if isinstance(part, torch.nn.Module) and name != "transformer_2":
                        part.to(device)
            variant = "A14B" if pipe.transformer_2 is not None else "TI2V-5B"
        else:
            variant = _variant(variant)
            pipe = preset_pipeline(cls.name, preset, WanPipeline,
                                   lambda: UniPCMultistepScheduler(**wan22_scheduler_config(variant)),
                                   lambda: build_wan22_pipeline(preset, seed, variant), path=path, device=device,
                                   dtype=dtype, seed=seed, variant=variant, layers=layers, text_encoder=text_encoder,
                                   pipeline_kwargs=wan22_pipeline_kwargs(variant))
        h, w, length = preset_size(preset, resolution, text_len, real=(_RESOLUTION[variant], 512), built_text_len=32)
        g_high, g_low = _GUIDANCE[variant]
        g = g_high if guidance_scale is None else guidance_scale
        g2 = g_low if guidance_scale_2 is None and guidance_scale is None else guidance_scale_2
        return cls(pipe, height=h, width=w, num_frames=num_frames, guidance_scale=g, guidance_scale_2=g2,
                   text_len=length, train_experts=train_experts, expert_offload=expert_offload)
