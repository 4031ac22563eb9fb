"""The disaggregated recipe: rollout, reward and trainer actors in their own processes, one coordinator.

::

    run_disaggregated(load_config("configs/tiny-qwenimage.toml"), "runs/x")     # or from the CLI:
    digenrl run configs/tiny-qwenimage.toml --set schedule.name=async1

Setup (torchtune-style, everything built before the first token): spawn the trainers, rollout and
reward actors (one process each, titled ``digenrl-<role>-<i>``; ``transport.actors = "inproc"`` keeps
them in this process for tests), hand every actor the others' refs, form the trainer group (several
trainers: one torch.distributed group, a fresh rendezvous on every start or resume; see
:mod:`digenrl.roles.trainer_group`), join the torch.distributed weight lane when configured,
restore the checkpoint when resuming, then let the
:class:`~digenrl.roles.coordinator.Coordinator` drive the schedule. ``schedule.name = "colocated"``
runs the single-process reference loop (:func:`digenrl.recipes.colocated.train`) instead.

SIGINT stops the run at once and SIGTERM after the next step's checkpoint (``log.term_grace``), in order,
with the outputs below written (:mod:`digenrl.roles.stop`); the actor processes leave both signals to
this one (``digenrl.actors.process``).

Outputs in ``out_dir``: ``config.json``, ``metrics.jsonl`` (one line per optimizer step),
``samples/step_*.png`` and ``.json`` (captioned grids of the fixed evaluation, sampled by the lead trainer; of the
training samples under ``log.samples = "rollout"`` or ``train.shard = "fsdp"``: :mod:`digenrl.recipes.samples`),
``checkpoints/step-*`` (atomic, ``latest``), ``trace.json`` (Chrome/Perfetto
spans of every actor), ``gantt.png`` and ``summary.json`` (the simulator's steady/full metrics of the
real spans).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from digenrl import usercode
from digenrl.actors import ActorSystem, Worker
from digenrl.actors.loop import run as run_loop
from digenrl.algorithms.user import allow_user_algorithm
from digenrl.config import ACTOR_SCHEDULES, Config, is_user_algorithm
from digenrl.data.prompts import load_prompts
from digenrl.errors import ConfigError
from digenrl.recipes.checkpoint import find_checkpoint, load_state, save_checkpoint
from digenrl.recipes.late_rollout import LateRollouts
from digenrl.recipes.preflight import cluster_keys, preflight
from digenrl.recipes.samples import write_evaluation, write_rollout_samples
from digenrl.roles.evaluation import Evaluation
from digenrl.rewards.user import allow_user_rewards
from digenrl.roles.coordinator import Coordinator, RunStopped
from digenrl.roles.reward import RewardActor
from digenrl.roles.rollout import RolloutActor
from digenrl.roles.sp_group import SpPlace, sp_members, sp_summary
from digenrl.roles.stop import RunInterrupted, StopRequest, stop_scope
from digenrl.roles.trainer import PREVIOUS_WEIGHTS, TrainerActor
from digenrl.schedule.base import CostEstimate, Device, Role, Token
from digenrl.schedule.cost import UniformCost
from digenrl.schedule.options import PRESETS
from digenrl.telemetry.live import LiveDisplay
from digenrl.telemetry.metrics import MetricsLog
from digenrl.telemetry.spans import Timeline
from digenrl.telemetry.stats import run_stats
from digenrl.telemetry.trace import write_artifacts
from digenrl.transport.communicator import COMM_KINDS

__all__ = ["run_disaggregated", "arun_disaggregated", "tiny_cpu_cost", "Cluster", "start_cluster", "actor_plan"]

log = logging.getLogger(__name__)


def tiny_cpu_cost() -> UniformCost:
    """Seconds per token of the tiny Qwen-Image preset on one CPU thread (FEASIBILITY §8, rounded).

    The schedules only use ratios of these (placement, TAG decisions) and correct them online.
    """
    # rollout_sample_step also carries the holder's decode + score (0.008 s per sample over its
    # steps): the schedules weigh TAG help by denoising capacity alone, and without this share a
    # rollout actor that spends most of its time decoding looks fast and never gets help.
    return UniformCost(overhead=0.01, rollout_sample_step=0.0016, reward_sample=0.008, train_row=0.0018,
                       train_row_packed=0.0014, optim=0.01, publish=0.01, switch=0.0)


class Cluster:
    """The spawned actors of one run: refs by name, their devices, and the system that owns them.

    ``members``: each device's processes, itself first (a sequence-parallel group has several; it is dead
    as soon as one of them is).
    """

    def __init__(self, system: ActorSystem, refs: dict[str, Any], devices: list[Device],
                 members: dict[str, list[str]] | None = None) -> None:
        self.system, self.refs, self.devices = system, refs, devices
        self.members = members or {}

    def is_dead(self, name: str) -> bool:
        node = self.system.node
        return node is not None and any(self.refs[m].address in node.dead for m in self.members.get(name, [name]))

    def names(self, role: Role) -> list[str]:
        return [d.name for d in self.devices if d.role is role]


def _on_gpu(cfg: Config, conf: dict[str, Any], k: int) -> dict[str, Any]:
    """Actor ``k``'s config: with ``model.device = "cuda"``, its GPU of this host (``placement.gpu_of``: the
    preflight made sure the host has ``placement.gpus`` of them; the memory plan checks what shares one)."""
    if conf["model"]["device"] != "cuda" or not torch.cuda.is_available():
        return conf
    gpu = cfg.placement.gpu_of(k) % torch.cuda.device_count()
    return {**conf, "model": {**conf["model"], "device": f"cuda:{gpu}"}}


def _staleness(cfg: Config) -> int:
    """The run's staleness bound: the schedule preset's (async1: 1), or more if the config asks."""
    return max(cfg.schedule.staleness, PRESETS[cfg.schedule.name].staleness)


async def _wait_for_workers(system: ActorSystem, n: int, timeout: float) -> list[Worker]:
    """Wait for ``n`` joined workers, logging each as it joins; a clear error after ``timeout`` seconds."""
    log.info("waiting up to %g s for %d workers: start `digenrl worker --join %s` once per GPU on each host",
             timeout, n, system.address)

    def joined(worker: Worker, k: int) -> None:
        log.info("worker %d of %d joined from %s (%s, pid %d)", k, n, worker.host, worker.address, worker.pid)

    try:
        return await system.wait_for_workers(n, timeout=timeout, on_join=joined)
    except TimeoutError as exc:
        hosts = collections.Counter(w.host for w in system.workers)
        listing = ", ".join(f"{host} x{count}" for host, count in sorted(hosts.items())) or "none"
        raise ConfigError(f"{exc} (hosts: {listing}); start the missing ones with `digenrl worker --join "
                          f"{system.address}` on each host, or lower placement.workers / raise "
                          f"placement.join_timeout") from None


def actor_plan(cfg: Config) -> list[tuple[str, Role, type, tuple[Any, ...]]]:
    """The run's actor processes in spawn order, ``(name, role, class, constructor args)``: trainers, rollout,
    reward; a sequence-parallel actor's members follow it (``trainer-0``, ``trainer-0-sp1``, ...: :func:`sp_groups`)."""
    place, conf, staleness = cfg.placement, cfg.to_dict(), _staleness(cfg)
    groups = sp_groups(cfg)
    plan: list[tuple[str, Role, type, tuple[Any, ...]]] = []
    plan += [(m, Role.TRAINER, TrainerActor, (conf, place.actor_threads, staleness, cfg.transport.bucket_mb))
             for i in range(place.trainer) for m in groups[f"trainer-{i}"]]
    plan += [(m, Role.ROLLOUT, RolloutActor, (conf, place.actor_threads))
             for i in range(place.rollout) for m in groups[f"rollout-{i}"]]
    plan += [(f"reward-{i}", Role.REWARD, RewardActor, (conf, place.actor_threads)) for i in range(place.reward)]
    return plan


