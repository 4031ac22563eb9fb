"""What compression a link to the rollout pool calls for, and what it saves (pure numbers, no I/O).

The run resolves ``transport.weights_compression = "auto"`` and ``transport.samples_compression = "auto"`` with
these functions from ``transport.rollout_link_gbit``; the planner prices a publication over a link with
:func:`weight_bytes_ratio` of the method the run resolves (``plan/links.config_transfer``), so the two follow one
rule. The encodings themselves: :mod:`digenrl.transport.compress`.

Rule (by the link's rate alone: a publication must fit in about one optimizer step, and one-step-stale async gives
it a whole step; these thresholds keep a LoRA r64 publication of Qwen-Image, 360 MiB bf16, near a second):

* no slow link (``0``) or at least ``FAST_LINK_BPS`` (25 Gbit/s, RoCE / InfiniBand class): nothing is compressed;
* down to ``INT8_LINK_BPS`` (1 Gbit/s): int8 deltas (1 byte per element + 0.1 %), clean latents in bf16 and
  transitions deflated losslessly;
* slower: top-k deltas (``topk_fraction`` of the entries, 5 bytes each), samples as above. A top-k delta that
  would leave the receivers past ``transport.weights_max_error`` goes as int8 instead (and past it still, in
  full): Adam moves every weight each step, so at the default bound (1e-3) a LoRA's top-k deltas rarely pass
  (measured on the tiny model: 0.7-1.9 % relative error at 1 %, 0.2 % at 30 %; int8: 2e-5). Raise the bound to
  trade fidelity for bytes.
"""

from __future__ import annotations

from digenrl.errors import ConfigError

__all__ = ["FAST_LINK_BPS", "INT8_LINK_BPS", "WEIGHT_COMPRESSIONS", "SAMPLE_COMPRESSIONS", "WEIGHT_CHOICES",
           "SAMPLE_CHOICES",
           "choose_weights_compression", "choose_samples_compression", "weight_bytes_ratio"]

FAST_LINK_BPS = 25e9
INT8_LINK_BPS = 1e9
WEIGHT_COMPRESSIONS = ("none", "int8", "topk")
SAMPLE_COMPRESSIONS = ("none", "lossless", "bf16")
WEIGHT_CHOICES = (*WEIGHT_COMPRESSIONS, "auto")  # what the config keys accept
SAMPLE_CHOICES = (*SAMPLE_COMPRESSIONS, "auto")
_INT8_BLOCK_OVERHEAD = 4 / 4096  # one float32 scale per QUANT_BLOCK elements


def choose_weights_compression(link_bps: float) -> str:
    """``none``, ``int8`` or ``topk`` for a link of ``link_bps`` bit/s to the rollout pool (0: no slow link)."""
    if link_bps <= 0 or link_bps >= FAST_LINK_BPS:
        return "none"
    return "int8" if link_bps >= INT8_LINK_BPS else "topk"


def choose_samples_compression(link_bps: float) -> str:
    """``none`` on the trainers' own fabric, else ``bf16`` (clean latents rounded, everything else lossless)."""
    return "none" if link_bps <= 0 or link_bps >= FAST_LINK_BPS else "bf16"


def weight_bytes_ratio(method: str, dtype_bytes: int = 2, topk_fraction: float = 0.01) -> float:
    """Bytes of a compressed publication over the uncompressed one (weights of ``dtype_bytes`` each).

    A full publication (the first, a newcomer's, one past the error bound) costs 1.0 whatever the method.

    Raises:
        ConfigError: an unknown method.
    """
    if method == "none":
        return 1.0
    if method == "int8":
        return (1 + _INT8_BLOCK_OVERHEAD) / dtype_bytes
    if method == "topk":
        return topk_fraction * (5 + _INT8_BLOCK_OVERHEAD) / dtype_bytes  # an int32 index, an int8 value per entry
    raise ConfigError(f"weight compression {method!r}: expected one of {', '.join(WEIGHT_COMPRESSIONS)}")
