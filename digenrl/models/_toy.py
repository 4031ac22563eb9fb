"""Make a randomly initialised VAE decoder pass the latent's signal through to the pixels.

With PyTorch's default init (kaiming-uniform, a = sqrt(5): weight std ~ 1/sqrt(3 fan_in)) and the RMS
norms of the Qwen-Image/Wan VAE, the tiny random decoder's output is almost independent of its input:
measured on the tiny preset, the per-sample mean colour varies by ~0.001 across random latents, and
even optimising the latent directly for 40 Adam steps moves the colour reward by only ~0.01. No RL can
learn a pixel reward through that. Re-drawing the decoder's conv weights from N(0, gain^2 / fan_in)
with zero biases (He init, gain 2) makes the decoded image depend on the latent (per-sample colour std
~0.05; direct optimisation then reaches +0.17 reward), which is what a toy learning run needs.

The random tiny Qwen-Image transformer has the same problem with its prompt: measured on the tiny
preset, the velocity's spread across the 8 colour prompts (same latent) is 0.7% of its spread across
latents (same prompt), and the decoded mean colour varies by 0.0002 across prompts vs 0.02 across
latents, although the text encoder's embeddings differ by ~90% of their norm per token. The image
stream reads the text only through joint attention, whose output is scaled by the AdaLN gate, the text
value projection and the output projection, all small at default init. :func:`prompt_signal_init`
multiplies those three by ``gain`` (4: spread ratio 0.40, mean-colour spread across prompts 0.008; 3 gave
0.19; 6 was not better), so a prompt-conditioned reward has a prompt-dependent direction to learn. It is
necessary, not sufficient: the colour run also needed fewer noisy latent elements per reward (32 px, one
noisy step) to rise clearly beyond its shuffled control (see ``bench/learning.py``).

Only ever applied to random presets (``tiny``/``small``): pretrained weights are never touched.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from digenrl.errors import ConfigError

__all__ = ["signal_preserving_decoder_init", "prompt_signal_init", "toy_signal_init"]

# The joint-attention path from text to image tokens (diffusers QwenImageTransformerBlock names).
_PROMPT_PATH = ("img_mod.1", "attn.add_v_proj", "attn.to_out")


def signal_preserving_decoder_init(model: Any, *, gain: float = 2.0, seed: int = 0) -> int:
    """Re-initialise every conv of ``model.pipe.vae.decoder``; returns how many were re-drawn.

    Raises:
        ConfigError: the model has no diffusers VAE decoder to re-initialise.
    """
    vae = getattr(getattr(model, "pipe", None), "vae", None)
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        raise ConfigError(f"model.vae_init: {getattr(model, 'name', '?')!r} has no VAE decoder to re-initialise")
    g = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for mod in decoder.modules():
            if isinstance(mod, torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d):
                fan_in = mod.weight[0].numel()
                w = torch.randn(mod.weight.shape, generator=g) * (gain / math.sqrt(fan_in))
                mod.weight.copy_(w.to(mod.weight))
                if mod.bias is not None:
                    mod.bias.zero_()
                count += 1
    return count


def prompt_signal_init(model: Any, *, gain: float = 4.0) -> int:
    """Scale the text-to-image attention path of ``model.pipe.transformer`` by ``gain``; returns how many
    tensors were scaled. Call before adding LoRA adapters (it scales base weights only).

    Raises:
        ConfigError: the model has no transformer with that path (not a Qwen-Image-style model).
    """
    tr = getattr(getattr(model, "pipe", None), "transformer", None)
    if tr is None:
        raise ConfigError(f"model.vae_init: {getattr(model, 'name', '?')!r} has no transformer to re-initialise")
    count = 0
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_" not in name and any(f".{k}." in f".{name}" for k in _PROMPT_PATH):
                p.mul_(gain)
                count += 1
    if count == 0:
        raise ConfigError(f"model.vae_init: {type(tr).__name__} has none of {_PROMPT_PATH} to scale")
    return count


def toy_signal_init(model: Any, *, seed: int = 0) -> None:
    """``model.vae_init = "signal"``: the decoder re-draw, plus the prompt path for Qwen-Image models.

    Raises:
        ConfigError: the model has no VAE decoder (or a Qwen-Image model lacks the attention path).
    """
    signal_preserving_decoder_init(model, seed=seed)
    if getattr(model, "name", "") == "qwenimage":
        prompt_signal_init(model)
