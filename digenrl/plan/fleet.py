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
   A split whose rollout token (at the given sizes) does not fit the memory is tried with one prompt
   per fragment before it is given up: fewer rollout devices mean larger default fragments, and the
   best split may be one of them (wan-16: 2 rollout devices, whose default fragments of 4 prompts at
   480x832x33 frames do not fit an H800).
2. **Token sizes** for the best few splits: ``tag_steps`` (TAG helper granularity) and
   ``fragment_groups`` (prompts per fragment: rollout batch and streaming) on a small grid, each
   candidate checked against the rollout memory it implies; then ``train_pack`` (rows per TRAIN token)
   for each split's best, the few sizes that leave the busiest trainer least above the mean
   (``SplitSearch.tune_packs``).
3. ``rows_per_pass``: the simulator's cost does not depend on it (a pass's launch latency is small
   next to its compute), so it is the largest the trainer's memory allows, capped at a training
   token's rows: fewer passes, no memory risk.
4. **The shipped placement** (the config's own split and token sizes, when the fleet is the size the
   config places) is always a finalist and stays first unless another is predicted faster by more than
   ``tolerance``, the simulator's measured error (``plan --costs``: the report's ``placement_error``, the
   error of its costs on the ratio of two splits the bench ran; ``plan_error`` in reports before it).
5. **No split at all**: the same devices each sampling and training (``colocated-tsp``, digenrl's colocated
   loop with TSP-packed training, no engine switch, stored log-probs) is simulated over the final run too,
   and goes first unless the best split is predicted faster by more than ``tolerance``: splitting is
   proposed only where the simulator says it pays (on a homogeneous fleet it often does not). A config whose
   schedule is colocated has its splits searched with ``async1``.

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

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from digenrl.config import Config, load_config
from digenrl.plan._split_search import HYBRID, Candidate, SplitSearch, placed_config, rank
from digenrl.plan.memory import Traces, memory_plan, traces_for
from digenrl.plan.rows import rollout_window, row_cost
from digenrl.plan.window import window_note
from digenrl.schedule.options import PRESETS
from digenrl.sim.link_traffic import LinkBytes
from digenrl.sim.links import Transfer
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


def _profile_json(prof: ModelProfile, rows_per_sample: int) -> dict[str, Any]:
    s = prof.shape
    return {"name": prof.name, "arch": prof.arch, "variant": prof.size, "layers": prof.layers, "recipe": prof.recipe,
            "latent": [s.latent_frames, s.latent_height, s.latent_width], "text_tokens": s.text_tokens,
            "passes_per_step": prof.cfg_rollout, "trainable_params": prof.trainable_params,
            "forward_flops": prof.forward_flops, "reward_flops": prof.reward_flops,
            "rows_per_sample": rows_per_sample, "nograd_forwards_per_row": prof.rows.nograd_forwards,
            "bytes_per_sample": prof.boundary_bytes(rows_per_sample)}


def config_profile(cfg: Config, traces: Traces | None = None) -> ModelProfile:
    """The profile that prices ``cfg``'s tokens (``sim.profiles.model_profile`` of its ``[model]``: model,
    variant, ``layers``, resolution, frames, text length, CFG; and of its ``[reward]``: the weighted reward
    models' FLOPs), its transformer and trainable set as the memory plan counts them (the model and peft's
    targets on the meta device), and what its algorithm adds per row and ships per sample (``plan.rows``).

    Raises:
        ConfigError: a preset the profiles do not price (a tiny model), before anything is traced.
    """
    from digenrl.sim.profiles import model_profile

    model_profile(cfg.model)
    plan = memory_plan(cfg, traces)
    trainer = plan.roles.get("trainer") or next(iter(plan.roles.values()))
    # (two experts, Wan2.2 A14B: a rollout engine holds both; plan.transformer_params is one expert's)
    prof = model_profile(cfg.model, trainer.trainable_params, plan.transformer_params + plan.expert_params, cfg.reward,
                         input_images=cfg.input_images, rows=row_cost(cfg))
    return replace(prof, window=rollout_window(cfg))  # (a moving window: each version's rollout forwards)


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


