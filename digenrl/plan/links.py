"""Far pools in ``plan --fleet``: which a slow link lets in, what their link costs, and a link's prediction.

A fleet string's ``@rate`` pools are far sites behind a link (``sim/links.py``). ``plan_fleet`` hands such a fleet
to :func:`plan_far_pools`, which:

1. plans the home pools alone (the ordinary search); the best placement's step time ``T`` is the budget;
2. admits each far pool as rollout devices only (trainers all-reduce every step, so they never straddle a slow
   link), and **refuses** it when one publication (``LinkBytes.publication``: the trainable weights at the
   config's dtype, LoRA adapter or full model, times the transfer's ratio) takes longer than ``T`` over its
   link: the lead trainer is busy until each version has crossed (it awaits the far actors' replies,
   ``sim/link_traffic.py``), so every step would take longer than the home pools' whole step. It **limits** it
   to the devices whose samples (``Boundary.bytes`` each, what a far actor uploads to the trainers' store) the
   link carries within ``T``;
3. plans the home pools with the admitted far pools, their traffic simulated (``sim/link_traffic.py``), and
   keeps them only where that is predicted faster than the home pools alone. Notes say why, with the figures.

A publication is priced as the run will send it (:func:`config_transfer`: ``transport.weights_compression`` as
set, ``auto`` resolved by ``transport.rollout_link_gbit`` with the run's own rule,
``compression.choose_weights_compression``) unless the caller names a ``transfer``; a note says what ``auto``
would send were ``rollout_link_gbit`` the far link's rate. ``sim.links.choose_transfer`` (by the step) only says,
for a refused pool, which encoding would fit: the run resolves ``auto`` when it loads its config, before any step
was timed, so the one rule both follow is the run's.

:func:`predict_far_rollout` is the same pricing for one config and one link rate, for a measured comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from digenrl.config import Config
from digenrl.errors import ConfigError
from digenrl.schedule.base import Device, Role, Workload
from digenrl.sim.compression import choose_weights_compression, weight_bytes_ratio
from digenrl.sim.link_traffic import LinkBytes, LinkTraffic
from digenrl.sim.links import HOME, Link, Transfer, choose_transfer
from digenrl.sim.user import Pool, format_fleet

if TYPE_CHECKING:
    from digenrl.plan.fleet import FleetPlan
    from digenrl.sim.measured import MeasuredCost

__all__ = ["config_link_bytes", "config_transfer", "admit_far_pool", "plan_far_pools", "predict_far_rollout"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


def config_link_bytes(cfg: Config, transfer: Transfer | None = None) -> LinkBytes:
    """What ``cfg``'s traffic moves, from its memory plan: a publication is its trainable parameters (LoRA
    adapter or full model, as ``roles/weights.py`` publishes them) at ``model.dtype`` times ``transfer.ratio``;
    a sample is ``Boundary.bytes`` (its trained rows' latents or its clean latent, and its conditioning)."""
    from digenrl.plan.memory import memory_plan, traces_for

    plan = memory_plan(cfg, traces_for(cfg, linear=True))  # (the counts and the boundary do not need exact traces)
    trainer = plan.roles.get("trainer") or next(iter(plan.roles.values()))
    crossing = plan.boundary
    width = _DTYPE_BYTES.get(cfg.model.dtype, 2)
    return LinkBytes(trainer.trainable_params * width * (transfer.ratio if transfer else 1.0), 0.0,
                     float(crossing.bytes) if crossing else 0.0, float(crossing.latent) if crossing else 0.0,
                     2.0 * trainer.trainable_params)


def config_transfer(cfg: Config, method: str | None = None) -> Transfer | None:
    """How ``cfg``'s run sends a publication: ``method`` or ``transport.weights_codec`` (the method set, or ``auto``
    resolved by ``transport.rollout_link_gbit``), at its bytes over ``model.dtype``'s; None: uncompressed."""
    method = method or cfg.transport.weights_codec
    if method == "none":
        return None
    width = _DTYPE_BYTES.get(cfg.model.dtype, 2)
    return Transfer(method, weight_bytes_ratio(method, width, cfg.transport.topk_fraction))


def _auto_note(cfg: Config, far: list[Pool]) -> str | None:
    """What ``auto`` would send over the slowest far link, when the config's ``rollout_link_gbit`` says otherwise."""
    if cfg.transport.weights_compression != "auto" or cfg.transport.weights != "zmq":
        return None
    slowest = min((p.link for p in far if p.link is not None), key=lambda link: link.bits_per_s)
    there, here = choose_weights_compression(slowest.bits_per_s), cfg.transport.weights_codec
    if there == here:
        return None
    sent = config_transfer(cfg, there)
    what = f"{there} deltas ({sent.ratio:.2g} of the bytes)" if sent else "them in full"
    return (f"transport.rollout_link_gbit = {cfg.transport.rollout_link_gbit:g}: publications priced as the run sends "
            f"them ({here}); with --set transport.rollout_link_gbit={slowest.bits_per_s / 1e9:g} (the slowest far "
            f"link) weights_compression = auto sends {what}")


def _what(cfg: Config, transfer: Transfer | None) -> str:
    weights = "LoRA adapter" if cfg.model.finetune == "lora" else "full weights"
    return f"{weights}, {cfg.model.dtype}" + (f" as {transfer.name}" if transfer and transfer.ratio < 1 else "")


def admit_far_pool(pool: Pool, nbytes: LinkBytes, step_s: float, sample_s: float, what: str) -> tuple[int, str]:
    """How many of far ``pool``'s devices to use (0: refused) and why, in one line with the figures.

    ``step_s``: the home pools' step; ``sample_s``: seconds one of the pool's devices takes to generate (and
    score) one sample, so it makes ``step_s / sample_s`` a step, each ``nbytes.sample`` to upload.
    """
    if pool.link is None:
        raise ConfigError(f"{pool.count}x{pool.device}: not behind a link, nothing to admit")
    link, name = pool.link, f"{pool.count}x{pool.device}@{pool.link}"
    pub_s = link.seconds(nbytes.publication)
    figures = (f"a publication of {nbytes.publication / GB:.3g} GB ({what}) takes {pub_s:.3g} s over {link}; "
               f"a step on the home pools alone takes {step_s:.3g} s")
    if pub_s > step_s:
        ratio = max(step_s - link.latency_s, 0.0) * link.bytes_per_s / nbytes.publication
        option, _ = choose_transfer(link.bits_per_s, nbytes.publication, step_s, latency_s=link.latency_s, share=1.0)
        hint = f"; {option.name} would fit" if option.ratio <= ratio else "; no compression option fits"
        return 0, (f"{name} refused: {figures}, and the lead trainer waits for each version to cross, so every "
                   f"step would take longer than that; it would fit at {ratio:.2g} of those bytes{hint}")
    per_device = nbytes.sample * step_s / max(sample_s, 1e-12)  # bytes one device sends back a step
    room = max(step_s - link.latency_s, 0.0) * link.bytes_per_s
    fit = pool.count if per_device <= 0 else min(pool.count, math.floor(room / per_device))
    samples = f"each device's samples ({per_device / GB:.3g} GB a step at {nbytes.sample / 1e6:.3g} MB a sample)"
    if fit == 0:
        return 0, f"{name} refused: {samples} alone take longer than the step over {link}; {figures}"
    if fit < pool.count:
        return fit, (f"{name} limited to {fit} of {pool.count} devices: the link carries back within a step "
                     f"the samples of {fit} ({samples}); {figures}")
    return fit, f"{name} admitted (as rollout devices): {figures}, {pub_s / step_s:.0%} of it"


def plan_far_pools(cfg: Config, pools: tuple[Pool, ...], plan: Callable[..., FleetPlan],
                   transfer: Transfer | None = None, measured: MeasuredCost | None = None) -> FleetPlan:
    """Plan a fleet with far pools (see the module docstring). ``plan(pools, link_bytes=...)`` is ``plan_fleet``
    at the caller's settings.

    Raises:
        ConfigError: no home pool (every pool behind a link), or what ``plan`` raises for the home pools.
    """
    home = tuple(p for p in pools if p.link is None)
    far = [p for p in pools if p.link is not None]
    if not home:
        raise ConfigError(f"--fleet {format_fleet(pools)}: every pool is behind a link; write the training "
                          "cluster's pools without '@' (the home site, where trainers all-reduce)")
    transfer = transfer or config_transfer(cfg)
    nbytes = config_link_bytes(cfg, transfer)
    alone = plan(home)
    step_s = cfg.rollout.prompts_per_batch * cfg.rollout.group_size / max(alone.best.samples_per_s, 1e-12)
    admitted, lines, auto = [], [], [note for note in [_auto_note(cfg, far)] if note]
    for pool in far:
        n, line = admit_far_pool(pool, nbytes, step_s, _sample_seconds(cfg, pool, measured), _what(cfg, transfer))
        lines.append(line)
        if n:
            admitted.append(replace(pool, count=n, roles=("rollout",)))
    if not admitted:
        alone.unused += lines
        alone.notes += auto
        return alone
    linked = plan(home + tuple(admitted), link_bytes=nbytes)
    gain = linked.best.samples_per_s / max(alone.best.samples_per_s, 1e-12) - 1.0
    cost = _link_cost(linked.best.links, step_s)
    if gain > 0:
        linked.notes[:0] = lines + [f"the far pools are worth it: {linked.best.samples_per_s:.3f} samples/s vs "
                                    f"{alone.best.samples_per_s:.3f} on the home pools alone ({gain:+.1%}); {cost}"]
        linked.notes += auto
        linked.simulations += alone.simulations
        return linked
    alone.unused += [f"{line} (then not used: the home pools alone are predicted {-gain:.1%} faster "
                     f"than with it; {cost})" for line in lines]
    alone.notes += auto
    alone.simulations += linked.simulations
    return alone


def _sample_seconds(cfg: Config, pool: Pool, measured: MeasuredCost | None) -> float:
    """Seconds one of ``pool``'s devices takes to generate and score one sample of ``cfg`` (the cost model's
    ``batch_work`` of a whole batch, over its samples)."""
    from digenrl.plan.fleet import config_profile
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.cost import CostModel
    from digenrl.sim.devices import device_spec

    ro = cfg.rollout
    samples = ro.prompts_per_batch * ro.group_size
    spec = device_spec(pool.device)
    probe = measured or CostModel(config_profile(cfg), {"x": spec}, calibrated_params(), {"x": Role.ROLLOUT})
    roll, _ = probe.batch_work(samples, ro.prompts_per_batch, ro.num_steps, 0, spec)
    return roll / samples


def _link_cost(links: dict[str, Any], step_s: float) -> str:
    """``L40S link 10gbit: publication 24 GB in 19.2 s (38% of a 50 s step), samples back 1.2 GB a step, ...``."""
    parts = []
    for site, r in links.items():
        moved = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in sorted(r["bytes_per_step"].items()))
        parts.append(f"{site} link {r['link']}: a publication {r['publication_bytes'] / GB:.3g} GB in "
                     f"{r['publication_s']:.3g} s ({r['publication_s'] / step_s:.0%} of the home step), per step "
                     f"{moved}; the link busy {r['busy']['down']:.0%} down / {r['busy']['up']:.0%} up, the far "
                     f"devices moving data over it {r['moving_share']:.1%} of the run and waiting on it "
                     f"{r['wait_share']:.1%}")
    return "; ".join(parts) or "no link traffic simulated"


