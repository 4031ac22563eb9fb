"""Compressed transfer to a far rollout pool: weight deltas with error feedback, and compressed samples back.

Weights (``transport.weights_compression``, zmq lane). The lead trainer keeps :class:`DeltaChain`: the *view*, a
copy of the weights the rollout actors hold (bit for bit), the version it is, and who holds it. Each publication::

    delta   = W_trainer - view                   # error feedback: what the last deltas left out is in it
    view'   = view + decode(encode(delta))       # add_delta: the receivers run the same reconstruction
    error   = |W_trainer - view'| (max-abs, relative L2)
    error > transport.weights_max_error  ->  the same with int8 (top-k may leave too much out), and past the
                                             bound still: a full publication, view' = W_trainer (error 0)

Holders of the view get the delta (``receive_weights_delta``: they rebuild ``view'`` from the version they hold);
anyone else (the first publication, an actor that missed one, a newcomer) gets ``view'`` itself in full, so every
rollout actor of the pool holds the same weights. The stats of each publication say its bytes, the uncompressed
bytes, the error and the view's digest (``state_digest``: equal to the receivers' ``weights_info`` digest).

Without error feedback (``error_feedback=False``, for comparison only) the delta is ``W_v - W_{v-1}``: the
receivers add up every version's rounding and their weights drift (tests/roles/test_compress.py shows both).

Samples (``transport.samples_compression``): a fragment's tensors on their way to the trainer's store deflate
losslessly (:func:`~digenrl.transport.compress.pack_tensor`) where that saves bytes; with ``bf16`` the clean
latents of forward-process algorithms (``y``, the only thing their trainer re-noises) are rounded to bf16.
Coupled algorithms' transitions and log-probs stay exact either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from digenrl.errors import ProtocolError
from digenrl.roles.weights import state_digest, unpack_buckets
from digenrl.transport.compress import add_delta, encode_delta, encoded_nbytes, is_packed, pack_tensor, unpack_tensor

__all__ = ["DeltaChain", "Publication", "weights_error", "rebuild", "encode_fragment", "decode_fragment"]

CLEAN_LATENT = "y"  # a forward-process fragment's clean samples (roles/fragments.py, FragmentEngine._integrate)
MIN_PACK_BYTES = 1024  # smaller tensors travel inline in the header anyway


@dataclass
class Publication:
    """One publication's plan: who gets the delta, who the full view, and what it costs.

    Attributes:
        base: the version the delta applies to (``None``: no delta, everyone gets ``view`` in full).
        delta: one encoding per bucket (``None`` with ``base``).
        view: the buckets every receiver holds after this publication (what ``full_to`` gets).
        stats: ``{"version", "method", "bytes", "full_bytes", "max_abs", "rel", "digest", "full"}`` (``method``:
            the one used, ``int8`` / ``topk`` / ``full``; ``full``: the receivers sent the view in full).
    """

    version: int
    layout: list[list[Any]]
    base: int | None
    delta: list[dict[str, Any]] | None
    view: list[torch.Tensor]
    delta_to: list[str]
    full_to: list[str]
    stats: dict[str, Any] = field(default_factory=dict)


class DeltaChain:
    """The trainer's copy of what one rollout pool holds, and the deltas that move it (see the module docstring).

    Args:
        method: ``int8`` or ``topk``.
        topk_fraction: the share of each bucket's entries a ``topk`` delta sends.
        max_error: the bound on the receivers' relative L2 error; a top-k delta past it becomes an int8 one, an
            int8 delta past it a full publication.
        error_feedback: deltas against the view (True) or against the previous version (False: drifts).
    """

    def __init__(self, method: str, topk_fraction: float = 0.01, max_error: float = 1e-3,
                 error_feedback: bool = True) -> None:
        self.method, self.topk_fraction, self.max_error = method, topk_fraction, max_error
        self.error_feedback = error_feedback
        self.layout: list[list[Any]] | None = None
        self.view: list[torch.Tensor] | None = None
        self.version: int | None = None
        self.holders: set[str] = set()
        self.log: list[dict[str, Any]] = []  # the stats of recent publications (weights_info)
        self._last: list[torch.Tensor] | None = None  # the previous exact weights (only without error feedback)

    def plan(self, version: int, layout: list[list[Any]], buckets: list[torch.Tensor],
             receivers: list[str]) -> Publication:
        """The publication of ``version`` (``buckets`` in ``layout``, as ``pack_buckets`` made them) to ``receivers``.

        Moves the view to what the receivers will hold; call :meth:`delivered` once they did.
        """
        exact = [b.detach().cpu() for b in buckets]
        view, delta, method, (max_abs, rel) = [b.clone() for b in exact], None, "full", (0.0, 0.0)
        if self.view is not None and layout == self.layout:
            # the configured method, then int8 (top-k may leave too much out), then exact: the first within the bound
            for m in dict.fromkeys([self.method, "int8"]):
                v, d = self._step(exact, m)
                err = weights_error(exact, v)
                if err[1] <= self.max_error:
                    view, delta, method, (max_abs, rel) = v, d, m, err
                    break
        full = delta is None
        base = None if full else self.version
        holders = self.holders if base is not None else set()
        pub = Publication(version, layout, base, delta, view, [r for r in receivers if r in holders],
                          [r for r in receivers if r not in holders])
        full_bytes = encoded_nbytes(exact)
        pub.stats = {"version": version, "method": method, "full_bytes": full_bytes,
                     "bytes": full_bytes if delta is None else encoded_nbytes(delta), "max_abs": max_abs, "rel": rel,
                     "digest": state_digest(unpack_buckets(layout, view)), "full": pub.full_to}
        self.layout, self.view, self.version = layout, view, version
        self._last = exact if not self.error_feedback else None
        self.log = [*self.log[-7:], pub.stats]
        return pub

    def _step(self, exact: list[torch.Tensor], method: str) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        assert self.view is not None
        ref = self.view if self.error_feedback or self._last is None else self._last
        delta: list[dict[str, Any]] = []
        for w, r in zip(exact, ref, strict=True):
            if w.is_floating_point():
                delta.append(encode_delta(w.float().reshape(-1) - r.float().reshape(-1), method, self.topk_fraction))
            else:
                delta.append({"m": "set", "t": w})
        return [add_delta(v, d) for v, d in zip(self.view, delta, strict=True)], delta

    def delivered(self, pub: Publication, failed: list[str]) -> None:
        """``pub`` reached its receivers but ``failed``: they hold the view now (the others must get it in full)."""
        self.holders = {r for r in (*pub.delta_to, *pub.full_to) if r not in failed}

    def admitted(self, names: list[str]) -> None:
        """``names`` received the view in full outside a publication (a late joiner's admission)."""
        self.holders |= set(names)


def weights_error(exact: list[torch.Tensor], view: list[torch.Tensor]) -> tuple[float, float]:
    """``(max |exact - view|, ||exact - view|| / ||exact||)`` over every bucket (float32; 0 for equal weights)."""
    max_abs, err2, norm2 = 0.0, 0.0, 0.0
    for w, v in zip(exact, view, strict=True):
        if not w.is_floating_point() or not w.numel():
            continue
        d = w.float() - v.float()
        max_abs = max(max_abs, float(d.abs().max()))
        err2 += float(d.double().pow(2).sum())
        norm2 += float(w.double().pow(2).sum())
    return max_abs, math.sqrt(err2 / norm2) if norm2 > 0 else math.sqrt(err2)


def rebuild(base: dict[str, torch.Tensor], layout: Any, delta: Any) -> dict[str, torch.Tensor]:
    """A receiver's reconstruction: the held version ``base`` plus ``delta`` (one encoding per bucket of ``layout``).

    Raises:
        ProtocolError: the layout names tensors ``base`` lacks or of other shapes, or the delta does not fit it.
    """
    if not isinstance(layout, list) or not isinstance(delta, list):
        raise ProtocolError("weights delta: layout and delta must be lists")
    parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in delta]
    for entry in layout:
        if not (isinstance(entry, list | tuple) and len(entry) == 5 and isinstance(entry[0], str)):
            raise ProtocolError(f"weights delta: malformed layout entry {entry!r:.80}")
        name, _, shape, b, offset = entry
        held = base.get(name)
        if held is None or list(held.shape) != list(shape) or not isinstance(b, int) or not 0 <= b < len(delta):
            raise ProtocolError(f"weights delta: entry {name!r} does not match the held version (or bucket {b!r})")
        parts[b].append((int(offset), held.reshape(-1)))
    flats = []
    for b, ps in enumerate(parts):
        ps.sort(key=lambda p: p[0])
        if [o for o, _ in ps] != [sum(t.numel() for _, t in ps[:i]) for i in range(len(ps))]:
            raise ProtocolError(f"weights delta: bucket {b}'s entries are not contiguous")
        flats.append(add_delta(torch.cat([t for _, t in ps]) if ps else torch.zeros(0), delta[b]))
    return unpack_buckets(layout, flats)


