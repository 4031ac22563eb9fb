"""What a config's training algorithm adds to each trained row and ships per sample, as the numbers the simulator
and the memory plan price (DESIGN.md §10). The algorithm says them itself (``digenrl/algorithms``: ``coupled``,
``kl_weight``, ``nograd_forwards``, ``slow_copies``); this module turns them into the simulator's terms.

Per trained row (a transition of Flow-GRPO, a noise level of DiffusionNFT or AWM) the trainer runs the trained
velocity's forward + backward, and beside it the no-grad forwards of the loss:

* ``flow_grpo``: the reference's velocity when ``train.kl_beta > 0``;
* ``nft``: the old policy's, always, and the reference's when ``nft.kl_beta > 0``;
* ``awm``: the reference's when ``awm.kl_beta > 0``, and the EMA policy's when ``awm.ema_beta > 0`` or the schedule
  trains one-step-stale samples (their ratio is against the EMA policy's log-prob, computed on the trainer).

What crosses from the rollout to the trainer per sample: Flow-GRPO ships each trained transition's two fp32
latents (x_i, x_{i+1}) with its scalars (sample and step index, sigma, next sigma, behaviour log-prob, noise
level); a forward-process method ships the clean fp32 latent once. Both ship the conditioning (the prompt
embeddings, the negative prompt's under CFG) once per sample and an fp32 reward. The sizes come from the model
as the memory plan builds it on the meta device: the VAE's latent grid and the transformer's text width.

NFT and AWM also keep a slow copy of the trained weights on every trainer (the old or the EMA policy,
``slow_copies``): a second LoRA adapter, or with full fine-tuning a second copy of the transformer in the trained
weights' dtype, which the memory plan counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from digenrl.algorithms import algorithm_class
from digenrl.config import Config
from digenrl.sim.profiles import ARCH_OF_MODEL, RowCost, clean_sample_rows, conditioning_bytes, sample_bytes
from digenrl.sim.window import SlidingWindow

__all__ = ["Boundary", "boundary", "coupled", "kl_beta", "latent_bytes", "nograd_forwards", "rollout_window", "row_cost",
           "slow_copies", "text_tokens"]

FP32 = 4


def coupled(cfg: Config) -> bool:
    """The rollout ships SDE transitions (Flow-GRPO) rather than clean samples."""
    return algorithm_class(cfg.train.algorithm).coupled


def kl_beta(cfg: Config) -> float:
    """The weight of the algorithm's KL to the reference (its forward runs, and full fine-tuning keeps a frozen
    reference copy, only when > 0)."""
    return algorithm_class(cfg.train.algorithm).kl_weight(cfg)


def _stale(cfg: Config) -> bool:
    from digenrl.schedule.options import PRESETS

    return max(PRESETS[cfg.schedule.name].staleness, cfg.schedule.staleness) >= 1


def nograd_forwards(cfg: Config) -> int:
    """Velocity forwards without gradient per trained row (module docstring), each of the row's CFG passes."""
    return algorithm_class(cfg.train.algorithm).nograd_forwards(cfg, _stale(cfg))


def slow_copies(cfg: Config) -> int:
    """Copies of the trained weights that follow them slowly on each trainer: DiffusionNFT's old policy, AWM's EMA."""
    return algorithm_class(cfg.train.algorithm).slow_copies


def rollout_window(cfg: Config) -> SlidingWindow | None:
    """A sliding window whose rollout forwards move with the version (MixGRPO), priced per token; None: every step
    of the grid runs a forward."""
    window = algorithm_class(cfg.train.algorithm).rollout_window(cfg)
    return window if isinstance(window, SlidingWindow) else None


def row_cost(cfg: Config) -> RowCost:
    """The simulator's numbers for ``cfg``'s algorithm (``sim.profiles.RowCost``)."""
    forwards = nograd_forwards(cfg)
    return RowCost(float(forwards)) if coupled(cfg) else clean_sample_rows(forwards)


