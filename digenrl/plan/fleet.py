"""The split search of ``digenrl plan --fleet``: which devices generate, which train, and the token sizes.

For a config (model, batch, schedule) and a fleet (pools of catalog devices, each with the roles it may
hold), the search runs the real schedule code in the simulator (``sim.engine.simulate`` with the
calibrated cost model) for candidate placements, subject to the memory plan (every role fits its
device type), and ranks them by predicted steady samples/s:

1. **Which device takes which role.** Devices are ordered by how much they should generate: those
   that may not (or cannot, by memory) train first, then the slowest (a cheaper or slower device
   generates, the fastest train). A split is "the first R devices generate". R is searched
   coarse-to-fine: an even grid of at most 9 values over the feasible range, then the step halves
   around the best until it is 1: about 9 + 2·log2(N/8) simulations for N devices.
2. **Token sizes** for the best few splits: ``tag_steps`` (TAG helper granularity) and
   ``fragment_groups`` (prompts per fragment: rollout batch and streaming) on a small grid, each
   candidate checked against the rollout memory it implies.
3. ``rows_per_pass``: the simulator's cost does not depend on it (a pass's launch latency is small
   next to its compute), so it is the largest the trainer's memory allows, capped at a training
   token's rows: fewer passes, no memory risk.
4. **The shipped placement** (the config's own split and token sizes, when the fleet is the size the
   config places) is always a finalist and stays first unless another is predicted faster by more than
   ``tolerance``, the simulator's measured error (``plan --costs``: the report's ``placement_error``, the
   error of its costs on the ratio of two splits the bench ran; ``plan_error`` in reports before it).

Tokens are priced with the fitted utilisations on the config's own profile (:func:`config_profile`:
its model at ``model.variant``, resolution, frames, text length, CFG passes, trainable set), or with the
costs a ``bench bubbles --real`` report measured (``measured``, one device type); ``FleetPlan.cost_source``
says which. A bench scenario (``plan_scenario``) is priced with the scenario's profile, as its rows are.

Candidates' memory is priced with linear activation traces (two traced batch sizes per curve): on the meta
device a pass's peak is exactly affine in its batch (every activation scales with it; a test compares
with exact traces), so this is the memory plan's own figure, not an approximation. Each simulation runs ``batches`` optimizer
steps (default 6: one warm-up, five steady); the best five are simulated again over 20 (a short run's
steady window is narrow enough to misrank close candidates). A simulation costs time linear in devices x
tokens, and the split search needs about 9 + 2·log2(N/8) of them plus a fixed ~30 for the token sizes
and finalists. Measured (Qwen-Image, one prompt per GPU, this 2-core host): 32 H800s 42 simulations in
5 s, 128 in 9 s, 512 in 28 s, 1024 H800s 55 simulations in 67 s.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from digenrl.config import Config, load_config, resolve_shard
from digenrl.errors import ConfigError
from digenrl.plan.memory import GB, MemoryPlan, Traces, memory_plan, traces_for
from digenrl.sim.measured import MeasuredCost
from digenrl.sim.profiles import PROFILES, ModelProfile
from digenrl.sim.scenarios import PlannedSplit, Scenario
from digenrl.sim.user import ARCH_OF_MODEL, Pool

__all__ = ["Candidate", "FleetPlan", "config_profile", "plan_fleet", "plan_scenario", "scenario_config",
           "write_config"]

# The shipped config of each simulator profile: what a scenario is planned with (its memory plan).
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_CONFIG_OF_ARCH = {arch: name for name, arch in ARCH_OF_MODEL.items()}


@dataclass
class Candidate:
    """One placement and its predicted figures."""

    rollout: dict[str, int]  # device type -> rollout devices of that type
    trainer: dict[str, int]
    tag_steps: int
    fragment_groups: int
    rows_per_pass: int
    samples_per_s: float = 0.0
    bubble_rollout: float = 0.0
    bubble_trainer: float = 0.0
    staleness: int = 0
    bubble_by_pool: dict[str, float] = field(default_factory=dict)  # device type -> mean bubble, any role
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> {gb, capacity_gb, device}
    shipped: bool = False  # the config's own placement and token sizes

    @property
    def ident(self) -> tuple[object, ...]:
        return tuple(self.rollout.items()), tuple(self.trainer.items()), self.tag_steps, self.fragment_groups

    @property
    def split(self) -> str:
        def side(d: dict[str, int]) -> str:
            return "+".join(f"{n}x{t}" for t, n in d.items() if n) or "0"
        return f"rollout {side(self.rollout)} / trainer {side(self.trainer)}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "split": self.split}


@dataclass
class FleetPlan:
    """The ranked candidates (best first) and what the search did."""

    candidates: list[Candidate]
    simulations: int
    unused: list[str]
    notes: list[str]
    split_best: list[Candidate] = field(default_factory=list)  # per_split: the best of each split, best first
    cost_source: str = ""  # what priced the tokens (``sim.calibration.cost_source``)
    profile: dict[str, Any] | None = None  # the model profile priced (None: measured costs)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_json(self) -> dict[str, Any]:
        return {"cost_source": self.cost_source, "profile": self.profile,
                "candidates": [c.to_json() for c in self.candidates], "simulations": self.simulations,
                "unused": self.unused, "notes": self.notes, "split_best": [c.to_json() for c in self.split_best]}


def _profile_json(prof: ModelProfile) -> dict[str, Any]:
    s = prof.shape
    return {"name": prof.name, "arch": prof.arch, "variant": prof.size, "layers": prof.layers, "recipe": prof.recipe,
            "latent": [s.latent_frames, s.latent_height, s.latent_width], "text_tokens": s.text_tokens,
            "passes_per_step": prof.cfg_rollout, "trainable_params": prof.trainable_params,
            "forward_flops": prof.forward_flops, "reward_flops": prof.reward_flops}


def config_profile(cfg: Config, traces: Traces | None = None) -> ModelProfile:
    """The profile that prices ``cfg``'s tokens (``sim.profiles.model_profile`` of its ``[model]``: model,
    variant, ``layers``, resolution, frames, text length, CFG; and of its ``[reward]``: the weighted reward
    models' FLOPs), its transformer and trainable set as the memory plan counts them (the model and peft's
    targets on the meta device).

    Raises:
        ConfigError: a preset the profiles do not price (a tiny model), before anything is traced.
    """
    from digenrl.sim.profiles import model_profile

    model_profile(cfg.model)
    plan = memory_plan(cfg, traces)
    trainer = plan.roles.get("trainer") or next(iter(plan.roles.values()))
    # (two experts, Wan2.2 A14B: a rollout engine holds both; plan.transformer_params is one expert's)
    return model_profile(cfg.model, trainer.trainable_params, plan.transformer_params + plan.expert_params, cfg.reward,
                         input_images=cfg.input_images)


def _measured_note(cfg: Config, measured: MeasuredCost) -> str:
    """What the measured costs charge, term by term."""
    fits = measured.fits
    extra = [f"per-token overhead {measured.dispatch_s * 1e3:.2f} ms"]
    if "optim" in fits:
        extra.append(f"optimizer step {fits['optim'][0] * 1e3:.1f} ms"
                     + (f" + all-reduce {measured.allreduce.seconds(2) * 1e3:.2f} ms for 2 trainers"
                        if measured.allreduce else ""))
    if "publish" in fits:
        extra.append(f"publication {fits['publish'][0] * 1e3:.1f} ms")
    if measured.contention is not None:
        c = measured.contention
        extra.append(f"{c.cores} cores shared, slowdown " + ", ".join(
            [f"{f:.2f}x at {n} busy" for n, f in sorted(c.slowdown.items())]
            + [f"{f:.2f}x for {k}" for k, f in sorted(c.mix.items())]))
    terms = [f"{k} {o * 1e3:.2f} ms + {p * 1e3:.3f} ms/unit" + (f" + {measured.step_s * 1e3:.3f} ms/step"
                                                               if k == "rollout" else "")
             for k, (o, p) in sorted(fits.items()) if p]
    return (f"simulated with the token costs measured by `bench bubbles --real` on this device type "
            f"({', '.join(terms)}; {', '.join(extra)}); memory from {cfg.model.name} at its configured resolution")


def _variant(cfg: Config, rollout: dict[str, int], trainer: dict[str, int], tag_steps: int, fragment_groups: int,
             rows: int) -> Config:
    """``cfg`` placed as the candidate says (types: the trainers' for ``gpu``, the rollout's for ``rollout_gpu``)."""
    n_roll, n_train = sum(rollout.values()), sum(trainer.values())
    gpu = _smallest(trainer)
    rollout_gpu = _smallest(rollout) if n_roll else ""
    # A fleet's device hosts one actor: the split counts devices (actors_per_gpu = 1)
    place = replace(cfg.placement, rollout=n_roll, trainer=n_train, gpu=gpu, actors_per_gpu=1,
                    rollout_gpu="" if rollout_gpu == gpu else rollout_gpu,
                    workers=(n_roll + n_train + cfg.placement.reward) if cfg.placement.workers else 0)
    sched = replace(cfg.schedule, tag_steps=tag_steps, fragment_groups=fragment_groups)
    return replace(cfg, placement=place, schedule=sched, train=replace(cfg.train, rows_per_pass=rows),
                   model=replace(cfg.model, device="cuda"))


def _smallest(types: dict[str, int]) -> str:
    """The device type with the least memory among those used (a role must fit all of them)."""
    from digenrl.sim.devices import device_spec

    used = [t for t, n in types.items() if n]
    return min(used, key=lambda t: device_spec(t).memory_bytes) if used else "H100"


def _max_rows(cfg: Config, traces: Traces, cap_rows: int) -> tuple[int, MemoryPlan | None]:
    """The most training rows per pass (up to ``cap_rows``) with which every role fits, and that plan."""

    def plan(rows: int) -> MemoryPlan:
        return memory_plan(replace(cfg, train=replace(cfg.train, rows_per_pass=rows)), traces)

    best = plan(1)
    if not best.fits:
        return 0, None
    lo, hi = 1, cap_rows
    while lo < hi:  # activations grow with the rows, so fitting is monotone
        mid = (lo + hi + 1) // 2
        candidate = plan(mid)
        if candidate.fits:
            lo, best = mid, candidate
        else:
            hi = mid - 1
    return lo, best


def plan_fleet(cfg: Config, pools: tuple[Pool, ...], *, top: int = 5, batches: int = 6,
               final_batches: int = 20, measured: MeasuredCost | None = None, tolerance: float = 0.0,
               per_split: bool = False, prof: ModelProfile | None = None) -> FleetPlan:
    """Search placements of ``cfg`` on ``pools`` (see the module docstring); best first.

    ``measured``: price tokens with costs measured on the fleet's device (``bench bubbles --real``)
    instead of the model's GPU profile: a plan for the very machine the bench ran on (pools of the one
    device type it measured).

    ``prof``: the model profile the fitted cost model prices (default: :func:`config_profile`, the
    config's model at its variant, resolution, frames and text length).

    ``tolerance``: the simulator's measured relative error. When the fleet has as many devices as the
    config places, the config's own placement (its split and token sizes, "shipped") is always among
    the finalists, and it stays first unless the best candidate is predicted more than ``tolerance``
    faster: a win inside the model's error is no reason to leave a placement that was measured.

    ``per_split``: also re-simulate the best candidate of every split evaluated and return them in
    ``split_best`` (``bench bubbles --real --plan-check`` runs each split's best for real).

    Raises:
        ConfigError: no placement fits the fleet's memory, the schedule cannot use the fleet, the model's
            preset has no FLOP profile (without ``measured``), or ``measured`` does not price the fleet's
            device types.
    """
    from digenrl.policy import trained_steps
    from digenrl.schedule import make_schedule
    from digenrl.schedule.base import Device, Role, Workload
    from digenrl.schedule.options import PRESETS, resolve, with_overrides
    from digenrl.sim.calibration import calibrated_params, cost_source
    from digenrl.sim.bench import pool_bubbles
    from digenrl.sim.cost import CostModel
    from digenrl.sim.devices import device_spec
    from digenrl.sim.engine import simulate
    from digenrl.telemetry.stats import summarize

    if cfg.schedule.name == "colocated":
        raise ConfigError("schedule.name: 'colocated' has no split to search; plan an actor schedule (e.g. async1)")
    ro = cfg.rollout
    params = calibrated_params()
    workload = Workload(batches, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    tag = PRESETS[cfg.schedule.name].tag
    if measured is not None:  # before anything is built
        measured.check_fleet({p.device for p in pools}, "the fleet " + "+".join(f"{p.count}x{p.device}" for p in pools))
    traces = traces_for(cfg, linear=True)
    memory = f"memory from {cfg.model.name} {cfg.model.variant} at its configured resolution".replace("  ", " ")
    if measured is not None:
        notes = [_measured_note(cfg, measured)] + [f"measured costs: {n}" for n in measured.notes]
        fitted = prof or PROFILES[ARCH_OF_MODEL[cfg.model.name]]  # unused: the measured costs price every token
    else:
        fitted = prof or config_profile(cfg, traces)
        notes = [f"tokens priced on the {fitted.name} profile ({fitted.recipe}); " + memory if prof else
                 f"{memory} (the memory plan), tokens on the same shapes (the {fitted.name} profile)"]
    source = cost_source(fitted, measured, params)
    ref = device_spec("H800").peak_bf16_flops

    # -- which device types may hold which role (memory at the smallest token sizes) ----------------
    n_total = sum(p.count for p in pools)

    def role_ok(role: str, dtype: str) -> bool:
        probe = _variant(cfg, {dtype: 1}, {dtype: max(1, n_total - 1)}, 1, 1, 1)
        return memory_plan(probe, traces).roles[role].fits

    types = {p.device for p in pools}
    may_roll = {t for t in types if any(p.device == t and "rollout" in p.roles for p in pools) and role_ok("rollout", t)}
    may_train = {t for t in types if any(p.device == t and "trainer" in p.roles for p in pools)
                 and role_ok("trainer", t)}
    unused = [f"{p.count}x{p.device} (no role fits its {device_spec(p.device).memory_bytes / GB:.0f} GB or is allowed)"
              for p in pools if p.device not in may_roll | may_train]
    if not may_train:
        raise ConfigError(f"the fleet has no device type whose memory holds a trainer of {cfg.model.name} "
                          "(see `digenrl plan CONFIG`); change train.rows_per_pass, train.grad_checkpointing, "
                          "train.shard or model.finetune, or add larger devices")

    # devices in generation-preference order: rollout-only first, then slowest first
    order: list[str] = []
    for p in sorted(pools, key=lambda p: (p.device in may_train, device_spec(p.device).peak_bf16_flops)):
        if p.device in may_roll | may_train:
            order += [p.device] * p.count
    must_roll = sum(1 for t in order if t not in may_train)
    can_roll = sum(1 for t in order if t in may_roll)
    def trainers_generate(n_train: int) -> bool:
        """TAG on ``n_train`` trainers: FSDP ones do not generate (a forward is a collective of the group),
        as ``Config.trainers_generate`` and the coordinator say."""
        return tag and resolve_shard(cfg.train.shard, cfg.model.finetune, n_train) != "fsdp"

    lo = must_roll if trainers_generate(len(order)) else max(1, must_roll)  # 0 rollout devices: trainers generate
    hi = min(can_roll, len(order) - 1)
    if lo > hi:
        raise ConfigError(f"no split of the fleet leaves both a trainer and (for {cfg.schedule.name}) a rollout device "
                          "that fit their memory")

    opts = with_overrides(PRESETS[cfg.schedule.name], cfg.schedule_options)
    simulations = 0
    results: dict[tuple[int, int, int], Candidate | None] = {}  # None: that split or its sizes do not fit

    def sides(r: int) -> tuple[dict[str, int], dict[str, int]]:
        roll: dict[str, int] = {}
        train: dict[str, int] = {}
        for i, t in enumerate(order):
            side = roll if i < r else train
            side[t] = side.get(t, 0) + 1
        return roll, train

    def evaluate(r: int, tag_steps: int, groups: int) -> Candidate | None:
        key = (r, tag_steps, groups)
        if key in results:
            return results[key]
        roll, train = sides(r)
        n_roll, n_train = sum(roll.values()), sum(train.values())
        if n_train == 0 or any(t not in may_train for t in train) or any(t not in may_roll for t in roll):
            results[key] = None  # known, so the search's climb does not ask again
            return None
        sizes = resolve(replace(opts, tag_steps=tag_steps or None, fragment_groups=groups or None), workload,
                        n_roll, n_train)
        variant = _variant(cfg, roll, train, sizes.tag_steps, sizes.fragment_groups, 1)
        rows, plan = _max_rows(variant, traces, max(1, sizes.train_pack))
        if plan is None:
            results[key] = None
            return None
        cand = Candidate(roll, train, sizes.tag_steps, sizes.fragment_groups, rows,
                         memory={name: {"gb": m.bytes_per_device / GB, "capacity_gb": m.capacity / GB,
                                        "device": m.device} for name, m in plan.roles.items()})
        run(cand, r, workload)
        results[key] = cand
        return cand

    def run(cand: Candidate, r: int, w: Workload) -> None:
        """Simulate ``cand`` (its first ``r`` devices generate) for ``w`` and record the steady figures."""
        nonlocal simulations
        names, specs, roles = [], {}, {}
        for i, t in enumerate(order):
            name = f"{t.lower()}-{i}"
            names.append(name)
            specs[name] = device_spec(t)
            roles[name] = Role.ROLLOUT if i < r else Role.TRAINER
        # measured costs are already this device's seconds: speed 1
        devices = [Device(n, roles[n], 1.0 if measured else specs[n].peak_bf16_flops / ref) for n in names]
        cost: MeasuredCost | CostModel = measured or CostModel(fitted, specs, params, roles)
        schedule = make_schedule(cfg.schedule.name, devices, w, cost, tag_steps=cand.tag_steps,
                                 **({"tag": False} if tag and not trainers_generate(len(order) - r) else {}),
                                 fragment_groups=cand.fragment_groups,
                                 **{k: v for k, v in cfg.schedule_options.items() if k not in ("tag_steps",
                                                                                               "fragment_groups")},
                                 **({"staleness": cfg.schedule.staleness} if cfg.schedule.staleness else {}))
        # measured on one host: its processes share its cores as the bench measured (None: each owns its compute)
        res = simulate(schedule, devices, w, cost, contention=measured.contention if measured else None)
        st = summarize(res)
        simulations += 1
        cand.bubble_by_pool = pool_bubbles(res, sorted(set(order)), st.steady.start, st.steady.end)
        cand.samples_per_s, cand.staleness = st.steady.samples_per_s, st.max_staleness
        cand.bubble_rollout, cand.bubble_trainer = st.steady.bubble_rollout, st.steady.bubble_trainer

    def score(c: Candidate | None) -> float:
        return c.samples_per_s if c else -1.0

    # 1. the split, coarse to fine, with the config's token sizes
    base_tag, base_groups = cfg.schedule.tag_steps, cfg.schedule.fragment_groups
    step = max(1, math.ceil((hi - lo) / 8))
    grid = sorted({*range(lo, hi + 1, step), hi})
    best_r = max(grid, key=lambda r: score(evaluate(r, base_tag, base_groups)))
    while step > 1:
        step = max(1, step // 2)
        for r in (best_r - step, best_r + step):
            if lo <= r <= hi:
                evaluate(r, base_tag, base_groups)
        best_r = max((k[0] for k in results if k[1:] == (base_tag, base_groups)),
                     key=lambda r: score(results.get((r, base_tag, base_groups))))
    # then climb one device at a time until both neighbours of the best are known: halving a step of 3 to 1
    # looks only next to the coarse best, and the best can move off it (hetero-flux: 9 -> 8, then 7 unseen)
    while fresh := [r for r in (best_r - 1, best_r + 1)
                    if lo <= r <= hi and (r, base_tag, base_groups) not in results]:
        for r in fresh:
            evaluate(r, base_tag, base_groups)
        best_r = max((k[0] for k in results if k[1:] == (base_tag, base_groups)),
                     key=lambda r: score(results.get((r, base_tag, base_groups))))
    # 2. token sizes for the three best splits
    splits = sorted({k[0] for k in results}, key=lambda r: -score(results.get((r, base_tag, base_groups))))[:3]
    quarter = max(1, math.ceil(ro.num_steps / 4))
    tag_options = sorted({1, 2, quarter, math.ceil(quarter / 2)}) if tag else [0]
    group_options = sorted({g for g in (1, 2, 4) if g <= ro.prompts_per_batch} | {0})
    for r in splits:
        for t in tag_options:
            for g in group_options:
                evaluate(r, t, g)
    # ties (a trainer-bound pipeline runs at the trainers' pace whatever the rollout side does): fewer idle
    # devices first
    ranked = sorted((c for c in results.values() if c is not None),
                    key=lambda c: (-round(c.samples_per_s, 6), c.bubble_rollout + c.bubble_trainer))
    # distinct placements only (two keys can resolve to the same sizes)
    seen, unique = set(), []
    for c in ranked:
        if c.ident not in seen:
            seen.add(c.ident)
            unique.append(c)
    if not unique:
        raise ConfigError("no placement of the fleet fits the memory plan; see `digenrl plan CONFIG`")
    # the config's own placement, when the fleet is the size it places
    shipped = None
    place = cfg.placement
    if place.rollout + place.trainer == len(order) and lo <= place.rollout <= hi:
        shipped = evaluate(place.rollout, base_tag, base_groups)
    # the finalists again over a longer run: a short one's steady window is only a few batches wide, so
    # the order of close candidates can flip (hetero-flux: 8 L40S rollout leads 7 over 6 batches, 7 leads
    # by 2% over 20); every one of the three best splits keeps its best token sizes among them
    finalists = unique[:max(top, 5)]
    for r in splits:
        best_of_split = next((c for c in unique if sum(c.rollout.values()) == r), None)
        if best_of_split is not None and best_of_split not in finalists:
            finalists.append(best_of_split)
    if shipped is not None:
        shipped.shipped = True
        finalists = [c for c in finalists if c.ident != shipped.ident] + [shipped]
    if per_split:
        splits = {c.ident[:2] for c in finalists}
        for c in unique:  # best first: the first of each split not among the finalists yet
            if c.ident[:2] not in splits:
                splits.add(c.ident[:2])
                finalists.append(c)
    final = replace(workload, num_batches=final_batches)
    for cand in finalists:
        run(cand, sum(cand.rollout.values()), final)
    unique = sorted(finalists, key=lambda c: (-round(c.samples_per_s, 6), c.bubble_rollout + c.bubble_trainer))
    if shipped is not None and unique[0] is not shipped:
        best = unique[0]
        gain = best.samples_per_s / shipped.samples_per_s - 1.0 if shipped.samples_per_s else float("inf")
        if gain <= tolerance:
            unique.remove(shipped)
            unique.insert(0, shipped)
            notes.append(f"kept the shipped placement ({shipped.split}, tag_steps {shipped.tag_steps}, fragment_groups "
                         f"{shipped.fragment_groups}) first: the best predicted ({best.split}, tag_steps "
                         f"{best.tag_steps}, fragment_groups {best.fragment_groups}) is {gain:+.1%}, within the "
                         f"simulator's measured error ({tolerance:.1%})")
        else:
            notes.append(f"the best placement is predicted {gain:+.1%} faster than the shipped one ({shipped.split}, "
                         f"tag_steps {shipped.tag_steps}), beyond the simulator's measured error ({tolerance:.1%})")
    notes.append("rows_per_pass: the largest the trainer memory allows (capped at a training token's rows); "
                 "the simulator's cost does not depend on it")
    shown = unique[:top]
    if shipped is not None and shipped not in shown:
        shown.append(shipped)  # always shown: what the config runs now, to compare with
    split_best: list[Candidate] = []
    if per_split:
        for c in unique:
            if all(b.ident[:2] != c.ident[:2] for b in split_best):
                split_best.append(c)
    return FleetPlan(shown, simulations, unused, notes, split_best, source,
                     _profile_json(fitted) if measured is None else None)


def scenario_config(sc: Scenario) -> Config:
    """The shipped config of ``sc``'s model at the scenario's size (``model.variant``) with the scenario's batch
    (prompts x G, steps, trained steps); its resolution stays the config's (what the memory plan checks)."""
    return load_config(CONFIGS / f"{_CONFIG_OF_ARCH[sc.model]}.toml",
                       [f'model.variant="{sc.profile.size}"',
                        f"rollout.prompts_per_batch={sc.prompts}", f"rollout.group_size={sc.group_size}",
                        f"rollout.num_steps={sc.num_steps}", 'rollout.steps="window"',
                        f"rollout.window={sc.trained_steps}"])


def plan_scenario(sc: Scenario, pools: tuple[Pool, ...] | None = None, *, final_batches: int = 20,
                  measured: MeasuredCost | None = None) -> tuple[PlannedSplit, FleetPlan]:
    """The best placement of a bench scenario (``scenario_config``) on its fleet, as a ``PlannedSplit``,
    its tokens priced as the bench prices the scenario's rows: the scenario's profile, or ``measured``.

    ``pools``: the scenario's pools with their allowed roles (a user scenario file's); default: any role.

    Raises:
        ConfigError: no placement fits (e.g. a fragment's samples cannot be decoded on one device), or
            ``measured`` does not price the scenario's device types.
    """
    cfg = scenario_config(sc)
    result = plan_fleet(cfg, pools or tuple(Pool(t, n) for t, n in sc.pools), final_batches=final_batches,
                        measured=measured, prof=sc.profile)
    best = result.best
    options = {k: v for k, v in cfg.schedule_options.items() if k not in ("tag_steps", "fragment_groups")}
    options.update(tag_steps=best.tag_steps, fragment_groups=best.fragment_groups)
    if cfg.schedule.staleness:
        options["staleness"] = cfg.schedule.staleness
    return PlannedSplit(cfg.schedule.name, tuple((t, n) for t, n in best.rollout.items() if n),
                        tuple(options.items())), result


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        import json

        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} to TOML")


def write_config(source: Path, overrides: list[str], cand: Candidate, out: Path, cost_source: str = "") -> Config:
    """Write ``source`` (with ``overrides``) as a runnable config with the candidate's placement and sizes
    (its header comment names ``cost_source``, what priced the prediction).

    Returns the written config, loaded back (so validated) from ``out``.
    """
    from digenrl.config import apply_overrides

    data = apply_overrides(tomllib.loads(source.read_text()), overrides)
    cfg = load_config(source, overrides)
    chosen = _variant(cfg, cand.rollout, cand.trainer, cand.tag_steps, cand.fragment_groups, cand.rows_per_pass)
    place = data.setdefault("placement", {})
    place.update(rollout=chosen.placement.rollout, trainer=chosen.placement.trainer, gpu=chosen.placement.gpu)
    if chosen.placement.rollout_gpu:
        place["rollout_gpu"] = chosen.placement.rollout_gpu
    if cfg.placement.workers:
        place["workers"] = chosen.placement.workers
    data.setdefault("schedule", {}).update(tag_steps=cand.tag_steps, fragment_groups=cand.fragment_groups)
    data.setdefault("train", {})["rows_per_pass"] = cand.rows_per_pass
    lines = [f"# written by `digenrl plan {source} --fleet ...`: {cand.split}, predicted "
             f"{cand.samples_per_s:.3f} samples/s (simulator), bubbles rollout {cand.bubble_rollout:.1%} / trainer "
             f"{cand.bubble_trainer:.1%}, staleness {cand.staleness}"]
    if cost_source:
        lines.append(f"# costs: {cost_source}")
    for table, values in data.items():
        if not isinstance(values, dict):
            lines.insert(1, f"{table} = {_toml_value(values)}")
            continue
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return load_config(out)