def encode_fragment(wire: dict[str, Any], method: str) -> dict[str, Any]:
    """A fragment's wire dict (``FragmentData.to_wire``) with its conditioning and records packed by ``method``
    (``lossless`` or ``bf16``; ``none``: as it is). A tensor is packed only where that saves bytes."""
    if method == "none":
        return wire
    out = dict(wire)
    for part in ("cond", "trans"):
        out[part] = {k: _packed(v, "bf16" if method == "bf16" and k == CLEAN_LATENT and part == "trans"
                                else "lossless") for k, v in wire.get(part, {}).items()}
    return out


def decode_fragment(wire: dict[str, Any]) -> dict[str, Any]:
    """The fragment's wire dict with every packed tensor restored (a dict without packets is returned as it is).

    Raises:
        ProtocolError: a malformed packet.
    """
    parts = {p: wire[p] for p in ("cond", "trans") if isinstance(wire.get(p), dict)}
    if not any(is_packed(v) for d in parts.values() for v in d.values()):
        return wire
    return {**wire, **{p: {k: unpack_tensor(v) if is_packed(v) else v for k, v in d.items()} for p, d in parts.items()}}


def _packed(t: Any, method: str) -> Any:
    if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() < MIN_PACK_BYTES:
        return t
    if method == "bf16" and t.dtype in (torch.float32, torch.float64):
        return pack_tensor(t, "bf16")
    packet = pack_tensor(t, "lossless")
    return packet if encoded_nbytes(packet) < t.numel() * t.element_size() else t
