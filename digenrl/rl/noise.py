"""Noise that belongs to a sample, not to a batch, a fragment or a device.

A sample's initial latent and its transition noise at every step are drawn from generators seeded by
``(run seed, batch, sample id, step)`` alone. So the same sample gets the same noise however the
schedule cuts the batch into fragments, step ranges and tokens, on whichever actor runs them: the
colocated loop and an on-policy disaggregated run generate the same samples, and a change of
fragment size or placement changes speed, never the experiment.

Ids: a sample's id is its row in the logical batch (``prompt * group_size + member``). With
``same_init_noise`` every member of a prompt's group starts from the prompt's latent (key ``-1 - prompt``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["noise_seed", "initial_keys", "initial_latents", "transition_noise", "level_indices", "training_noise",
           "probe_direction"]

_INITIAL = -1  # the "step" of the initial latent
_LEVELS = -2  # ... of a forward-process sample's draw of training noise levels
_TRAINING = -3  # ... and of its k-th level's fresh noise: -3 - k (batch -1: the run's probe direction)


def noise_seed(seed: int, batch: int, key: int, step: int) -> int:
    """A 63-bit generator seed for one ``(seed, batch, key, step)``; a hash, so nearby ids never collide."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, batch, key, step), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _gen(seed: int, batch: int, key: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(noise_seed(seed, batch, key, step))


def initial_keys(sample_ids: Sequence[int], group_size: int, same_init: bool) -> list[int]:
    """The initial-latent key of each sample: its own id, or its prompt's (``-1 - prompt``) if shared."""
    return [-1 - s // group_size if same_init else s for s in sample_ids]


def initial_latents(model: Any, seed: int, batch: int, keys: Sequence[int]) -> torch.Tensor:
    """``x_0`` ``[len(keys), ...]`` (fp32): one ``model.prepare_latents`` draw per distinct key."""
    drawn: dict[int, torch.Tensor] = {}
    for k in keys:
        if k not in drawn:
            drawn[k] = model.prepare_latents(1, generator=_gen(seed, batch, k, _INITIAL)).float()
    return torch.cat([drawn[k] for k in keys])


def transition_noise(seed: int, batch: int, sample_ids: Sequence[int], step: int, like: torch.Tensor,
                     active: torch.Tensor | None = None) -> torch.Tensor:
    """Standard normal noise for step ``step`` of each sample, shaped and placed like ``like`` ``[B, ...]`` (fp32).

    ``active`` (``[B]`` bool) limits the draws to the stochastic rows; the others get zeros, which a
    deterministic (ODE) step ignores, and no other row's noise changes.
    """
    z = torch.zeros(like.shape, dtype=torch.float32)
    for row, s in enumerate(sample_ids):
        if active is None or bool(active[row]):
            z[row] = torch.randn(z.shape[1:], generator=_gen(seed, batch, s, step), dtype=torch.float32)
    return z.to(like.device)


def level_indices(seed: int, batch: int, sample_id: int, num_steps: int, levels: int, mode: str,
                  strata: Sequence[tuple[int, int]] = ()) -> list[int]:
    """The grid indices a forward-process sample trains at, drawn from its own seed.

    ``mode = "permutation"`` (DiffusionNFT): the first ``levels`` of a random permutation of ``0..num_steps-1``;
    ``"strata"`` (AWM): one index uniformly from each ``[lo, hi)`` of ``strata`` (``lo`` where it is empty).
    """
    gen = _gen(seed, batch, sample_id, _LEVELS)
    if mode == "permutation":
        return torch.randperm(num_steps, generator=gen)[:levels].tolist()
    u = torch.rand(len(strata), generator=gen, dtype=torch.float64).tolist()
    return [lo + int(x * (hi - lo)) for x, (lo, hi) in zip(u, strata, strict=True)]


def training_noise(seed: int, batch: int, sample_id: int, k: int, shape: Sequence[int]) -> torch.Tensor:
    """The fresh standard normal noise ``eps`` of a sample's ``k``-th training level (fp32, on the host)."""
    return torch.randn(tuple(shape), generator=_gen(seed, batch, sample_id, _TRAINING - k), dtype=torch.float32)


def probe_direction(seed: int, shape: Sequence[int]) -> torch.Tensor:
    """The run's fixed unit-variance direction in latent space (fp32, host) that forward-process parity projects
    velocities on (:func:`digenrl.rl.forward.velocity_probe`)."""
    return torch.randn(tuple(shape), generator=_gen(seed, -1, 0, _TRAINING), dtype=torch.float32)
