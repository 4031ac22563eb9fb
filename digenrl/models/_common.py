"""Shared machinery of the diffusers adapters: seeded construction, offline loading, sigmas, packing.

Every adapter wraps one real diffusers pipeline object (``pipe``). The pipeline is only a container
here: the adapters never call ``pipe.__call__`` or ``scheduler.step`` (their step counter is global
state that a pipelined, per-row-sigma sampler cannot use). What the adapters do use:

* the components (transformer, VAE, text encoders, tokenizers) and the pipeline's own
  ``encode_prompt``, so prompt embeddings are exactly what the stock pipeline would compute;
* ``save_pretrained`` / ``from_pretrained``, so a tiny checkpoint written by a test is read back by the
  very code path that reads real weights;
* the scheduler *config*, from which a private scheduler instance computes the sigma schedule.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from digenrl.errors import ConfigError

__all__ = [
    "DiffusersGenerator",
    "seeded",
    "load_pipeline_offline",
    "calculate_shift",
    "flow_match_sigmas",
    "decode_causal_vae",
]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded to ``seed``, restoring the caller's RNG state after.

    Random initialisation of the tiny presets happens inside this, so building a model never perturbs
    the global RNG stream of the caller (e.g. a test's or a sampler's noise).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def calculate_shift(
    image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15
) -> float:
    """The resolution-dependent ``mu`` of FLUX/Qwen-Image: linear in the image token count.

    Same formula as ``diffusers.pipelines.flux.pipeline_flux.calculate_shift``.
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def flow_match_sigmas(scheduler_config: Any, num_steps: int, image_seq_len: int | None) -> torch.Tensor:
    """The ``num_steps + 1`` sigmas a FlowMatchEuler pipeline (FLUX, Qwen-Image) would use, ending in 0.

    A *private* scheduler instance is built from the config and ``set_timesteps`` is called on it
    exactly as the stock pipelines call it (``linspace(1, 1/N, N)`` plus ``mu`` when the scheduler
    uses dynamic shifting). No shared scheduler state is read or written.

    Raises:
        ValueError: ``num_steps < 2`` with a ``shift_terminal`` scheduler (Qwen-Image), whose one-step
            schedule is NaN in the stock pipeline too.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs: dict[str, Any] = {}
    if sched.config.get("use_dynamic_shifting", False):
        if image_seq_len is None:
            raise ValueError("image_seq_len is required when the scheduler uses dynamic shifting")
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5),
            sched.config.get("max_shift", 1.15),
        )
    if sched.config.get("shift_terminal") and num_steps < 2:
        # stretch_shift_to_terminal maps the last sigma to shift_terminal by dividing by (1 - last): with one
        # step that sigma is 1 and the stock pipeline's schedule is [nan, 0] (Qwen-Image at 1 step)
        raise ValueError(f"num_steps must be >= 2 with this scheduler (shift_terminal = {sched.config.shift_terminal}), "
                         f"got {num_steps}")
    sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), **kwargs)
    return sched.sigmas.to(torch.float32).clone()


def check_num_steps(num_steps: int) -> None:
    """Raise ``ValueError`` unless ``num_steps`` is a positive int."""
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")


def check_prompts(prompts: list[str]) -> None:
    """Raise ``ValueError`` unless ``prompts`` is a non-empty list of str (a bare str is a common slip)."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of str, got {prompts!r:.80}")


def load_pipeline_offline(pipeline_cls: type, path: str | Path | None, dtype: torch.dtype, device: str | torch.device,
                          **absent: Any) -> Any:
    """``pipeline_cls.from_pretrained(path)`` strictly from local files, with errors naming what is missing.

    ``absent``: components passed instead of read (``None`` for one ``model_index.json`` lists as ``[null, null]``).

    Raises:
        ConfigError: ``path`` is None, does not exist, has no ``model_index.json``, or a component
            folder named there has no weight file.
    """
    if path is None:
        raise ConfigError("model.path: preset 'pretrained' needs a local directory (no hub downloads are made)")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"model.path: directory {str(root)!r} does not exist")
    index = root / "model_index.json"
    if not index.is_file():
        raise ConfigError(f"model.path: {str(index)!r} is missing; expected a diffusers pipeline saved with save_pretrained")
    import json

    components = json.loads(index.read_text())
    for name, spec in components.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        sub = root / name
        if not sub.is_dir():
            raise ConfigError(f"model.path: component folder {str(sub)!r} (listed in model_index.json) is missing")
        if name in {"transformer", "vae", "text_encoder", "text_encoder_2"} and not _has_weights(sub):
            raise ConfigError(f"model.path: no weight file (*.safetensors / *.bin) in {str(sub)!r}")
    try:
        pipe = pipeline_cls.from_pretrained(str(root), torch_dtype=dtype, local_files_only=True, **absent)
    except (OSError, ValueError, EnvironmentError) as exc:
        raise ConfigError(f"model.path: could not load {pipeline_cls.__name__} from {str(root)!r}: {exc}") from exc
    return pipe.to(device)


def to_device_dtype(pipe: Any, device: str | torch.device, dtype: torch.dtype) -> Any:
    """Move a freshly built pipeline; casting only when needed (diffusers warns on every fp32→fp32 cast)."""
    pipe.to(device)
    if dtype != torch.float32:
        pipe.to(dtype=dtype)
    return pipe


