"""Sequence parallelism in the plan: memory per SP rank, the degree that makes a role fit, the degree a fleet runs.

Memory (``memory.memory_plan``): a role whose actors are SP groups of ``k`` devices (``PlacementConfig.sp_of``)
holds on each rank ``ceil(S / k) / S`` of the activations of a pass over sequences of ``S`` tokens (every tensor of a
block scales with the tokens it sees; after the all-to-all a rank holds all tokens of ``H / k`` heads, the same
bytes). Weights, LoRA, gradients and Adam states stay whole on every rank, unless the trainers shard them with FSDP:
then over the folded 2-D mesh, ``trainers x k`` ranks (UniRL's layout). VAE decoding and the reward models run whole
on one rank: their activations are not divided.

Fleet (``choose_sp``): for each role the smallest degree at which it fits at the config's token sizes
(``train.rows_per_pass`` and the rollout tokens as configured), then one degree more where the simulator's Ulysses
cost (``sim/sequence.py``) keeps each device at least ``PAYS`` as busy as alone (long sequences only); the split
search runs for each pair and the best is taken. A degree above the smallest is never needed to fit, so it is kept
only where the simulated run is faster.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from digenrl.config import Config
from digenrl.errors import ConfigError
from digenrl.sim.sequence import DEGREES, group_speedup

if TYPE_CHECKING:
    from digenrl.plan.fleet import FleetPlan
    from digenrl.plan.memory import MemoryPlan
    from digenrl.sim.user import Pool

__all__ = ["sequence_tokens", "activation_share", "with_sp", "fitting_sp", "group_speedup", "sp_candidates", "plan_fleet_sp", "PAYS"]

PAYS = 0.9  # a degree is worth simulating when each device of the group stays this busy (speedup / degree)
_ROLE_KEY = {"rollout": "rollout_sp", "trainer": "trainer_sp", "colocated": "trainer_sp"}


def sequence_tokens(cfg: Config) -> int:
    """The tokens of one row an SP group shards (``sim.sequence.geometry`` of the config's model), 0 if unknown."""
    from digenrl.sim.profiles import model_profile
    from digenrl.sim.sequence import geometry

    m = cfg.model
    try:  # a tiny preset has the published patching: price its shape as the published model's
        prof = model_profile(m if m.preset in ("pretrained", "full", "random") else replace(m, preset="full"),
                             trainable_params=0, transformer_params=1, input_images=cfg.input_images)
        return geometry(prof).tokens
    except (ConfigError, KeyError):
        return 0


def activation_share(cfg: Config, role: str) -> float:
    """The fraction of a pass's activations one rank of ``role``'s SP group holds: ``ceil(S / k) / S`` (``1 / k``
    when the sequence is unknown)."""
    k = cfg.placement.sp_of("trainer" if role == "colocated" else role)
    if k == 1:
        return 1.0
    tokens = sequence_tokens(cfg)
    return math.ceil(tokens / k) / tokens if tokens else 1.0 / k


def with_sp(cfg: Config, role: str, degree: int) -> Config:
    """``cfg`` with ``role``'s actors SP groups of ``degree`` devices (joined workers: one per process)."""
    place = replace(cfg.placement, **{_ROLE_KEY[role]: degree}, workers=0)
    return replace(cfg, placement=replace(place, workers=max(cfg.placement.workers, place.actors)
                                          if cfg.placement.workers else 0))


def fitting_sp(cfg: Config, plan: MemoryPlan, role: str) -> tuple[int, int] | None:
    """The smallest degree above ``role``'s own (up to a node's 8) at which it fits, and its bytes per device; None
    when none does (its weights or a decode alone do not fit)."""
    from digenrl.plan.memory import memory_plan

    own = cfg.placement.sp_of("trainer" if role == "colocated" else role)
    for degree in (d for d in DEGREES if d > own):
        try:
            replanned = memory_plan(with_sp(cfg, role, degree), plan.traces)
        except ConfigError:  # a layout the runtime does not run (FSDP trainers in SP groups, for now)
            return None
        r = replanned.roles[role]
        if r.fits:
            return degree, r.bytes_per_device
    return None


def _fits_at(cfg: Config, role: str, degree: int, device: str, traces: object) -> bool:
    """Whether ``role`` fits one ``device`` at SP ``degree`` with the config's own token sizes."""
    from digenrl.plan.memory import memory_plan

    place = replace(cfg.placement, gpu=device, rollout_gpu="")
    placed = with_sp(replace(cfg, placement=place, model=replace(cfg.model, device="cuda")), role, degree)
    try:
        return memory_plan(placed, traces).roles[role].fits  # type: ignore[arg-type]
    except ConfigError:  # a layout the runtime does not run (FSDP trainers in SP groups)
        return False


def _efficiency(cfg: Config, device: str, degree: int) -> float:
    """How busy each device of an SP group of ``degree`` stays on one rollout forward (speedup / degree)."""
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.devices import device_spec
    from digenrl.sim.profiles import model_profile
    from digenrl.sim.sequence import ulysses_cost

    prof, spec, params = model_profile(cfg.model), device_spec(device), calibrated_params()
    one = prof.cfg_rollout * prof.forward_flops / (spec.peak_bf16_flops * params.mfu_rollout)
    cost = ulysses_cost(prof, degree, spec.intra_node_bytes_per_s, params.collective_latency_s)
    return cost.speedup(one, prof.cfg_rollout) / degree


def sp_candidates(cfg: Config, pools: tuple[Pool, ...], traces: object,
                  measured: bool = False) -> tuple[list[tuple[int, int]], list[str]]:
    """The (rollout, trainer) SP degrees a fleet search tries (module docstring), and why, one note a role."""
    if measured:
        return [(1, 1)], ["sequence parallelism: SP 1 (measured costs price one device an actor)"]
    options, notes = {}, []
    tokens = sequence_tokens(cfg)
    for role in ("rollout", "trainer"):
        if role == "trainer" and _fsdp_trainers(cfg):
            options[role] = [1]
            notes.append("trainer: SP 1 (full fine-tuning shards over several trainers with FSDP, which "
                         "trainer_sp > 1 does not support yet)")
            continue
        types = sorted({p.device for p in pools if role in p.roles}, key=lambda t: -_memory(t))
        most = min([max((p.count for p in pools if p.device == t), default=1) for t in types[:1]] + [DEGREES[-1]])
        fit = next((d for d in DEGREES if d <= most and any(_fits_at(cfg, role, d, t, traces) for t in types)), None)
        if fit is None:
            options[role] = [1]  # the split search says why nothing fits
            continue
        why = (f"{role}: SP {fit} is the smallest degree whose memory fits at the config's token sizes" if fit > 1
               else f"{role}: SP 1 fits")
        options[role] = [fit]
        if 2 * fit <= most and types:
            eff = _efficiency(cfg, types[0], 2 * fit)
            if eff >= PAYS:
                options[role].append(2 * fit)
                why += f"; SP {2 * fit} keeps each device {eff:.0%} busy at {tokens} tokens: simulated too"
            else:
                why += f"; SP {2 * fit} would keep each device {eff:.0%} busy at {tokens} tokens: cannot pay, not tried"
        notes.append(why)
    r, t = options["rollout"], options["trainer"]
    pairs = [(r[0], t[0])] + [(x, t[0]) for x in r[1:]] + [(r[0], y) for y in t[1:]]
    return pairs, ["sequence parallelism: " + "; ".join(notes)]


def _fsdp_trainers(cfg: Config) -> bool:
    """Whether several trainers of this config would shard with FSDP (which SP trainers refuse): asked for, or
    ``auto`` with full fine-tuning (roles/trainer_group.resolve_shard's rule; roles sit above this layer)."""
    return cfg.train.shard == "fsdp" or (cfg.train.shard == "auto" and cfg.model.finetune == "full")


def _memory(device: str) -> float:
    from digenrl.sim.devices import device_spec

    return device_spec(device).memory_bytes


def plan_fleet_sp(cfg: Config, pools: tuple[Pool, ...], **kwargs: Any) -> FleetPlan:
    """``plan.fleet.plan_fleet`` with the SP degree of each role chosen (module docstring): the split search runs for
    every pair :func:`sp_candidates` gives, and the fastest plan is returned, its notes saying what each pair reached.

    Raises:
        ConfigError: no pair has a placement that fits (the message of the last one).
    """
    from digenrl.plan.fleet import plan_fleet
    from digenrl.plan.memory import traces_for

    pairs, notes = sp_candidates(cfg, pools, traces_for(cfg, linear=True), kwargs.get("measured") is not None)
    plans: list[tuple[tuple[int, int], FleetPlan]] = []
    error: ConfigError | None = None
    for a, b in pairs:
        try:
            plans.append(((a, b), plan_fleet(with_sp(with_sp(cfg, "rollout", a), "trainer", b), pools, **kwargs)))
        except ConfigError as exc:
            error = exc
            notes.append(f"SP {a}/{b} (rollout/trainer): {exc}")
    if not plans:
        raise error or ConfigError("no SP degree to try")
    (a, b), best = max(plans, key=lambda p: p[1].best.samples_per_s)
    ranked = ", ".join(f"SP {x}/{y}: {p.best.samples_per_s:.4f} samples/s" for (x, y), p in plans)
    notes.append(f"chose placement.rollout_sp = {a}, placement.trainer_sp = {b}" +
                 (f" (of {ranked})" if len(plans) > 1 else ""))
    best.notes[:0] = notes
    best.simulations = sum(p.simulations for _, p in plans)
    return best