def predict_far_rollout(cfg: Config, link_bps: float, latency_s: float = 0.0, costs: MeasuredCost | None = None,
                        batches: int = 8, transfer: Transfer | None = None) -> dict[str, Any]:
    """What a link of ``link_bps`` (bits/s, one way ``latency_s``) between ``cfg``'s rollout actors (the far
    side) and its trainers costs, for a shaped-link measurement to compare with.

    Returns a dict:
        ``publication_bytes``: one version as ``roles/weights.py`` publishes it: the trainable tensors (the LoRA
        adapter, or everything) at ``model.dtype`` times ``transfer``'s ratio (default: :func:`config_transfer`,
        what the run sends), without framing;
        ``publication_s``: ``publication_bytes * 8 / link_bps + latency_s``, one version over the link;
        ``sample_bytes``: what a far actor uploads per sample to the trainers' store (``Boundary.bytes``);
        with ``costs`` (a ``MeasuredCost``: ``MeasuredCost.from_report(bubbles.json)`` of ``bench bubbles --real``
        on this config, or fits built from a run's token times) the config's placement and schedule (e.g. the
        tiny default under async1) are simulated over ``batches`` steps with and without the link:
        ``step_s`` / ``step_s_unlinked``: steady seconds per optimizer step; ``publish_s``: the lead trainer's
        PUBLISH token (``costs``' publication plus the crossing and the reply), median; ``reward_s``: a far
        REWARD token (its scoring plus the upload), median; ``far_idle_per_step_s``: the far rollout pool's idle
        seconds per step (mean over its devices); ``far_bubble_per_step_s``: of which beyond those it has
        without the link; ``far_wait_per_step_s``: of which waiting for a version to arrive; ``far_bubble`` /
        ``far_bubble_unlinked``: its bubble ratio. Without ``costs`` those keys are absent.

    The simulated side counts the transfers as busy for the host's core contention (``costs.contention``), a
    small pessimism when both sides share one CPU host.

    Raises:
        ConfigError: a non-positive rate, or what ``config_link_bytes`` raises.
    """
    if link_bps <= 0:
        raise ConfigError(f"predict_far_rollout: link_bps={link_bps!r} must be positive")
    link = Link(float(link_bps), float(latency_s))
    nbytes = config_link_bytes(cfg, transfer or config_transfer(cfg))
    out: dict[str, Any] = {"link": str(link), "publication_bytes": nbytes.publication,
                           "publication_s": link.seconds(nbytes.publication), "sample_bytes": nbytes.sample}
    if costs is not None:
        linked, unlinked = (_simulate_far(cfg, costs, batches, traffic, nbytes) for traffic in (link, None))
        out.update(step_s=linked["step_s"], step_s_unlinked=unlinked["step_s"], publish_s=linked["publish_s"],
                   reward_s=linked["reward_s"], far_idle_per_step_s=linked["idle_per_step_s"],
                   far_bubble_per_step_s=linked["idle_per_step_s"] - unlinked["idle_per_step_s"],
                   far_wait_per_step_s=linked["wait_per_step_s"], far_bubble=linked["bubble"],
                   far_bubble_unlinked=unlinked["bubble"])
    return out


