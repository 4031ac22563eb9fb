"""Ulysses sequence parallelism (SP) in the cost model: what a group of ``k`` devices acting as one actor pays.

An SP group shards every row's sequence over its ``k`` devices (``placement.sp``, ``rollout_sp``, ``trainer_sp``).
Outside attention each rank works on ``ceil(S / k)`` of the ``S`` tokens; around each self-attention layer four
all-to-alls (DeepSpeed-Ulysses) turn the sequence shards into head shards and back: q, k and v in, the output out.
A backward pass sends the gradients of the same four tensors the other way, twice a forward's (a forward-equivalent
pass always pays four per layer: a trained row's ``row_passes`` count them). A cross-attention over text needs none
(every rank keeps the whole text, and a query token needs no other token's query).

Per pass of ``rows`` rows on each rank, with ``H`` heads of width ``d`` padded to multiples of ``k``, bf16::

    compute   = t1 * ((F - A) * S'/S + A * (S'/S)^2 * H'/H) / (k F)      S' = ceil(S/k) k, H' = ceil(H/k) k
    all-to-all = layers * 4 * (rows * S'/k * H' d * 2 B * (k-1)/k / link + latency)
    overhead  = PASS_OVERHEAD_S * log2(k)

``t1`` is the pass's seconds on one device, ``F`` its FLOPs and ``A`` those of its self-attention products (the one
part quadratic in the sequence). ``link`` is the group's bandwidth per direction (NVLink inside a node, ``devices.py``;
the NIC when a group spans nodes); the latency is the cost model's ``collective_latency_s`` per collective. The
overhead is what the vLLM-Omni study measured SP adding to a forward at ~1.5k tokens, where the bytes are tiny:
40-120 ms, read here as 40 ms per doubling of the group (SP 2: 40, SP 4: 80, SP 8: 120): launches, the group's
synchronisation, sharding and gathering at the pass's ends. It is why SP pays only on long sequences (the study: from
~33k tokens). Line-rate links are optimistic; the doctor measures the all-to-all on the machine
(``digenrl.doctor.all_to_all``).

VAE decoding, text encoding and reward models are not sharded: one rank runs them (the cost model keeps them whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from digenrl.errors import ConfigError
from digenrl.schedule.base import Role
from digenrl.sim.devices import DeviceSpec
from digenrl.sim.flops import tokens, variant_config
from digenrl.sim.profiles import BF16, ModelProfile

if TYPE_CHECKING:
    from digenrl.sim.cost import CostModel

__all__ = ["ALL_TO_ALLS_PER_LAYER", "PASS_OVERHEAD_S", "UlyssesGeometry", "UlyssesCost", "geometry",
           "ulysses_cost", "DEGREES", "group_speedup", "group_devices", "SequenceRuns"]

ALL_TO_ALLS_PER_LAYER = 4  # q, k, v in and the output back, per attention layer and forward-equivalent pass
PASS_OVERHEAD_S = 0.04  # per forward-equivalent pass and doubling of the group (vLLM-Omni: 40-120 ms at SP 2-8)
DEGREES = (1, 2, 4, 8)  # the degrees a planner tries: powers of two inside one node of 8


@dataclass(frozen=True, slots=True)
class UlyssesGeometry:
    """What one row's pass exchanges: the sequence the group shards, the heads, the layers that exchange.

    Attributes:
        tokens: the sequence of one row (video/image tokens; a joint-attention MMDiT's text tokens too).
        heads, head_dim: attention heads and their width.
        layers: attention layers whose sequence is exchanged (Wan: self-attention of each block; MMDiTs: every
            joint or single-stream block; SD3.5-M's dual-attention blocks twice).
        forward_flops: FLOPs of one pass of one row; ``attention_flops``: its self-attention products.
    """

    tokens: int
    heads: int
    head_dim: int
    layers: int
    forward_flops: int
    attention_flops: int


def geometry(prof: ModelProfile) -> UlyssesGeometry:
    """The Ulysses geometry of ``prof``'s rows (its model at its size, resolution and text length)."""
    c = variant_config(prof.arch, prof.variant, prof.layers)
    s, t = tokens(prof.arch, prof.shape, c), prof.shape.text_tokens
    if prof.arch in ("wan", "wan2.2"):  # self-attention on the video only; cross-attention reads the whole text
        seq, layers = s, c["num_layers"]
    elif prof.arch in ("flux", "hunyuan-video"):
        seq, layers = s + t, c["num_layers"] + c["num_single_layers"]
    elif prof.arch == "sd3":  # (the dual blocks' image-only attention counted at the joint length: a bound)
        seq, layers = s + t, c["num_layers"] + len(c.get("dual_attention_layers") or ())
    elif prof.arch in ("qwen-image", "qwen-image-edit"):
        seq, layers = s + t, c["num_layers"]
    else:
        raise ConfigError(f"sequence parallelism: unknown architecture {prof.arch!r}")
    heads, width = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    attention = layers * 4 * seq * seq * heads * width  # QK^T and PV (flops._sdpa)
    return UlyssesGeometry(seq, heads, width, layers, prof.forward_flops, min(attention, prof.forward_flops))


def _padded(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True, slots=True)
class UlyssesCost:
    """The seconds an SP group of ``degree`` devices pays for its passes (module docstring)."""

    degree: int
    geometry: UlyssesGeometry
    link_bytes_per_s: float
    latency_s: float
    overhead_s: float = PASS_OVERHEAD_S

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ConfigError(f"sequence parallel degree {self.degree}: must be >= 1")

    @property
    def padded_tokens(self) -> int:
        """The sequence padded to a multiple of the degree (each rank's shard the same length)."""
        return _padded(self.geometry.tokens, self.degree)

    @property
    def padded_heads(self) -> int:
        """The heads padded to a multiple of the degree (each rank the same number after the all-to-all)."""
        return _padded(self.geometry.heads, self.degree)

    @property
    def compute_factor(self) -> float:
        """A rank's compute of one pass over one device's compute of the whole pass (``1 / k`` without padding)."""
        g, k = self.geometry, self.degree
        seq = self.padded_tokens / g.tokens
        linear = (g.forward_flops - g.attention_flops) * seq
        attention = g.attention_flops * seq * seq * self.padded_heads / g.heads
        return (linear + attention) / (k * g.forward_flops)

    def all_to_all_bytes(self, rows: int) -> float:
        """Bytes one rank sends in one all-to-all of a pass over ``rows`` rows (bf16)."""
        k = self.degree
        local = rows * (self.padded_tokens // k) * self.padded_heads * self.geometry.head_dim * BF16
        return local * (k - 1) / k

    def all_to_alls(self, passes: float) -> float:
        """All-to-alls of ``passes`` forward-equivalent passes."""
        return passes * self.geometry.layers * ALL_TO_ALLS_PER_LAYER

    def all_to_all_seconds(self, rows: int, passes: float = 1.0) -> float:
        """Seconds of the all-to-alls of ``passes`` passes over ``rows`` rows each (0 for one device)."""
        if self.degree == 1:
            return 0.0
        return self.all_to_alls(passes) * (self.all_to_all_bytes(rows) / self.link_bytes_per_s + self.latency_s)

    def overhead_seconds(self, passes: float = 1.0) -> float:
        """The fixed cost of ``passes`` passes on the group (``PASS_OVERHEAD_S`` per doubling)."""
        return passes * self.overhead_s * math.log2(self.degree)

    def seconds(self, compute_s: float, rows: int, passes: float = 1.0) -> float:
        """The group's seconds for work one device computes in ``compute_s``: ``passes`` passes of ``rows`` rows."""
        if self.degree == 1:
            return compute_s
        return compute_s * self.compute_factor + self.all_to_all_seconds(rows, passes) + self.overhead_seconds(passes)

    def speedup(self, compute_s: float, rows: int = 1, passes: float = 1.0) -> float:
        """One device's seconds over the group's for the same passes (``degree`` at best)."""
        return compute_s / self.seconds(compute_s, rows, passes)


def ulysses_cost(prof: ModelProfile, degree: int, link_bytes_per_s: float, latency_s: float) -> UlyssesCost:
    """The :class:`UlyssesCost` of ``prof``'s rows on a group of ``degree`` devices joined by ``link_bytes_per_s``."""
    return UlyssesCost(degree, geometry(prof), link_bytes_per_s, latency_s)


def group_speedup(cost: CostModel, name: str) -> float:
    """How much faster device ``name``'s SP group runs one rollout forward than one of its devices (1 without SP):
    the schedule's placement hint (``Device.speed``); the cost model prices every token itself."""
    u = cost.ulysses(name)
    if u is None:
        return 1.0
    prof = cost.profile
    one = prof.cfg_rollout * prof.forward_flops / (cost.specs[name].peak_bf16_flops * cost.params.mfu_rollout)
    return u.speedup(one, prof.cfg_rollout)


def group_devices(specs: dict[str, DeviceSpec], roles: dict[str, Role], sp: tuple[int, int]
                  ) -> tuple[dict[str, DeviceSpec], dict[str, Role], dict[str, int]]:
    """A placement's devices (in order) folded into SP groups: every ``sp[0]`` rollout devices of one type, every
    ``sp[1]`` trainer or hybrid devices, become one simulated actor named after its first device (a remainder too
    small for a group stays idle: left out). Returns the groups' specs, roles and degrees."""
    out_specs: dict[str, DeviceSpec] = {}
    out_roles: dict[str, Role] = {}
    degrees: dict[str, int] = {}
    pending: dict[tuple[str, Role], list[str]] = {}
    for name, spec in specs.items():
        role = roles[name]
        k = sp[0] if role is Role.ROLLOUT else sp[1]
        members = pending.setdefault((spec.name, role), [])
        members.append(name)
        if len(members) == k:
            first = members[0]
            out_specs[first], out_roles[first], degrees[first] = spec, role, k
            members.clear()
    return out_specs, out_roles, degrees


@dataclass(frozen=True, slots=True)
class SequenceRuns:
    """The SP degrees (rollout, trainer) each run of a scenario uses: digenrl's schedules and each peer's, with what
    is known of the peer's (``note``)."""

    digenrl: tuple[int, int]
    peers: tuple[tuple[str, tuple[int, int], str], ...] = ()

    def of(self, run: str) -> tuple[int, int]:
        """The degrees of ``run`` (a schedule or peer name)."""
        return next((sp for name, sp, _ in self.peers if name == run), self.digenrl)

    def describe(self) -> str:
        """One line: every run's SP and where it comes from."""
        a, b = self.digenrl
        return "; ".join([f"digenrl: rollout SP {a}, trainer SP {b} (what `digenrl plan` needs to fit)"]
                         + [f"{name}: rollout SP {x}, trainer SP {y} ({note})" for name, (x, y), note in self.peers])