def sp_groups(cfg: Config) -> dict[str, list[str]]:
    """Each rollout actor's and trainer's processes, itself (the leader the coordinator knows) first."""
    place = cfg.placement
    return {f"{role}-{i}": sp_members(f"{role}-{i}", place.sp_of(role))
            for role, n in (("trainer", place.trainer), ("rollout", place.rollout)) for i in range(n)}


def _launcher(cfg: Config, out: Path | None = None) -> contextlib.AbstractAsyncContextManager[Any]:
    """``cluster.launcher = "ray"``: the Ray launcher (Ray is imported only then; its raylet reports go to ``out``);
    else nothing to launch."""
    if cfg.cluster.launcher != "ray":
        return contextlib.nullcontext()
    from digenrl.recipes.ray_launcher import RayLauncher

    return RayLauncher(cfg, [(name, role, cls) for name, role, cls, _ in actor_plan(cfg)], logs=out)


async def start_cluster(system: ActorSystem, cfg: Config, version: int = 0, launcher: Any = None) -> Cluster:
    """Spawn and wire the actors of ``cfg.placement`` inside a started ``system``.

    ``launcher`` (a :class:`~digenrl.recipes.ray_launcher.RayLauncher`) starts one worker per actor;
    without it actors get a local process each, or the ``placement.workers`` that join.

    Raises:
        ConfigError: fewer than ``placement.workers`` workers joined within ``placement.join_timeout``.
        RemoteError: an actor's constructor or setup failed (its traceback attached).
        ActorDied: an actor process died before it was ready.
    """
    place = cfg.placement
    process = cfg.transport.actors == "zmq"
    conf = cfg.to_dict()
    plan = actor_plan(cfg)
    # The run's own config may import its Python files (rewards, an algorithm) here (in-process actors) and in
    # the processes this driver launches (their environment); a joined worker allows them itself (--allow-*).
    user_code = allow_user_rewards(cfg.reward.models)
    if is_user_algorithm(cfg.train.algorithm):
        user_code.append(allow_user_algorithm(cfg.train.algorithm, "train.algorithm"))
    env = usercode.launch_env(user_code, "train.algorithm") if process and user_code else None
    spawns: list[Any]
    if launcher is not None:
        # One worker per actor, each started by the launcher in its own placement bundle.
        placed = await launcher.start_workers(system)
        spawns = [system.spawn(cls, *args, name=name, on=placed[name]) for name, _, cls, args in plan]
    elif place.workers:
        # One actor per joined worker (each worker is one GPU of some host, its launcher sets
        # CUDA_VISIBLE_DEVICES), in join order: trainers first, then rollout and reward actors.
        workers = await _wait_for_workers(system, place.workers, place.join_timeout)
        spawns = [system.spawn(cls, *args, name=name, on=w) for (name, _, cls, args), w in zip(plan, workers)]
    else:
        plan = [(name, role, cls, (_on_gpu(cfg, conf, k), *args[1:])) for k, (name, role, cls, args) in enumerate(plan)]
        spawns = [system.spawn(cls, *args, name=name, process=process, env=env) for name, _, cls, args in plan]
    # Spawned together: each process spends seconds importing torch, so their imports overlap.
    refs_list = await asyncio.gather(*spawns)
    refs = {name: ref for (name, *_), ref in zip(plan, refs_list, strict=True)}
    groups = sp_groups(cfg)
    # The coordinator knows one device per actor: a sequence-parallel group's leader.
    devices = [Device(name, role) for name, role, _, _ in plan if name in groups or role is Role.REWARD]
    cluster = Cluster(system, refs, devices, groups)
    if place.sp_of("rollout") > 1 or place.sp_of("trainer") > 1:
        log.info("%s: %s", sp_summary(place), "; ".join(f"{n} = {' + '.join(m)}" for n, m in groups.items()))
    trainers = [name for name, role, _, _ in plan if role is Role.TRAINER]  # every trainer process
    group: dict[str, dict[str, Any]] = {}
    if len(trainers) > 1:
        # The lead opens the rendezvous on its own host (a free port there); everyone joins it in connect.
        address = await refs[trainers[0]].open_group.call(len(trainers))
        group = {n: {"rank": i, "world_size": len(trainers), "address": address} for i, n in enumerate(trainers)}
        for members in (groups[n] for n in cluster.names(Role.TRAINER) if len(groups[n]) > 1):
            for rank, n in enumerate(members):  # the trainer world's SP sub-groups (roles.sp_group)
                group[n]["sp"] = SpPlace(rank, members).to_wire()
    calls = []
    for name, role, _, _ in plan:
        ref = refs[name]
        if role is Role.TRAINER:
            calls.append(ref.connect.call(refs, version, group.get(name)))
        else:
            calls.append(ref.connect.call(refs))
    await asyncio.gather(*calls)
    await asyncio.gather(*(_form_sp_group(refs, groups[n]) for n in cluster.names(Role.ROLLOUT) if len(groups[n]) > 1))
    return cluster


