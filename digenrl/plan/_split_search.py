"""The candidates of one ``plan --fleet`` search: a fleet's devices in generation order, each placement
(split, token sizes) simulated once and remembered, and the search steps over them (``fleet.plan_fleet``
runs them; its module docstring says why each step is what it is).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

from digenrl.config import Config, ScheduleConfig, resolve_shard
from digenrl.errors import ConfigError
from digenrl.plan.memory import GB, MemoryPlan, Traces, memory_plan
from digenrl.schedule import make_schedule
from digenrl.schedule.base import Device, Role, Workload
from digenrl.schedule.options import PRESETS, resolve, with_overrides
from digenrl.sim.bench import pool_bubbles
from digenrl.sim.calibration import schedule_params
from digenrl.sim.cost import CostModel
from digenrl.sim.devices import device_spec
from digenrl.sim.engine import simulate
from digenrl.sim.sequence import group_speedup
from digenrl.sim.link_traffic import LinkBytes, LinkTraffic
from digenrl.sim.measured import MeasuredCost
from digenrl.sim.profiles import ModelProfile
from digenrl.sim.user import Pool
from digenrl.telemetry.stats import summarize

# (rollout devices, tag_steps, fragment_groups, train_pack); 0 sizes: the config's (else the schedule's defaults)
Key = tuple[int, int, int, int]
# train_pack of a searched split: the schedule's default for its trainers (a quarter of one's share), not the config's,
# which is sized for the config's own trainer count (configs/sd3_nft.toml: 247 rows, a sixth of 7 trainers' share)
SCALED = -1
# What every split is compared with: the same devices each sampling and training (digenrl's colocated loop, packed)
HYBRID = "colocated-tsp"


@dataclass
class Candidate:
    """One placement and its predicted figures."""

    rollout: dict[str, int]  # device type -> rollout devices of that type
    trainer: dict[str, int]
    tag_steps: int
    fragment_groups: int
    rows_per_pass: int
    train_pack: int = 0  # rows per TRAIN token at unit speed (resolved: what the schedule uses)
    samples_per_s: float = 0.0
    bubble_rollout: float = 0.0
    bubble_trainer: float = 0.0
    staleness: int = 0
    bubble_by_pool: dict[str, float] = field(default_factory=dict)  # device type -> mean bubble, any role
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> {gb, capacity_gb, device}
    shipped: bool = False  # the config's own placement and token sizes
    schedule: str = ""  # the schedule it runs: "" the config's; HYBRID: every device (in ``trainer``) samples and trains
    links: dict[str, Any] = field(default_factory=dict)  # far site -> what its link carried (LinkTraffic.report)
    rollout_sp: int = 1  # devices per rollout actor / trainer: sequence-parallel groups (``rollout`` counts actors)
    trainer_sp: int = 1

    @property
    def ident(self) -> tuple[object, ...]:
        return (tuple(self.rollout.items()), tuple(self.trainer.items()), self.tag_steps, self.fragment_groups,
                self.train_pack, self.rollout_sp, self.trainer_sp)

    @property
    def split(self) -> str:
        def side(d: dict[str, int]) -> str:
            return "+".join(f"{n}x{t}" for t, n in d.items() if n) or "0"
        sp = f", SP {self.rollout_sp}/{self.trainer_sp}" if (self.rollout_sp, self.trainer_sp) != (1, 1) else ""
        if self.schedule == HYBRID:
            return f"{HYBRID} {side(self.trainer)} (each samples, trains{sp})"
        return f"rollout {side(self.rollout)} / trainer {side(self.trainer)}{sp}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "split": self.split}


def placed_config(cfg: Config, rollout: dict[str, int], trainer: dict[str, int], tag_steps: int, fragment_groups: int,
                  rows: int, train_pack: int = 0, schedule: str = "") -> Config:
    """``cfg`` placed as the candidate says (types: the trainers' for ``gpu``, the rollout's for ``rollout_gpu``;
    ``train_pack`` 0: the config's; ``schedule``: another schedule, at its default token sizes)."""
    n_roll, n_train = sum(rollout.values()), sum(trainer.values())
    gpu = smallest_type(trainer)
    rollout_gpu = smallest_type(rollout) if n_roll else ""
    # A fleet's device hosts one actor: the split counts devices (actors_per_gpu = 1)
    place = replace(cfg.placement, rollout=n_roll, trainer=n_train, gpu=gpu, actors_per_gpu=1,
                    rollout_gpu="" if rollout_gpu == gpu else rollout_gpu, workers=0)
    if cfg.placement.workers:  # one joined worker a process (an SP group's actor is several)
        place = replace(place, workers=place.actors)
    sched = ScheduleConfig(name=schedule, fragment_groups=fragment_groups, train_pack=train_pack) if schedule else replace(
        cfg.schedule, tag_steps=tag_steps, fragment_groups=fragment_groups, train_pack=train_pack or cfg.schedule.train_pack)
    return replace(cfg, placement=place, schedule=sched, train=replace(cfg.train, rows_per_pass=rows),
                   model=replace(cfg.model, device="cuda"))


def smallest_type(types: dict[str, int]) -> str:
    """The device type with the least memory among those used (a role must fit all of them)."""
    used = [t for t, n in types.items() if n]
    return min(used, key=lambda t: device_spec(t).memory_bytes) if used else "H100"


def max_rows(cfg: Config, traces: Traces, cap_rows: int) -> tuple[int, MemoryPlan | None]:
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


class SplitSearch:
    """Placements of ``cfg`` on ``pools``, simulated for ``workload`` and memoised by :data:`Key`.

    Devices are ordered by how much they should generate (those that may not train first, then the
    slowest); a split is "the first R devices generate", R in ``lo..hi``.

    Raises:
        ConfigError: no device type holds a trainer, or no split leaves both a trainer and a rollout device.
    """

    def __init__(self, cfg: Config, pools: tuple[Pool, ...], traces: Traces, workload: Workload,
                 fitted: ModelProfile, params: dict[str, float], measured: MeasuredCost | None,
                 link_bytes: LinkBytes | None = None) -> None:
        self.cfg, self.traces, self.workload = cfg, traces, workload
        self.fitted, self.params, self.measured = fitted, params, measured
        self.tag = PRESETS[cfg.schedule.name].tag
        self.opts = with_overrides(PRESETS[cfg.schedule.name], cfg.schedule_options)
        self.ref = device_spec("H800").peak_bf16_flops
        self.results: dict[Key, Candidate | None] = {}  # None: that split or its sizes do not fit
        self._split: dict[tuple[int, int, int], Candidate | None] = {}  # step 1: (R, sizes asked) -> what was run
        self.simulations = 0
        self.pools = pools
        # pools behind a link (plan/links.py admitted them): their traffic is simulated, priced by link_bytes
        self.far = {p.device: p.link for p in pools if p.link is not None}
        self.link_bytes = link_bytes
        self.sp = (cfg.placement.sp_of("rollout"), cfg.placement.sp_of("trainer"))  # devices per actor (plan/sequence.py)
        self._place_roles(pools)

    # -- the fleet's devices ---------------------------------------------------------------------------
    def _place_roles(self, pools: tuple[Pool, ...]) -> None:
        """Which device types may hold which role (memory at the smallest token sizes), their order, lo..hi."""
        cfg = self.cfg
        n_total = sum(p.count for p in pools)

        def role_ok(role: str, dtype: str) -> bool:
            probe = placed_config(cfg, {dtype: 1}, {dtype: max(1, (n_total - self.sp[0]) // self.sp[1])}, 1, 1, 1)
            return memory_plan(probe, self.traces).roles[role].fits

        types = {p.device for p in pools}
        self.may_roll = {t for t in types if any(p.device == t and "rollout" in p.roles for p in pools)
                         and role_ok("rollout", t)}
        self.may_train = {t for t in types if any(p.device == t and "trainer" in p.roles for p in pools)
                          and role_ok("trainer", t)}
        self.unused = [f"{p.count}x{p.device} (no role fits its {device_spec(p.device).memory_bytes / GB:.0f} GB or "
                       "is allowed)" for p in pools if p.device not in self.may_roll | self.may_train]
        if not self.may_train:
            raise ConfigError(f"the fleet has no device type whose memory holds a trainer of {cfg.model.name} "
                              "(see `digenrl plan CONFIG`); change train.rows_per_pass, train.grad_checkpointing, "
                              "train.shard or model.finetune, or add larger devices")
        # devices in generation-preference order: rollout-only first, then slowest first
        # (in units of the larger SP group: a unit is u / rollout_sp rollout actors or u / trainer_sp trainers)
        self.order: list[str] = []
        u = max(self.sp)
        for p in sorted(pools, key=lambda p: (p.device in self.may_train, device_spec(p.device).peak_bf16_flops)):
            if p.device in self.may_roll | self.may_train:
                self.order += [p.device] * (p.count // u)
                if p.count % u:
                    self.unused.append(f"{p.count % u}x{p.device} (not a whole SP group of {u})")
        must_roll = sum(1 for t in self.order if t not in self.may_train)
        can_roll = sum(1 for t in self.order if t in self.may_roll)
        # 0 rollout devices: the trainers generate
        self.lo = must_roll if self.trainers_generate(len(self.order)) else max(1, must_roll)
        self.hi = min(can_roll, len(self.order) - 1)
        if self.lo > self.hi:
            raise ConfigError(f"no split of the fleet leaves both a trainer and (for {cfg.schedule.name}) a rollout "
                              "device that fit their memory")

    def trainers_generate(self, n_train: int) -> bool:
        """TAG on ``n_train`` trainers: FSDP ones do not generate (a forward is a collective of the group),
        as ``Config.trainers_generate`` and the coordinator say."""
        return self.tag and resolve_shard(self.cfg.train.shard, self.cfg.model.finetune, n_train) != "fsdp"

    def _sides(self, r: int) -> tuple[dict[str, int], dict[str, int]]:
        roll: dict[str, int] = {}
        train: dict[str, int] = {}
        u = max(self.sp)
        for i, t in enumerate(self.order):
            side = roll if i < r else train
            side[t] = side.get(t, 0) + u // self.sp[0 if i < r else 1]  # actors of the unit
        return roll, train

    # -- one candidate -----------------------------------------------------------------------------
    def evaluate(self, r: int, tag_steps: int, groups: int, pack: int = 0) -> Candidate | None:
        """The candidate of ``r`` rollout devices with these token sizes, simulated (None: it does not fit)."""
        if pack == SCALED and self.opts.train_pack is None:
            pack = 0  # the same placement
        key = (r, tag_steps, groups, pack)
        if key in self.results:
            return self.results[key]
        roll, train = self._sides(r)
        n_roll, n_train = sum(roll.values()), sum(train.values())
        if n_train == 0 or any(t not in self.may_train for t in train) or any(t not in self.may_roll for t in roll):
            self.results[key] = None  # known, so the search's climb does not ask again
            return None
        sizes = resolve(replace(self.opts, tag_steps=tag_steps or None, fragment_groups=groups or None,
                                train_pack=None if pack == SCALED else pack or self.opts.train_pack),
                        self.workload, n_roll, n_train)
        variant = placed_config(self.cfg, roll, train, sizes.tag_steps, sizes.fragment_groups, 1, sizes.train_pack)
        rows, plan = max_rows(variant, self.traces, max(1, sizes.train_pack))
        if plan is None:
            self.results[key] = None
            return None
        cand = Candidate(roll, train, sizes.tag_steps, sizes.fragment_groups, rows, sizes.train_pack,
                         rollout_sp=self.sp[0], trainer_sp=self.sp[1],
                         memory={name: {"gb": m.bytes_per_device / GB, "capacity_gb": m.capacity / GB,
                                        "device": m.device} for name, m in plan.roles.items()})
        self.run(cand, r, self.workload)
        self.results[key] = cand
        return cand

    def run(self, cand: Candidate, r: int, w: Workload) -> None:
        """Simulate ``cand`` (its first ``r`` devices generate; a HYBRID candidate: all sample and train) for ``w``
        and record the steady figures."""
        cfg = self.cfg
        if cand.schedule == HYBRID:
            order = [t for t, n in cand.trainer.items() for _ in range(n)]
            self._simulate(cand, order, [Role.HYBRID] * len(order), w, HYBRID,
                           {"fragment_groups": cand.fragment_groups, "train_pack": cand.train_pack})
            return
        sizes = {"tag_steps": cand.tag_steps, "fragment_groups": cand.fragment_groups,
                 **({"train_pack": cand.train_pack} if cand.train_pack else {})}
        roll, train = self._sides(r)
        options = {**sizes, **({"tag": False} if self.tag and not self.trainers_generate(sum(train.values())) else {}),
                   **{k: v for k, v in cfg.schedule_options.items() if k not in sizes},
                   **({"staleness": cfg.schedule.staleness} if cfg.schedule.staleness else {})}
        order = [t for side in (roll, train) for t, n in side.items() for _ in range(n)]  # one a simulated actor
        roles = [Role.ROLLOUT] * sum(roll.values()) + [Role.TRAINER] * sum(train.values())
        self._simulate(cand, order, roles, w, cfg.schedule.name, options)

    def _simulate(self, cand: Candidate, order: list[str], role_of: list[Role], w: Workload, schedule_name: str,
                  options: dict[str, object]) -> None:
        measured = self.measured
        names, specs, roles = [], {}, {}
        for i, (t, role) in enumerate(zip(order, role_of, strict=True)):
            name = f"{t.lower()}-{i}"
            names.append(name)
            specs[name] = device_spec(t)
            roles[name] = role
        # (the hybrid placement pays what digenrl's colocated loop pays: no engine switch, no log-prob recompute)
        params = schedule_params(HYBRID) if schedule_name == HYBRID else self.params
        sp = {n: self.sp[0] if roles[n] is Role.ROLLOUT else self.sp[1] for n in names}  # SP groups (sim/sequence.py)
        cost: MeasuredCost | CostModel = measured or CostModel(self.fitted, specs, params, roles, sp=sp)
        # measured costs are already this device's seconds: speed 1; an SP group is its speedup faster
        devices = [Device(n, roles[n], 1.0 if measured else specs[n].peak_bf16_flops / self.ref
                          * group_speedup(cost, n)) for n in names]  # type: ignore[arg-type]
        schedule = make_schedule(schedule_name, devices, w, cost, **options)
        # measured on one host: its processes share its cores as the bench measured (None: each owns its compute)
        traffic = LinkTraffic.for_devices({n: specs[n].name for n in names}, self.far, self.link_bytes or
                                          LinkBytes.of_profile(self.fitted, grad_bytes=params.grad_bytes),
                                          w.trained_steps) if self.far else None
        res = simulate(schedule, devices, w, cost, contention=measured.contention if measured else None, links=traffic)
        st = summarize(res)
        self.simulations += 1
        cand.bubble_by_pool = pool_bubbles(res, sorted(set(order)), st.steady.start, st.steady.end)
        cand.samples_per_s, cand.staleness = st.steady.samples_per_s, st.max_staleness
        cand.bubble_rollout, cand.bubble_trainer = st.steady.bubble_rollout, st.steady.bubble_trainer
        cand.links = traffic.report(w.num_batches, res.wall) if traffic is not None else {}

    def hybrid(self, w: Workload) -> tuple[Candidate | None, str]:
        """The :data:`HYBRID` placement on the devices that may hold both roles and whose memory holds a device
        that samples and trains (the largest types first: a type that does not fit is left out), simulated for
        ``w``; or None and why there is none."""
        counts: dict[str, int] = {}
        for p in self.pools:
            if {"rollout", "trainer"} <= set(p.roles) and p.device in self.may_train:
                counts[p.device] = counts.get(p.device, 0) + p.count // self.sp[1]  # hybrids: trainer-sized groups
        while counts:
            n = sum(counts.values())
            for groups in (0, 1):  # the schedule's fragments (a device's share of the prompts), else one prompt each
                try:
                    variant = placed_config(self.cfg, {}, counts, 0, groups, 1, schedule=HYBRID)
                except ConfigError as exc:  # e.g. FSDP trainers: a forward is a collective, no device samples alone
                    return None, f"{HYBRID} not compared: {exc}"
                sizes = resolve(replace(PRESETS[HYBRID], fragment_groups=groups or None), self.workload, n, n)
                rows, plan = max_rows(variant, self.traces, max(1, sizes.train_pack))
                if plan is not None:
                    cand = Candidate({}, dict(counts), 0, sizes.fragment_groups, rows, sizes.train_pack,
                                     trainer_sp=self.sp[1],
                                     schedule=HYBRID, memory={"hybrid": {
                                         "gb": m.bytes_per_device / GB, "capacity_gb": m.capacity / GB,
                                         "device": m.device} for m in plan.roles.values()})
                    self.run(cand, 0, w)
                    return cand, ""
            del counts[smallest_type(counts)]  # its memory cannot hold both roles: the larger types alone
        return None, (f"{HYBRID} not compared: no device type of the fleet may hold both roles with memory for a "
                      "device that samples and trains")

    # -- the search steps ----------------------------------------------------------------------------
    def at_split(self, r: int, tag_steps: int, groups: int) -> Candidate | None:
        """Step 1's candidate of split ``r``: with the given token sizes, or, where a rollout token of them does not
        fit the memory (fewer rollout devices: larger default fragments), with one prompt per fragment."""
        cand = self.evaluate(r, tag_steps, groups, SCALED)
        if cand is None and groups != 1:
            cand = self.evaluate(r, tag_steps, 1, SCALED)
        self._split[(r, tag_steps, groups)] = cand
        return cand

    def best_split(self, tag_steps: int, groups: int) -> int:
        """Step 1: the split, coarse to fine, with the given token sizes; returns the best R."""
        lo, hi = self.lo, self.hi
        step = max(1, math.ceil((hi - lo) / 8))
        grid = sorted({*range(lo, hi + 1, step), hi})
        best_r = max(grid, key=lambda r: self._score_of(self.at_split(r, tag_steps, groups)))
        while step > 1:
            step = max(1, step // 2)
            for r in (best_r - step, best_r + step):
                if lo <= r <= hi:
                    self.at_split(r, tag_steps, groups)
            best_r = self._best_known(tag_steps, groups)
        # then climb one device at a time until both neighbours of the best are known: halving a step of 3 to 1
        # looks only next to the coarse best, and the best can move off it (hetero-flux: 9 -> 8, then 7 unseen)
        while fresh := [r for r in (best_r - 1, best_r + 1)
                        if lo <= r <= hi and (r, tag_steps, groups) not in self._split]:
            for r in fresh:
                self.at_split(r, tag_steps, groups)
            best_r = self._best_known(tag_steps, groups)
        return best_r

    @staticmethod
    def _score_of(c: Candidate | None) -> float:
        return c.samples_per_s if c else -1.0

    def _best_known(self, tag_steps: int, groups: int) -> int:
        return max((k[0] for k in self._split if k[1:] == (tag_steps, groups)),
                   key=lambda r: self._score_of(self._split[(r, tag_steps, groups)]))

    def top_splits(self, tag_steps: int, groups: int, n: int = 3) -> list[int]:
        """The ``n`` best splits of step 1, by their score with the given token sizes (or the fallback's)."""
        known = [k[0] for k in self._split if k[1:] == (tag_steps, groups)]
        return sorted(known, key=lambda r: -self._score_of(self._split[(r, tag_steps, groups)]))[:n]

    def tune_sizes(self, splits: list[int]) -> None:
        """Step 2: ``tag_steps`` and ``fragment_groups`` on a small grid for each of ``splits``, then ``train_pack``
        for the best of each split (:meth:`tune_packs`)."""
        ro = self.cfg.rollout
        quarter = max(1, math.ceil(ro.num_steps / 4))
        tag_options = sorted({1, 2, quarter, math.ceil(quarter / 2)}) if self.tag else [0]
        group_options = sorted({g for g in (1, 2, 4) if g <= ro.prompts_per_batch} | {0})
        for r in splits:
            for t in tag_options:
                for g in group_options:
                    self.evaluate(r, t, g, SCALED)
            self.tune_packs(r)

    def tune_packs(self, r: int, most: int = 3) -> None:
        """``train_pack`` for split ``r``'s best token sizes: the trainers take TRAIN tokens as they come free, so a
        batch ends when the last trainer's last token does, and with ``n`` trainers and ``R`` rows a batch in tokens
        of ``p`` rows the busiest trains ``ceil(ceil(R / p) / n) p`` rows where the mean is ``R / n`` (wan22-32 on
        14 + 18 H800: tokens of 15 rows keep 60 on the busiest where the mean is 57, a 5% bubble every batch).
        Tries the ``most`` sizes ``ceil(R / (n k))`` (k = 1..8 tokens a trainer) that waste least, the finer first on
        equal waste (the last tokens of a batch then spread more evenly over trainers that also help generate:
        qwen-nft-16 96.7% -> 98.3% of its bound at 32 rows a token instead of 64)."""
        known = [(k, c) for k, c in self.results.items() if k[0] == r and c is not None]
        if not known:
            return
        (_, t, g, _), best = max(known, key=lambda kc: kc[1].samples_per_s)
        n, rows = sum(best.trainer.values()), self.workload.rows_per_batch

        def waste(p: int) -> float:
            return math.ceil(math.ceil(rows / p) / n) * p * n / rows - 1.0

        packs = {math.ceil(rows / (n * k)) for k in range(1, 9)} - {best.train_pack}
        for p in sorted(packs, key=lambda p: (round(waste(p), 3), p))[:most]:
            self.evaluate(r, t, g, p)

    def ranked(self) -> list[Candidate]:
        """Every candidate that fits, best first, each placement once (two keys can resolve to the same sizes).

        Raises:
            ConfigError: none fits.
        """
        # ties (a trainer-bound pipeline runs at the trainers' pace whatever the rollout side does): fewer idle
        # devices first
        ranked = rank([c for c in self.results.values() if c is not None])
        seen, unique = set(), []
        for c in ranked:
            if c.ident not in seen:
                seen.add(c.ident)
                unique.append(c)
        if not unique:
            raise ConfigError("no placement of the fleet fits the memory plan; see `digenrl plan CONFIG`")
        return unique


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Best first: faster, then (ties) fewer idle devices."""
    return sorted(candidates, key=lambda c: (-round(c.samples_per_s, 6), c.bubble_rollout + c.bubble_trainer))