def _simulate_far(cfg: Config, costs: MeasuredCost, batches: int, link: Link | None,
                  nbytes: LinkBytes) -> dict[str, float]:
    """``cfg``'s placement (its rollout actors far, behind ``link``; trainers home) under its schedule."""
    import statistics

    from digenrl.policy import trained_steps
    from digenrl.schedule import make_schedule
    from digenrl.sim.engine import simulate
    from digenrl.telemetry.spans import busy_seconds
    from digenrl.telemetry.stats import summarize

    ro, place = cfg.rollout, cfg.placement
    w = Workload(batches, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    devices = ([Device(f"far-{i}", Role.ROLLOUT, 1.0) for i in range(place.rollout)]
               + [Device(f"home-{i}", Role.TRAINER, 1.0) for i in range(place.trainer)])
    traffic = None
    if link is not None:
        traffic = LinkTraffic({d.name: "far" if d.role is Role.ROLLOUT else HOME for d in devices}, {"far": link},
                              nbytes, w.trained_steps)
    # the options the coordinator gives the schedule (roles/coordinator.py): the config's staleness, batch advantages
    options: dict[str, Any] = {**cfg.schedule_options, "batch_advantages": cfg.train.adv_std == "global"}
    if cfg.schedule.staleness:
        options["staleness"] = cfg.schedule.staleness
    schedule = make_schedule(cfg.schedule.name, devices, w, costs, **options)
    res = simulate(schedule, devices, w, costs, contention=costs.contention, links=traffic)
    steady = summarize(res).steady
    steps = max(len([b for b, t in res.optim_end.items() if steady.start < t <= steady.end]), 1)
    far = [d.name for d in devices if d.role is Role.ROLLOUT]
    length = steady.end - steady.start
    idle = sum(length - busy_seconds([s for s in res.spans if s.device == n], steady.start, steady.end) for n in far)
    wait = sum(busy_seconds([s for s in res.spans if s.device == n], steady.start, steady.end, frozenset({"link"}))
               for n in far)

    def median(kind: str, where: list[str]) -> float:
        return statistics.median([s.end - s.start for s in res.spans if s.kind == kind and s.device in where] or [0.0])

    n = max(len(far), 1)
    return {"step_s": length / steps, "idle_per_step_s": idle / n / steps, "wait_per_step_s": wait / n / steps,
            "bubble": idle / n / length if length else 0.0, "publish_s": median("publish", ["home-0"]),
            "reward_s": median("reward", far)}