async def _form_sp_group(refs: dict[str, Any], members: list[str]) -> None:
    """A rollout actor's sequence-parallel group: its leader opens the rendezvous, every member joins it."""
    address = await refs[members[0]].open_sp_group.call(len(members))
    await asyncio.gather(*(refs[m].join_sp_group.call(SpPlace(rank, members).to_wire(), address)
                           for rank, m in enumerate(members)))


async def arun_disaggregated(cfg: Config, out_dir: str | Path | None = None, resume: str | Path | None = None, *,
                             cost: CostEstimate | None = None,
                             on_step: Callable[[dict[str, Any]], None] | None = None,
                             on_dispatch: Callable[[str, dict[str, Any]], Any] | None = None,
                             write_files: bool = True,
                             on_result: Callable[[Timeline, list[tuple[Token, float]], list[tuple[Token, float]]], None]
                             | None = None,
                             on_admit: Callable[[dict[str, Any]], None] | None = None,
                             ) -> list[dict[str, Any]]:
    """Async form of :func:`run_disaggregated` (for callers that already run an event loop).

    ``on_dispatch(device, token)`` sees every token as the coordinator sends it, ``on_admit(record)``
    each rollout actor that joined mid-run as it is admitted (see
    :class:`~digenrl.roles.coordinator.Coordinator`). ``on_result`` receives the run's spans (a
    :class:`~digenrl.telemetry.spans.Timeline`, as the simulator's), every completed token with its
    measured seconds, and the per-token overhead of the ROLLOUT/REWARD/TRAIN tokens (seconds beyond
    their compute; ``Coordinator.overhead_log``): benchmarks calibrate the simulator from them.

    Raises:
        ConfigError: ``schedule.name`` is not an actor schedule, or a bad checkpoint.
        RunStopped, RunInterrupted, RemoteError: as :func:`run_disaggregated`.
    """
    from digenrl.recipes.colocated import default_out_dir

    if not cfg.disaggregated:
        raise ConfigError(f"schedule.name = {cfg.schedule.name!r} runs the single-process loop; the actor recipe "
                          f"needs one of {', '.join(ACTOR_SCHEDULES)} (run_disaggregated runs both)")
    sched, logc = cfg.schedule, cfg.log
    # What `digenrl validate` checks too, before any checkpoint is read or process started (the CLI has run it
    # already; library callers get the same refusals here instead of a remote traceback).
    preflight(cfg)
    out = Path(out_dir or cfg.log.out or default_out_dir())
    options: dict[str, Any] = dict(cfg.schedule_options)
    base, history, ckpt = _resume_from(cfg, resume, options)
    if base >= cfg.train.iterations:  # a finished run: its table, nothing else
        if logc.live:
            LiveDisplay.show(cfg.train.iterations, f"digenrl {sched.name}", history)
        return history
    torch.set_num_threads(1)
    if write_files:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    metrics = MetricsLog.for_run(logc, cfg.to_dict(), out if write_files else None, history)
    live = LiveDisplay(cfg.train.iterations, f"digenrl {sched.name}", history) if logc.live else None
    t0 = time.time()
    steps = [base]  # optimizer steps done, for the line of a run a signal stops

    def step_done(m: dict[str, Any]) -> None:
        steps[0] = int(m["step"]) + 1
        metrics.write(m)
        if live is not None:
            live.update(m)
        if on_step is not None:
            on_step(m)

    def images(step: int, imgs: torch.Tensor, prompts: list[str], rewards: list[float]) -> None:
        write_rollout_samples(out, metrics, cfg, step, imgs, prompts, rewards)

    def evaluation(ev: Evaluation) -> None:
        write_evaluation(out, metrics, cfg, ev)

    fixed = logc.samples == "fixed" and cfg.shard != "fsdp"
    if logc.samples == "fixed" and not fixed and logc.image_every and write_files:
        log.info("log.samples = 'fixed' needs a trainer that samples alone; under train.shard = 'fsdp' (a forward is "
                 "a collective) the grids show each due batch's training samples instead")

    stop = StopRequest(logc.term_grace)
    try:
        async with stop_scope(stop):
            return await _run_actors(cfg, out, base, ckpt, history, options, stop, metrics, live, step_done,
                                     images if write_files and not fixed else None, write_files, t0, cost=cost,
                                     on_dispatch=on_dispatch, on_result=on_result, on_admit=on_admit,
                                     on_eval=evaluation if write_files and fixed else None)
    except RunInterrupted as exc:
        raise exc.at(max(exc.step, steps[0]), out if write_files else None) from None