def plan_fleet(cfg: Config, pools: tuple[Pool, ...], *, top: int = 5, batches: int = 6,
               final_batches: int = 20, measured: MeasuredCost | None = None, tolerance: float = 0.0,
               per_split: bool = False, prof: ModelProfile | None = None, transfer: Transfer | None = None,
               link_bytes: LinkBytes | None = None) -> FleetPlan:
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

    ``transfer``, ``link_bytes``: pools behind a link (``Pool.link``) go to ``plan.links.plan_far_pools`` (refused,
    limited or used, and what their link costs), their publications sent as ``transfer`` (default: bf16);
    ``link_bytes`` is its call back, with the far pools admitted and their traffic priced.

    ``per_split``: also re-simulate the best candidate of every split evaluated and return them in
    ``split_best`` (``bench bubbles --real --plan-check`` runs each split's best for real).

    Raises:
        ConfigError: no placement fits the fleet's memory, the schedule cannot use the fleet, the model's
            preset has no FLOP profile (without ``measured``), or ``measured`` does not price the fleet's
            device types.
    """
    from digenrl.policy import trained_steps
    from digenrl.schedule.base import Workload
    from digenrl.sim.calibration import calibrated_params, cost_source

    if link_bytes is None and any(p.link is not None for p in pools):
        from functools import partial

        from digenrl.plan.links import plan_far_pools

        again = partial(plan_fleet, cfg, top=top, batches=batches, final_batches=final_batches, measured=measured,
                        tolerance=tolerance, per_split=per_split, prof=prof)
        return plan_far_pools(cfg, pools, again, transfer, measured)
    colocated_config = PRESETS[cfg.schedule.name].colocated
    if colocated_config:  # its splits: the full schedule's (what splitting the devices would run)
        cfg = replace(cfg, schedule=replace(cfg.schedule, name="async1"))
    ro = cfg.rollout
    params = calibrated_params()
    workload = Workload(batches, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    if measured is not None:  # before anything is built
        measured.check_fleet({p.device for p in pools}, "the fleet " + "+".join(f"{p.count}x{p.device}" for p in pools))
    traces = traces_for(cfg, linear=True)
    fitted, notes = _pricing(cfg, traces, measured, prof)
    search = SplitSearch(cfg, pools, traces, workload, fitted, params, measured, link_bytes)
    # 1. the split, coarse to fine, with the config's token sizes; 2. token sizes for the three best splits
    base = (cfg.schedule.tag_steps, cfg.schedule.fragment_groups)
    search.best_split(*base)
    splits = search.top_splits(*base)
    search.tune_sizes(splits)
    unique = search.ranked()
    # the config's own placement, when the fleet is the size it places
    shipped = None
    place = cfg.placement
    if (not colocated_config and place.rollout + place.trainer == len(search.order)
            and search.lo <= place.rollout <= search.hi):
        shipped = search.evaluate(place.rollout, *base)
    finalists = _finalists(unique, splits, shipped, top, per_split)
    final = replace(workload, num_batches=final_batches)
    for cand in finalists:
        search.run(cand, sum(cand.rollout.values()), final)
    unique = rank(finalists)
    if shipped is not None and unique[0] is not shipped:
        notes.append(_keep_or_leave_shipped(unique, shipped, tolerance))
    if colocated_config:
        notes.insert(0, "the config's schedule is colocated: its splits are searched with async1")
    hybrid = _no_split(search, final, unique, tolerance, cfg, notes)
    moving = window_note(fitted, cfg, pools[0].device, sum(p.count for p in pools)) if len(pools) == 1 else None
    notes.extend([moving] if moving else [])
    notes.append("rows_per_pass: the largest the trainer memory allows (capped at a training token's rows); "
                 "the simulator's cost does not depend on it")
    shown, split_best = _shown(unique, top, shipped, hybrid, per_split)
    return FleetPlan(shown, search.simulations, search.unused, notes, split_best,
                     cost_source(fitted, measured, params),
                     _profile_json(fitted, workload.trained_steps) if measured is None else None)


def _shown(unique: list[Candidate], top: int, shipped: Candidate | None, hybrid: Candidate | None,
           per_split: bool) -> tuple[list[Candidate], list[Candidate]]:
    """The best ``top`` plus what the config runs now and no split (to compare with); with ``per_split`` also the
    best of every split."""
    shown = unique[:top]
    shown += [c for c in (shipped, hybrid) if c is not None and c not in shown]
    split_best: list[Candidate] = []
    if per_split:
        for c in unique:
            if c is not hybrid and all(b.ident[:2] != c.ident[:2] for b in split_best):
                split_best.append(c)
    return shown, split_best


def _pricing(cfg: Config, traces: Traces, measured: MeasuredCost | None,
             prof: ModelProfile | None) -> tuple[ModelProfile, list[str]]:
    """The profile the fitted cost model prices (unused with ``measured``: its costs price every token), and
    the notes saying what prices the tokens and the memory."""
    memory = f"memory from {cfg.model.name} {cfg.model.variant} at its configured resolution".replace("  ", " ")
    if measured is not None:
        notes = [_measured_note(cfg, measured)] + [f"measured costs: {n}" for n in measured.notes]
        return prof or PROFILES[ARCH_OF_MODEL[cfg.model.name]], notes
    fitted = prof or config_profile(cfg, traces)
    return fitted, [f"tokens priced on the {fitted.name} profile ({fitted.recipe}); " + memory if prof else
                    f"{memory} (the memory plan), tokens on the same shapes (the {fitted.name} profile)"]


def _finalists(unique: list[Candidate], splits: list[int], shipped: Candidate | None, top: int,
               per_split: bool) -> list[Candidate]:
    """The candidates simulated again over a longer run: a short one's steady window is only a few batches
    wide, so the order of close candidates can flip (hetero-flux: 8 L40S rollout leads 7 over 6 batches, 7
    leads by 2% over 20). Every one of the three best splits keeps its best token sizes among them; the
    shipped placement is one; ``per_split``: the best of every split evaluated too."""
    finalists = unique[:max(top, 5)]
    for r in splits:
        best_of_split = next((c for c in unique if sum(c.rollout.values()) == r), None)
        if best_of_split is not None and best_of_split not in finalists:
            finalists.append(best_of_split)
    if shipped is not None:
        shipped.shipped = True
        finalists = [c for c in finalists if c.ident != shipped.ident] + [shipped]
    if per_split:
        seen = {c.ident[:2] for c in finalists}
        for c in unique:  # best first: the first of each split not among the finalists yet
            if c.ident[:2] not in seen:
                seen.add(c.ident[:2])
                finalists.append(c)
    return finalists


def _keep_or_leave_shipped(unique: list[Candidate], shipped: Candidate, tolerance: float) -> str:
    """Put the shipped placement first (in place) unless the best is predicted faster beyond ``tolerance``; say which."""
    best = unique[0]
    gain = best.samples_per_s / shipped.samples_per_s - 1.0 if shipped.samples_per_s else float("inf")
    if gain <= tolerance:
        unique.remove(shipped)
        unique.insert(0, shipped)
        return (f"kept the shipped placement ({shipped.split}, tag_steps {shipped.tag_steps}, fragment_groups "
                f"{shipped.fragment_groups}) first: the best predicted ({best.split}, tag_steps "
                f"{best.tag_steps}, fragment_groups {best.fragment_groups}) is {gain:+.1%}, within the "
                f"simulator's measured error ({tolerance:.1%})")
    return (f"the best placement is predicted {gain:+.1%} faster than the shipped one ({shipped.split}, "
            f"tag_steps {shipped.tag_steps}), beyond the simulator's measured error ({tolerance:.1%})")


def _no_split(search: SplitSearch, final: Any, unique: list[Candidate], tolerance: float, cfg: Config,
              notes: list[str]) -> Candidate | None:
    """``colocated-tsp`` on the same devices over the final run (or why not), its verdict against the best split
    appended to ``notes``."""
    hybrid, why = search.hybrid(final)
    notes.append(why if hybrid is None else _colocated_or_split(unique, hybrid, tolerance, cfg.schedule.name))
    return hybrid


def _colocated_or_split(unique: list[Candidate], hybrid: Candidate, tolerance: float, schedule: str) -> str:
    """Put the :data:`HYBRID` placement first (in ``unique``) unless the best split is predicted faster beyond
    ``tolerance``; say which, with both figures."""
    best = unique[0]
    mine = f"{HYBRID} on {'+'.join(f'{n}x{t}' for t, n in hybrid.trainer.items())}"
    theirs = f"the best {schedule} placement ({best.split}, {best.samples_per_s:.3f} samples/s)"
    gain = best.samples_per_s / hybrid.samples_per_s - 1.0 if hybrid.samples_per_s else float("inf")
    if best.shipped and hybrid.samples_per_s <= best.samples_per_s * (1.0 + tolerance):
        # the placement the config runs now stays first unless no split is predicted faster beyond the error
        unique.append(hybrid)
        return (f"kept the shipped placement ({best.split}) first: {mine} ({hybrid.samples_per_s:.3f} samples/s) is "
                f"predicted {hybrid.samples_per_s / best.samples_per_s:.2f}x it, within the simulator's measured "
                f"error ({tolerance:.1%})")
    if gain <= tolerance:
        unique.insert(0, hybrid)
        within = f", within the simulator's measured error ({tolerance:.1%})" if gain > 0 else ""
        return (f"no split: {mine} (every device samples, then trains; {hybrid.samples_per_s:.3f} samples/s) is "
                f"predicted {1 / (1 + gain):.2f}x {theirs}{within}; run it with schedule.name = '{HYBRID}', "
                "placement.rollout = 0")
    unique.append(hybrid)
    return (f"split: {theirs} is predicted {1 + gain:.2f}x {mine} (every device samples, then trains; "
            f"{hybrid.samples_per_s:.3f} samples/s)")


def scenario_config(sc: Scenario) -> Config:
    """The shipped config of ``sc`` (``sc.config``, else its model's) at the scenario's size (``model.variant``) with
    the scenario's batch (prompts x G, steps, trained steps: a Flow-GRPO window, a forward-process method's noise
    levels); its resolution stays the config's (what the memory plan checks)."""
    path = CONFIGS / f"{sc.config or _CONFIG_OF_ARCH[sc.model]}.toml"
    cfg = load_config(path)
    levels = {"flow_grpo": ['rollout.steps="window"', f"rollout.window={sc.trained_steps}"],
              "nft": [f"nft.levels={sc.trained_steps}"], "awm": [f"awm.levels={sc.trained_steps}"],
              "mixgrpo": [f"mixgrpo.window={sc.trained_steps}"]}
    return load_config(path, [f'model.variant="{sc.profile.size}"', f"rollout.prompts_per_batch={sc.prompts}",
                              f"rollout.group_size={sc.group_size}", f"rollout.num_steps={sc.num_steps}",
                              *levels[cfg.train.algorithm]])


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
    best = next(c for c in result.candidates if c.schedule != HYBRID)  # the bench's planned row is a split
    options = {k: v for k, v in cfg.schedule_options.items() if k not in ("tag_steps", "fragment_groups", "train_pack")}
    options.update(tag_steps=best.tag_steps, fragment_groups=best.fragment_groups, train_pack=best.train_pack)
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
    if PRESETS[cfg.schedule.name].colocated:  # its splits ran async1 (plan_fleet)
        cfg = replace(cfg, schedule=replace(cfg.schedule, name="async1"))
        data.setdefault("schedule", {})["name"] = "async1"
    from digenrl.plan.sequence import with_sp

    cfg = with_sp(with_sp(cfg, "rollout", cand.rollout_sp), "trainer", cand.trainer_sp)  # the SP it was planned at
    chosen = placed_config(cfg, cand.rollout, cand.trainer, cand.tag_steps, cand.fragment_groups, cand.rows_per_pass,
                           cand.train_pack, cand.schedule)
    place = data.setdefault("placement", {})
    if (cand.rollout_sp, cand.trainer_sp) != (1, 1) or {"sp", "rollout_sp", "trainer_sp"} & set(place):
        place.update(rollout_sp=cand.rollout_sp, trainer_sp=cand.trainer_sp)
    place.update(rollout=chosen.placement.rollout, trainer=chosen.placement.trainer, gpu=chosen.placement.gpu)
    if chosen.placement.rollout_gpu:
        place["rollout_gpu"] = chosen.placement.rollout_gpu
    if cfg.placement.workers:
        place["workers"] = chosen.placement.workers
    if cand.schedule:  # another schedule (no split: HYBRID), at its own token sizes but the fragments planned
        data["schedule"] = {"name": cand.schedule, "fragment_groups": cand.fragment_groups}
    else:
        data.setdefault("schedule", {}).update(tag_steps=cand.tag_steps, fragment_groups=cand.fragment_groups,
                                               **({"train_pack": cand.train_pack} if cand.train_pack else {}))
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
