"""The one small interface the RL core sees for every generator (Qwen-Image, FLUX.1, Wan2.1, HunyuanVideo).

Everything is batch-first and stateless per call, so that the sampler can run any step range of any
fragment, and training can pack (sample x timestep) rows with a per-row sigma (TSP):

* ``Cond`` is a dict of batch-first tensors (dim 0 = sample). Rows can be indexed, repeated and
  concatenated freely (``index_cond``/``cat_cond``), and it travels over the transport as tensors.
* ``velocity(x, sigma, cond)`` takes ``sigma`` of shape ``[B]`` (one noise level per row) and applies
  the model's own guidance (true CFG with norm rescale for Qwen-Image, the guidance embedding for
  FLUX/HunyuanVideo, CFG for Wan) identically at rollout and at training.
* ``sigmas(num_steps)`` returns the ``num_steps + 1`` noise levels of the model's diffusers scheduler,
  decreasing from 1 to a final 0.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Cond", "GeneratorModel", "index_cond", "cat_cond", "cond_to", "repeat_cond", "decode_in_chunks"]

Cond = dict[str, torch.Tensor]


def index_cond(cond: Cond, index: torch.Tensor | slice | list[int]) -> Cond:
    """Rows ``index`` of every tensor in ``cond``."""
    return {k: v[index] for k, v in cond.items()}


def cat_cond(conds: list[Cond]) -> Cond:
    """Concatenate conditionings row-wise; all must have the same keys."""
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def cond_to(cond: Cond, device: torch.device | str) -> Cond:
    """Every tensor of ``cond`` on ``device``."""
    return {k: v.to(device) for k, v in cond.items()}


def repeat_cond(cond: Cond, repeats: int) -> Cond:
    """Each row repeated ``repeats`` times in place (row-major: a,a,b,b for repeats=2)."""
    return {k: v.repeat_interleave(repeats, dim=0) for k, v in cond.items()}


@runtime_checkable
class GeneratorModel(Protocol):
    """A diffusers flow-matching generator behind the interface the sampler and the loss use."""

    name: str
    transformer: torch.nn.Module  # the network LoRA attaches to and the optimizer trains
    latent_shape: tuple[int, ...]  # per-sample shape of x in the model's packed layout

    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Conditioning for each prompt (and its negative/unconditional branch when CFG is used)."""
        ...

    def prepare_latents(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Initial noise ``x_0`` of shape ``[batch, *latent_shape]`` (fp32)."""
        ...

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``num_steps + 1`` noise levels from the model's scheduler, decreasing, ending in 0 (fp32)."""
        ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Guided velocity ``v`` at ``x`` with per-row noise levels ``sigma`` ``[B]``; same dtype as ``x``."""
        ...

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` (or videos ``[B, 3, F, H, W]``) in [0, 1] from clean latents."""
        ...


def decode_in_chunks(model: GeneratorModel, x: torch.Tensor, batch: int) -> torch.Tensor:
    """``model.decode(x)`` at most ``batch`` samples per VAE call (``rollout.decode_batch``; 0 = all at once)."""
    if batch <= 0 or x.shape[0] <= batch:
        return model.decode(x)
    return torch.cat([model.decode(chunk) for chunk in x.split(batch)])