async def _run_actors(cfg: Config, out: Path, base: int, ckpt: Path | None, history: list[dict[str, Any]],
                      options: dict[str, Any], stop: StopRequest, metrics: MetricsLog, live: LiveDisplay | None,
                      step_done: Callable[[dict[str, Any]], None],
                      images: Callable[[int, torch.Tensor, list[str], list[float]], None] | None,
                      write_files: bool, t0: float, *, cost: CostEstimate | None,
                      on_eval: Callable[[Evaluation], None] | None = None,
                      on_dispatch: Callable[[str, dict[str, Any]], Any] | None,
                      on_result: Callable[[Timeline, list[tuple[Token, float]], list[tuple[Token, float]]], None] | None,
                      on_admit: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    """Start the actors, restore the checkpoint, let the coordinator drive the schedule, write the artifacts."""
    sched, transport, logc = cfg.schedule, cfg.transport, cfg.log
    # cuda_ipc: the actors' messages (weights and latents alike) carry CUDA IPC handles instead of host copies.
    kind = "cuda_ipc" if transport.weights == "cuda_ipc" else transport.actors
    # A failed bind (port in use) names the config key that holds the address.
    bind_options = {} if kind == "inproc" else {"address_key": "transport.address"}
    # Ray workers join over tcp: on one host loopback is enough (several hosts need transport.address).
    address = transport.address or ("tcp://127.0.0.1:0" if cfg.cluster.launcher == "ray" else None)
    async with _launcher(cfg, out) as launcher, ActorSystem(transport=kind, address=address, name="coordinator",
                                                            keys=cluster_keys(cfg),
                                                            transport_options=bind_options) as system:
        cluster = await start_cluster(system, cfg, base, launcher)
        trainers = cluster.names(Role.TRAINER)
        if ckpt is not None:
            await asyncio.gather(*(cluster.refs[n].load_state.call(str(ckpt), base) for n in trainers))
        coordinator: Coordinator | None = None

        async def checkpoint(step: int, state: dict[str, Any]) -> None:
            assert coordinator is not None
            # Every trainer enters save_state (FSDP gathers there); the lead writes the files.
            group = [cluster.refs[n] for n in coordinator.group]
            await save_checkpoint(out / "checkpoints", step, state,
                                  lambda d: asyncio.gather(*(t.save_state.call(str(d)) for t in group)),
                                  keep=logc.keep_checkpoints)

        coordinator = Coordinator(
            cfg, sched.name, cluster.devices, cluster.refs,
            load_prompts(cfg.data.prompt_set, cfg.data.prompts, cfg.data.prompt_file),
            options=options, cost=cost or tiny_cpu_cost(), base=base, history=history,
            is_dead=cluster.is_dead, weights_lane=transport.weights if transport.weights in COMM_KINDS else "zmq",
            bucket_mb=transport.bucket_mb, checkpoint=checkpoint if write_files else None,
            checkpoint_every=logc.checkpoint_every, on_step=step_done,
            on_images=images, on_eval=on_eval, on_dispatch=on_dispatch, t0=t0, shard=cfg.shard,
            on_admit=on_admit, stop=stop)
        late = LateRollouts(cfg, system, coordinator)
        late.install()  # from now on a worker that joins is a late rollout actor, or refused
        try:
            if live is not None:
                live.__enter__()
            history = await coordinator.run()
        except RunStopped as exc:
            log.error("run stopped: %s", exc)
            raise RunStopped(f"{exc} (run directory: {out})") from None
        finally:
            await late.aclose()
            if live is not None:
                live.__exit__(None, None, None)
            metrics.close()
            result = coordinator.spans.timeline(sched.name, coordinator.devices, coordinator.workload,
                                              time.time() - t0)
            if on_result is not None:
                on_result(result, coordinator.token_log, coordinator.overhead_log)
            if write_files:
                write_artifacts(out, result, logc.trace, logc.gantt)
                await _write_summary(out, result, coordinator, cluster)
    return history


async def _write_summary(out: Path, result: Timeline, coordinator: Coordinator, cluster: Cluster) -> None:
    """``summary.json``: the run's bubble and throughput figures, lost and admitted devices, publications, peak
    memory."""
    # Actors lost or admitted mid-run change who generated what, and when: the numbers are no longer
    # those an uninterrupted run of the same config and seed gives.
    changed = bool(coordinator.lost_devices or coordinator.admitted)
    if changed:
        log.warning("actors changed mid-run (lost %s, admitted %s): this run is not the one an uninterrupted run "
                    "gives (summary.json: repeats_uninterrupted = false)", list(coordinator.lost_devices) or "none",
                    [a.get("device", "?") for a in coordinator.admitted] or "none")
    (out / "summary.json").write_text(json.dumps({**run_stats(result), "lost_devices": coordinator.lost_devices,
                                                  "admitted": coordinator.admitted,
                                                  "publications": coordinator.publications,
                                                  "repeats_uninterrupted": not changed,
                                                  "peak_memory": await _peaks(cluster)}, indent=1))


def _resume_from(cfg: Config, resume: str | Path | None,
                 options: dict[str, Any]) -> tuple[int, list[dict[str, Any]], Path | None]:
    """``(version, history, checkpoint)`` to start from (``0, [], None`` without ``resume``); a one-step-stale
    schedule's ``options`` learn whether the checkpoint holds the previous version's weights too."""
    if resume is None:
        return 0, [], None
    ckpt = find_checkpoint(resume)
    state = load_state(ckpt)
    base, history = state["version"], list(state.get("history", []))[: state["version"]]
    log.info("resuming from %s at version %d", ckpt, base)
    if _staleness(cfg) and base > 0:
        # Batch `base` was generated with version base - 1: the checkpoint holds those weights too.
        if (ckpt / PREVIOUS_WEIGHTS).is_file():
            options["previous_version"] = True
        else:
            log.warning("checkpoint %s has no %s (written by an on-policy schedule or an older digenrl): "
                        "batch %d is generated with version %d instead of %d, so the metrics after resume differ "
                        "slightly from an uninterrupted %s run", ckpt, PREVIOUS_WEIGHTS, base, base, base - 1,
                        cfg.schedule.name)
    return base, history, ckpt


async def _peaks(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Every live actor's peak memory (``summary.json``: beside what the memory plan predicts for its role)."""
    names = [d.name for d in cluster.devices if not cluster.is_dead(d.name)]
    peaks = await asyncio.gather(*(cluster.refs[n].memory_peak.call() for n in names), return_exceptions=True)
    return {n: p for n, p in zip(names, peaks, strict=True) if isinstance(p, dict)}  # (one that died since: none)


def run_disaggregated(cfg: Config, out_dir: str | Path | None = None, resume: str | Path | None = None, *,
                      cost: CostEstimate | None = None,
                      on_step: Callable[[dict[str, Any]], None] | None = None,
                      write_files: bool = True) -> list[dict[str, Any]]:
    """Run ``cfg.train.iterations`` optimizer steps with ``cfg.schedule.name``; returns the metrics.

    ``colocated`` runs the single-process loop (:func:`digenrl.recipes.colocated.train`, the same outputs,
    checkpoints and resume); the actor schedules run with ``cfg.placement`` and ``cfg.transport``.

    Args:
        cfg: the validated run config.
        out_dir: output directory (default ``log.out``, else ``runs/<timestamp>``).
        resume: a run directory, checkpoints directory or ``step-*`` checkpoint to continue from.
        cost: the schedules' cost estimate (default :func:`tiny_cpu_cost`).
        on_step: called with each optimizer step's metrics.
        write_files: False keeps everything in memory (no metrics, checkpoints or pictures).

    Raises:
        RunStopped: a trainer died (the message names the checkpoint to resume from).
        RunInterrupted: SIGINT or SIGTERM stopped the run in order (:mod:`digenrl.roles.stop`): SIGTERM after the
            step under way and its checkpoint (within ``log.term_grace`` s), SIGINT at once; artifacts written.
        ConfigError: a bad setting or checkpoint.
        RemoteError: an actor failed (its traceback attached).
    """
    if not cfg.disaggregated:
        from digenrl.recipes.colocated import train

        return train(cfg, out_dir=out_dir, on_iteration=on_step, write_files=write_files,  # type: ignore[arg-type]
                     resume=resume)
    return run_loop(arun_disaggregated(cfg, out_dir, resume, cost=cost, on_step=on_step, write_files=write_files),
                    cfg.runtime.event_loop)