def _has_weights(folder: Path) -> bool:
    return any(p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json") for p in folder.iterdir())


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` → ``[B, (H/2)(W/2), 4C]``: the 2×2 patch packing of FLUX and Qwen-Image."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_2x2` for a latent grid of ``h × w``."""
    b, _, c4 = packed.shape
    x = packed.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


def pad_tokens(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (or truncate) ``[B, L, D]`` embeddings and their ``[B, L]`` mask to exactly ``length`` tokens.

    A fixed length makes conditionings of different prompt batches concatenable row-wise
    (``cat_cond``); padded positions carry mask 0, which the transformers' attention ignores.
    """
    b, l, d = embeds.shape
    if mask is None:
        mask = torch.ones(b, l, dtype=torch.long, device=embeds.device)
    mask = mask.to(torch.long)
    if l > length and bool(mask[:, length:].any()):
        logger.warning("prompt embeddings truncated from %d to %d tokens (raise model text_len to keep them)",
                       int(mask.sum(1).max()), length)
    if l >= length:
        return embeds[:, :length].contiguous(), mask[:, :length].contiguous()
    pad_e = embeds.new_zeros(b, length - l, d)
    pad_m = mask.new_zeros(b, length - l)
    return torch.cat([embeds, pad_e], dim=1), torch.cat([mask, pad_m], dim=1)


def check_sigma(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Validate the per-row ``sigma`` against ``x`` and return it as a 1-D fp32 tensor on x's device."""
    if not isinstance(sigma, torch.Tensor):
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
    if sigma.dim() == 0:
        sigma = sigma.expand(x.shape[0])
    if sigma.shape != (x.shape[0],):
        raise ValueError(f"sigma must have shape [B]=[{x.shape[0]}] (one noise level per row), got {tuple(sigma.shape)}")
    return sigma.to(device=x.device, dtype=torch.float32)


def decode_causal_vae(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Decode ``[B, C, F, h, w]`` latents with a Wan-family causal VAE (Qwen-Image, Wan2.1), in [-1, 1].

    The per-channel latent normalisation (``latents_mean``/``latents_std``) is undone first. On CPU
    the decode runs channels-last: the VAE's RMS norm reduces over the channel dim, which on the
    default layout is a strided reduction that took 45% of a tiny decode and kept it on one core
    (1.2x from a second thread). Channels-last: 1.7x faster on one thread, 2.3x on two; same numbers
    within 4e-7. The Conv3d weights are converted once and stay so (diffusers' ``save_pretrained``
    writes contiguous copies).
    """
    lat = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean, dtype=lat.dtype, device=lat.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=lat.dtype, device=lat.device).view(1, -1, 1, 1, 1)
    lat = lat * std + mean
    if lat.device.type == "cpu":
        for p in vae.parameters():
            if p.dim() == 5 and not p.is_contiguous(memory_format=torch.channels_last_3d):
                p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
        lat = lat.contiguous(memory_format=torch.channels_last_3d)
    return vae.decode(lat, return_dict=False)[0]


class DiffusersGenerator:
    """Common state of the adapters: the wrapped pipeline, output size, guidance and dtype.

    Subclasses implement the :class:`~digenrl.models.base.GeneratorModel` methods. Attributes:

    * ``pipe``: the diffusers pipeline holding the real components.
    * ``guidance_scale``: CFG scale (Qwen-Image, Wan) or the guidance-embedding value (FLUX,
      HunyuanVideo); applied identically at rollout and training because both call ``velocity``.
    * ``height``/``width`` (pixels) and ``num_frames`` (video models; 1 for images).
    """

    name: str = "generator"

    def __init__(
        self,
        pipe: Any,
        *,
        height: int,
        width: int,
        guidance_scale: float,
        num_frames: int = 1,
        text_len: int = 64,
    ) -> None:
        self.pipe = pipe
        self.height = int(height)
        self.width = int(width)
        self.num_frames = int(num_frames)
        self.guidance_scale = float(guidance_scale)
        self.text_len = int(text_len)
        if not math.isfinite(self.guidance_scale):
            raise ConfigError(f"model.guidance_scale must be finite, got {guidance_scale!r}")

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoising network LoRA attaches to and the optimizer trains."""
        return self.pipe.transformer

    @transformer.setter
    def transformer(self, module: torch.nn.Module) -> None:
        # used by lora.reference() to swap in the frozen reference copy for full fine-tuning
        self.pipe.transformer = module

    @property
    def device(self) -> torch.device:
        """Device of the transformer's parameters."""
        return next(self.pipe.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the transformer: diffusers' ``ModelMixin.dtype``, which skips the parameters kept in
        fp32 (Wan2.1 loaded in bf16 keeps ``scale_shift_table``, its first parameter, in fp32)."""
        tr = self.pipe.transformer
        return tr.dtype if isinstance(getattr(tr, "dtype", None), torch.dtype) else next(tr.parameters()).dtype

    def save_pretrained(self, path: str | Path) -> None:
        """Write the whole pipeline (all components, configs, tokenizers) with diffusers' ``save_pretrained``.

        The result loads back with ``load_model(name, "pretrained", path=path)``.
        """
        self.pipe.save_pretrained(str(path))

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.transformer.parameters())
        return (
            f"{type(self).__name__}(name={self.name!r}, latent_shape={getattr(self, 'latent_shape', None)}, "
            f"transformer_params={n}, guidance_scale={self.guidance_scale}, dtype={self.dtype})"
        )
