"""The generator a run trains, built from its config: one builder for the colocated loop and the actors.

:func:`build_model` makes the configured diffusers generator (random tiny/small preset, local
pretrained weights, or the published architecture with random weights: preset ``random``), applies the
toy VAE init where asked and makes LoRA adapters (or every parameter, for full fine-tuning) trainable.
Every process of a run builds it the same way from the same seed, so the rollout actors, trainers and
the colocated loop start from identical weights (preset ``random`` too, on any device: its weights are
drawn on the host).

The memory features are applied per role after that: :func:`prepare_for_training` (trainers and the
memory plan: fp32 master weights, gradient checkpointing, freeing what a trainer never runs) and
:func:`prepare_for_generation` (rollout actors: the text encoder offloaded between prompts).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from digenrl.config import Config
from digenrl.models import GeneratorModel, load_model
from digenrl.models._toy import toy_signal_init
from digenrl.models.init import load_init
from digenrl.models.lora import apply_lora, enable_full_finetune

__all__ = ["build_model", "compile_transformer", "trained_steps", "prepare_for_training", "prepare_for_generation", "text_encoders"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BUILD_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    """The generator with its trainable parameters, built exactly as the colocated recipe builds it."""
    # diffusers' lazy imports are not thread-safe: in-process actors build their models one at a time.
    with _BUILD_LOCK:
        return _build_model(cfg)


def _build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    m = cfg.model
    model = load_model(m.name, m.preset, path=m.path or None, device=m.device, dtype=_DTYPES[m.dtype], seed=m.seed,
                       resolution=(m.resolution[0], m.resolution[1]),
                       num_frames=m.num_frames if m.name in ("wan21", "wan22", "hunyuanvideo") else None,
                       guidance_scale=m.guidance_scale, text_len=m.text_len or None, variant=m.variant,
                       layers=m.layers, text_encoder=m.text_encoder, experts=m.experts(),
                       image_area=(m.image_area or None) if m.name == "qwenimage_edit" else None)
    if m.init:  # a pretrained checkpoint of the random preset (the default: the tiny model that draws shapes)
        load_init(model, m.init)
    if m.vae_init == "signal":  # random toy presets: make pixels depend on the latent and the prompt
        toy_signal_init(model, seed=m.seed + 3)
    if m.finetune == "lora":
        params = apply_lora(model, rank=m.lora_rank, alpha=m.lora_alpha, seed=m.seed,
                            target_modules=m.lora_targets or None)
    else:
        params = enable_full_finetune(model)
    if m.compile:
        compile_transformer(model, m.compile)
    return model, params


def compile_transformer(model: GeneratorModel, mode: str) -> None:
    """``torch.compile`` the transformer in place (``model.compile``): its parameters, LoRA and state dict stay
    the module's own, so training, publication and checkpoints do not change. Compiles at the first call of
    each shape (merged LoRA for sampling, the reference with adapters off: each its own graph); the kernels
    go to ``TORCHINDUCTOR_CACHE_DIR`` (here ``~/.cache/digenrl/torchinductor`` unless set), which later
    processes and runs reuse instead of compiling again."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "digenrl" / "torchinductor"))
    model.transformer.compile(mode=None if mode == "default" else mode)


def trained_steps(cfg: Config) -> int:
    """Rows trained per sample: transitions (|T|) under ``rollout.steps``, or a forward-process method's noise levels."""
    from digenrl.rl.forward import nft_levels

    ro = cfg.rollout
    if cfg.train.algorithm == "nft":
        return nft_levels(ro.num_steps, cfg.nft.levels)
    if cfg.train.algorithm == "awm":
        return cfg.awm.levels
    if cfg.train.algorithm == "mixgrpo":
        return cfg.mixgrpo.sliding(ro.num_steps).window  # (0: the reference's 4, fewer on a short grid)
    if ro.steps == "window":
        return ro.window
    if ro.steps == "fraction":
        return max(1, round(ro.fraction * (ro.num_steps - 1)))
    return ro.num_steps - 1


def text_encoders(model: Any) -> list[str]:
    """Names of the frozen text-encoder components of ``model``'s pipeline (``text_encoder``, ``text_encoder_2``)."""
    return [n for n in ("text_encoder", "text_encoder_2") if getattr(model.pipe, n, None) is not None]


def prepare_for_training(model: Any, cfg: Config, *, generates: bool | None = None) -> None:
    """The trainer's memory features, applied in place to a model from :func:`build_model`.

    * ``train.grad_checkpointing``: diffusers' ``enable_gradient_checkpointing`` on the transformer
      (each block's activations recomputed in backward instead of kept).
    * ``train.fp32_master`` with a bf16/fp16 model: the LoRA weights are kept in fp32 (peft casts
      the input to them). Full fine-tuning gets fp32 master weights from FSDP's mixed precision
      (:func:`digenrl.roles.trainer_group.shard_model`); unsharded it stays in the model's dtype.
    * A trainer that does not generate (no TAG: ``generates`` False, by default
      ``Config.trainers_generate``) frees the VAE (it trains on stored latents and conditionings)
      and keeps the text encoders off the GPU between the rare prompts it encodes (probes).

    The memory plan calls this too, so what it counts is what a trainer holds.
    """
    from digenrl.models.lora import trainable_mode, trainable_parameters
    t = cfg.train
    if t.grad_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    if t.fp32_master and cfg.model.dtype != "float32":
        if trainable_mode(model) == "lora":
            for p in trainable_parameters(model):
                p.data = p.data.float()
        elif cfg.shard != "fsdp":
            log.warning("train.fp32_master: full fine-tuning keeps fp32 master weights only under train.shard = "
                        "'fsdp'; this trainer trains in %s", cfg.model.dtype)
    if generates is None:
        generates = cfg.trainers_generate
    if not generates:
        model.pipe.vae = None
    prepare_for_generation(model, cfg, offload=not generates or None)


def prepare_for_generation(model: Any, cfg: Config, offload: bool | None = None) -> None:
    """Rollout-side memory features: ``model.offload_text_encoder`` (or ``offload``) on a CUDA model.

    The text encoders then live on the CPU and visit the GPU only while a prompt batch is encoded
    (the fragment engine caches the embeddings per prompt batch, so that is once per prompt batch).
    """
    names = text_encoders(model)
    offload = cfg.model.offload_text_encoder if offload is None else offload
    if not (offload and names and cfg.model.device.startswith("cuda")):
        return
    for name in names:
        getattr(model.pipe, name).to("cpu")
    encode = model.encode_prompts

    def encode_offloaded(prompts: list[str]) -> Any:
        device = model.transformer.device if hasattr(model.transformer, "device") else cfg.model.device
        modules = [getattr(model.pipe, n) for n in names]
        for m in modules:
            m.to(device)
        try:
            return encode(prompts)
        finally:
            for m in modules:
                m.to("cpu")

    model.encode_prompts = encode_offloaded