def _vae_factor(vae_config: dict[str, Any]) -> int:
    """Spatial compression of the VAE as the adapters read it (``models/*.py``: ``vae_scale_factor``)."""
    if vae_config.get("scale_factor_spatial"):  # Wan2.2 TI2V-5B's VAE
        return int(vae_config["scale_factor_spatial"])
    if vae_config.get("temperal_downsample") is not None:  # Qwen-Image, Wan2.1
        return 2 ** len(vae_config["temperal_downsample"])
    if vae_config.get("spatial_compression_ratio"):  # HunyuanVideo
        return int(vae_config["spatial_compression_ratio"])
    if vae_config.get("block_out_channels"):  # AutoencoderKL: SD3.5, FLUX.1
        return 2 ** (len(vae_config["block_out_channels"]) - 1)
    return 8


def latent_bytes(cfg: Config, vae: Any) -> int:
    """fp32 bytes of one sample's latent at the config's resolution and frames (the rollout's latents are fp32)."""
    c = dict(vae.config)
    channels = int(c.get("z_dim") or c.get("latent_channels") or 16)
    s = _vae_factor(c)
    h, w = cfg.model.resolution
    frames = (cfg.model.num_frames - 1) // 4 + 1 if cfg.model.num_frames > 1 else 1
    return FP32 * channels * frames * (h // s) * (w // s)


def text_tokens(cfg: Config, text_len: int) -> int:
    """Tokens of one prompt's embeddings: SD3.5's 77 CLIP tokens come before its ``text_len`` T5 ones."""
    return text_len + (77 if cfg.model.name == "sd3" else 0)


@dataclass(frozen=True)
class Boundary:
    """Bytes one sample moves from the rollout to the trainer under the config's algorithm, beside what Flow-GRPO
    would move for the same model (its trained transitions under the config's ``[rollout]`` step selection).

    Attributes:
        latent: one fp32 latent.
        conditioning: the sample's conditioning (prompt embeddings, CFG's negative ones, masks).
        rows: rows trained per sample under the config's algorithm.
        bytes: per sample under the config's algorithm.
        flow_grpo_rows: transitions Flow-GRPO trains per sample.
        flow_grpo_bytes: per sample under Flow-GRPO.
        coupled: the config's algorithm ships transitions (it is Flow-GRPO).
    """

    latent: int
    conditioning: int
    rows: int
    bytes: int
    flow_grpo_rows: int
    flow_grpo_bytes: int
    coupled: bool

    def describe(self) -> str:
        mb = 1e6
        ours = (f"{self.rows} transitions x 2 fp32 latents" if self.coupled else "the clean fp32 latent once")
        line = (f"rollout -> trainer: {self.bytes / mb:.3f} MB per sample ({ours}, latent {self.latent / 1e3:.1f} kB, "
                f"+ conditioning {self.conditioning / mb:.3f} MB)")
        if self.coupled:
            return line
        return (line + f"; Flow-GRPO on this model: {self.flow_grpo_bytes / mb:.3f} MB ({self.flow_grpo_rows} "
                f"transitions x 2 fp32 latents + scalars, the same conditioning): "
                f"{self.flow_grpo_bytes / max(1, self.bytes):.1f}x")

    def to_json(self) -> dict[str, Any]:
        return {"latent_bytes": self.latent, "conditioning_bytes": self.conditioning, "rows_per_sample": self.rows,
                "bytes_per_sample": self.bytes, "flow_grpo_rows_per_sample": self.flow_grpo_rows,
                "flow_grpo_bytes_per_sample": self.flow_grpo_bytes}


def boundary(cfg: Config, transformer: Any, vae: Any, text_len: int, branches: int, dtype_bytes: int,
             cond_tokens: int = 0) -> Boundary:
    """:class:`Boundary` of ``cfg`` with its model's parts (on the meta device: the memory plan's), its prompt
    length ``text_len`` and CFG ``branches``; ``cond_tokens``: Qwen-Image-Edit's input-image tokens."""
    from digenrl.policy import trained_steps

    lat = latent_bytes(cfg, vae)
    arch = ARCH_OF_MODEL[cfg.model.name]
    cond = conditioning_bytes(dict(transformer.config), arch, text_tokens(cfg, text_len), branches, dtype_bytes,
                              cond_tokens)
    grpo = replace(cfg, train=replace(cfg.train, algorithm="flow_grpo"))
    rows, grpo_rows = trained_steps(cfg), trained_steps(grpo)
    return Boundary(lat, cond, rows, sample_bytes(row_cost(cfg), rows, lat, cond), grpo_rows,
                    sample_bytes(RowCost(), grpo_rows, lat, cond), coupled(cfg))
