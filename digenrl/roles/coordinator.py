"""``Coordinator``: drives a schedule object with real actors and keeps the books of each batch.

State machine (one instance per run)::

    start:   publish the starting version to every rollout actor, then launch schedule.start()
    loop:    wait for the first finished token (or 0.25 s, to notice deaths of idle actors)
             ├─ result      → record its span, update the batch's books, TokenDone → new tokens
             ├─ ActorDied   → DeviceDied → the schedule re-issues the lost work
             │                (a dead trainer stops the run: RunStopped, resume from the checkpoint)
             └─ other error → stop the run (cancel what runs, re-raise)
    optim:   a batch whose samples were mostly scored with the reward penalty (FailureBudget) stops the
             run before its optimizer step: RunStopped, the last checkpoint intact
    signal:  SIGINT (digenrl.roles.stop) stops the loop at its next turn: RunInterrupted, the running tokens
             cancelled; SIGTERM first lets the next OPTIM write a checkpoint (due or not), then the same,
             unless log.term_grace runs out before that step
    join:    admit(name, ref) of a rollout actor spawned mid-run: under the weights lock (publications
             and admissions take turns, so a newcomer misses no version) the lead trainer hands it the
             newest published versions (two: staleness 1), it checks it holds them, and only then the
             schedule learns DeviceJoined (after the loop iteration's token results, so a PUBLISH that
             finished first is known to the schedule first) and may give it tokens
    done:    schedule.done (every optimizer step ran) → return the metrics history

Books per logical batch: its prompts (a pure function of seed and batch index, so the dataset
position is just the next batch index), a ``GroupAssembler`` fed by REWARD results, the advantage
of every finished group, loss sums from TRAIN results, a row ledger that proves every trained row
of the batch is trained exactly once, the rewards and (every ``log.image_every`` steps) images.

Sample grids (``on_eval``, ``log.samples = "fixed"``): at the start and after each optimizer step whose version is
due, the lead trainer samples the fixed evaluation (``sample_evaluation``: it holds that version's trained weights
and nothing need be published) and the actor that scores decodes and scores it (``score_evaluation``: a reward
actor, else a rollout actor, else the trainer); both run between those actors' tokens, beside the schedule, and
the run waits for the last before it returns.

Races: a TRAIN token may be issued before its groups' advantages exist; its task waits on a
condition until they do, and the trainer counts as busy meanwhile. (With ``adv_std = "global"``
advantages need the whole batch, so the schedule issues no TRAIN token of a batch before all of it
is scored, ``batch_advantages``: a waiting trainer could be the only device left to generate it.)
A wait no running token can end (every running token is such a TRAIN token, and no admission is
under way) stops the run with ``RunStopped`` naming the samples it waited for, never a hang. An
OPTIM token's task also computes the step's metrics and writes the checkpoint before it reports
done, so the checkpoint always holds the weights of the version just made, before any trainer can
change them. Tensors never pass through here: tokens carry fragment geometry, sources and
advantages; latents go actor to actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from digenrl.actors import dropped_counts
from digenrl.algorithms import algorithm_class
from digenrl.config import Config
from digenrl.data.prompts import batch_prompts
from digenrl.errors import ActorDied, ConfigError, DigenrlError, StalenessViolation
from digenrl.policy import trained_steps
from digenrl.rewards.failures import FailureBudget, RewardFailing
from digenrl.rl.advantages import GroupAssembler
from digenrl.roles.evaluation import Evaluation, evaluation_due, evaluation_prompts
from digenrl.rl.loss import reduce_stats
from digenrl.roles.stop import RunInterrupted, StopRequest
from digenrl.schedule import PRESETS, make_schedule
from digenrl.schedule.base import (CostEstimate, Device, DeviceDied, DeviceJoined, Role, Schedule, Token, TokenDone,
                                   TokenKind, Workload)
from digenrl.telemetry.metrics import (LOSS_KEYS, PHASE_KEYS, StepMetrics, algorithm_fields, expert_fields,
                                       parity_fields, parity_warning, total_drops)
from digenrl.telemetry.spans import SpanLog, window_bubbles

__all__ = ["Coordinator", "RunStopped"]

log = logging.getLogger(__name__)


class RunStopped(DigenrlError):
    """The run cannot continue (a trainer died, the schedule failed, or the reward keeps failing); the
    message says how to resume."""


def _in_sample_order(values: dict[int, float]) -> list[float]:
    """Values by id (sample or prompt): batch statistics must not depend on which fragment came first."""
    return [values[k] for k in sorted(values)]


# Where a token's seconds count in its batch's phase times (REWARD: minus its decode, counted apart).
_PHASE = {TokenKind.ROLLOUT: "t_rollout", TokenKind.REWARD: "t_reward", TokenKind.TRAIN: "t_train"}


@dataclass
class _Book:
    prompts: list[str]
    assembler: GroupAssembler
    adv: dict[int, tuple[float, bool]] = field(default_factory=dict)
    rewards: dict[int, float] = field(default_factory=dict)  # sample id -> reward (fragments arrive in any order)
    groups: int = 0
    zero_groups: int = 0
    sums: list[dict[str, float]] = field(default_factory=list)
    ledger: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kept_rows: int = 0
    stored_at: dict[int, str] = field(default_factory=dict)
    images: dict[int, torch.Tensor] = field(default_factory=dict)
    image_sids: dict[int, list[int]] = field(default_factory=dict)  # fragment index -> its images' sample ids
    staleness: int = 0
    components: dict[str, dict[int, float]] = field(default_factory=dict)  # reward name -> sample id -> score
    failed: int = 0  # samples scored with the failure penalty
    last_error: str = ""  # the reward's latest failure message
    group_std: dict[int, float] = field(default_factory=dict)  # prompt id -> its group's reward std
    phase: dict[str, float] = field(default_factory=dict)  # PHASE_KEYS -> seconds of this batch's tokens


class Coordinator:
    """Runs ``cfg.train.iterations - base`` optimizer steps of a schedule over real actors.

    Args:
        cfg: the run config.
        schedule_name: one of the actor schedules (``disaggregated``, ``gap``, ``tsp``, ``tag``, ``async1``).
        devices: one ``Device`` per actor (names match ``refs``).
        refs: actor refs by device name.
        prompts: the prompt pool.
        options: ``ScheduleOptions`` overrides.
        cost: the schedule's cost estimate (``None``: its default).
        base: optimizer steps already done (resume): local batch ``b`` is global batch ``base + b``.
        history: metrics of the steps already done (resume).
        is_dead: tells whether a device's process is known dead (the actor system's supervision).
        weights_lane: ``"zmq"``, ``"gloo"`` or ``"nccl"`` (see :mod:`digenrl.roles.weights`).
        bucket_mb: weight bucket size.
        checkpoint: ``async (step, state) -> None`` writing a checkpoint (``None``: no checkpoints).
        checkpoint_every: optimizer steps between checkpoints.
        on_step: called with each optimizer step's metrics.
        on_images: called with ``(step, images, prompts, rewards)`` for the steps that log their training samples
            (``log.samples = "rollout"``).
        on_eval: called with each fixed evaluation (:class:`~digenrl.roles.evaluation.Evaluation`) of a due version
            (``log.samples = "fixed"``; ``None``: none is run).
        on_dispatch: called with ``(device, token)`` as each token is sent (``token`` as the actor
            receives it: ``kind``, global ``batch`` and ``version``, fragments...), e.g. to watch
            an actor start a piece of work. If it returns an awaitable, the token is sent once that
            completes (a test holds a token until an event).
        shard: the trainer group's sharding (``Config.shard``). Under ``fsdp`` the schedule sees the
            lead trainer only and every TRAIN, OPTIM and PUBLISH token runs on the whole group (the
            others, ``followers``, enter the same collectives); TAG is off (a forward is a collective).
        on_admit: called with the record of each rollout actor admitted mid-run (see :meth:`admit`).
        stop: what SIGINT and SIGTERM ask of the run (:class:`~digenrl.roles.stop.StopRequest`; ``None``: nothing).
    """

    def __init__(self, cfg: Config, schedule_name: str, devices: list[Device], refs: dict[str, Any],
                 prompts: list[str], *, options: dict[str, Any] | None = None, cost: CostEstimate | None = None,
                 base: int = 0, history: list[dict[str, Any]] | None = None,
                 is_dead: Callable[[str], bool] = lambda name: False, weights_lane: str = "zmq",
                 bucket_mb: float = 64.0, checkpoint: Callable[[int, dict[str, Any]], Any] | None = None,
                 checkpoint_every: int = 1, on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_images: Callable[[int, torch.Tensor, list[str], list[float]], None] | None = None,
                 on_eval: Callable[[Evaluation], None] | None = None,
                 on_dispatch: Callable[[str, dict[str, Any]], Any] | None = None, t0: float | None = None,
                 shard: str = "none", on_admit: Callable[[dict[str, Any]], None] | None = None,
                 stop: StopRequest | None = None) -> None:
        self.cfg = cfg
        self.stop = stop
        self._boundary = False  # a step ended after a SIGTERM, with its checkpoint: the run may stop there
        self.devices = list(devices)
        self.refs = refs
        self.prompts = prompts
        self.base = base
        self.history = list(history or [])
        self.is_dead = is_dead
        self.weights_lane = weights_lane
        self.bucket_mb = bucket_mb
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.on_step = on_step
        self.reward_budget = FailureBudget.for_config(cfg.reward)  # stops a run whose reward keeps failing
        self.on_images = on_images
        self.on_eval = on_eval
        self.eval_prompts = evaluation_prompts(prompts, cfg.log.seed, cfg.log.images_per_grid)
        self._evals: set[asyncio.Task[None]] = set()  # fixed evaluations under way
        self.on_dispatch = on_dispatch
        self.drops_zero_std = algorithm_class(cfg.train.algorithm).drops_zero_std
        if cfg.train.control == "shuffled":
            raise ConfigError("train.control = 'shuffled' permutes advantages across the whole batch, which "
                              "a streaming (GAP) run never holds at once; use the colocated recipe for it")
        ro = cfg.rollout
        self.workload = Workload(cfg.train.iterations - base, ro.prompts_per_batch, ro.group_size, ro.num_steps,
                                 trained_steps(cfg))
        opts = dict(options or {})
        if cfg.schedule.staleness:
            opts["staleness"] = cfg.schedule.staleness
        # The batch's reward std: no row is trainable before every group of the batch is scored.
        opts.setdefault("batch_advantages", cfg.train.adv_std == "global")
        self.shard = shard
        group = [d.name for d in self.devices if d.role is Role.TRAINER]
        self.followers = group[1:] if shard == "fsdp" else []
        if self.followers and opts.get("tag", True):
            log.info("train.shard = 'fsdp': trainers do not generate (TAG off): a forward is a collective of the group")
            opts["tag"] = False
        scheduled = [d for d in self.devices if d.name not in self.followers]
        if PRESETS[schedule_name].colocated:  # colocated-tsp: every trainer actor is a hybrid (samples, then trains)
            scheduled = [replace(d, role=Role.HYBRID) if d.role is Role.TRAINER else d for d in scheduled]
        self.schedule: Schedule = make_schedule(schedule_name, scheduled, self.workload, cost, **opts)
        self.staleness = int(getattr(getattr(self.schedule, "opt", None), "staleness", 0))
        self.role = {d.name: d.role for d in self.devices}
        self.alive = {d.name for d in self.devices}
        self.t0 = t0 if t0 is not None else time.time()
        self.spans = SpanLog(self.t0)
        self._tasks: dict[asyncio.Task[Any], Token] = {}
        self._dispatched: dict[str, float] = {}  # device -> dispatch time of its running compute token
        self._books: dict[int, _Book] = {}
        self._adv_ready = asyncio.Condition()
        self._last_optim = self.t0
        self.lost_devices: list[str] = []
        self.token_log: list[tuple[Token, float]] = []  # every completed token with its measured seconds
        # ROLLOUT/REWARD/TRAIN tokens: seconds their device spent on the token beyond its compute (the call's
        # trip both ways and this coordinator's handling of the result up to the next launch): the per-token
        # overhead a cost model must charge (`bench bubbles --real` writes its median to the costs file).
        self.overhead_log: list[tuple[Token, float]] = []
        self._sent: dict[int, float] = {}  # token id -> when its call was sent
        self._dropped: dict[str, dict[str, int]] = {}  # endpoint -> its latest dropped-input counters
        self.on_admit = on_admit
        self._weights = asyncio.Lock()  # publications and admissions take turns
        self._published: list[int] = []  # versions published to the rollout actors, in order
        # One record per publication (summary.json): its version, the lead's seconds, the bytes each receiver got
        # and, under transport.weights_compression, the method, the uncompressed bytes and the receivers' error.
        self.publications: list[dict[str, Any]] = []
        self._started = asyncio.Event()  # the starting version is out: admissions may proceed
        self._admissions: dict[asyncio.Future[dict[str, Any]], str] = {}  # running admission -> newcomer
        self.admitted: list[dict[str, Any]] = []  # one record per rollout actor admitted mid-run
        self._unannounced: set[str] = set()  # admitted, not yet announced to the schedule (DeviceJoined)
        self._awaiting: dict[int, tuple[_Book, list[int]]] = {}  # TRAIN token id -> the samples it waits for

    # -- public --------------------------------------------------------------------------------
    @property
    def trainers(self) -> list[str]:
        return [d.name for d in self.devices if d.role is Role.TRAINER and d.name in self.alive]

    @property
    def group(self) -> list[str]:
        """The members of the trainer group that an OPTIM (and under FSDP every trainer token) runs on."""
        return self.trainers

    @property
    def rollouts(self) -> list[str]:
        return [d.name for d in self.devices if d.role is Role.ROLLOUT and d.name in self.alive]

    async def run(self) -> list[dict[str, Any]]:
        """Drive the schedule to the end; returns the metrics history (one dict per optimizer step).

        Raises:
            RunStopped: a trainer died or the schedule failed (the message says how to resume).
            RunInterrupted: a signal stopped it (``step``: the steps done, resumed ones included).
            StalenessViolation: an invariant broke (a row trained twice, a version mismatch).
            RemoteError: an actor's endpoint raised.
        """
        with self.stop.polled() if self.stop is not None else contextlib.nullcontext():
            return await self._run()

    async def _run(self) -> list[dict[str, Any]]:
        try:
            if getattr(getattr(self.schedule, "opt", None), "previous_version", False):
                await self._publish(self.base - 1)  # a stale resume: the next batch was started with it
            await self._publish(self.base)
            self._started.set()
            self._launch_eval(self.base)  # the weights the run starts from
            self._launch(self.schedule.start())
            while not self.schedule.done:
                self._check_stop()
                if self.schedule.failed:
                    raise RunStopped(f"schedule failed: {self.schedule.failed}")
                if not self._tasks and not self._admissions:
                    raise RunStopped(f"the schedule stalled at version {self.version}: no token running and the run is "
                                     f"not done (live: {', '.join(sorted(self.alive))})")
                # The timeout only matters for deaths of idle actors: a running token's death
                # surfaces as ActorDied from its own call right away.
                done, _ = await asyncio.wait({*self._tasks, *self._admissions}, timeout=0.25,
                                             return_when=asyncio.FIRST_COMPLETED)
                self._check_deaths()
                for task in done:
                    token = self._tasks.pop(task, None)
                    if token is not None:
                        await self._settle(task, token)
                for task in done:  # after the tokens: a PUBLISH done before an admission reaches the schedule first
                    if task in self._admissions:
                        self._joined(task, self._admissions.pop(task))
                self._check_waits()
            if self._evals:  # the last version's grid
                await asyncio.gather(*self._evals)
        finally:
            running = [*self._tasks, *self._admissions, *self._evals]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self._tasks.clear()
            self._admissions.clear()
        return self.history

    def _check_stop(self) -> None:
        """Stop on a signal: at once (SIGINT, SIGTERM's grace spent), or at the step boundary SIGTERM waits for."""
        s = self.stop
        if s is not None and s.signum is not None and (s.now or self._boundary):
            log.debug("[shutdown] Coordinator: step=interrupted signal=%s version=%d", signal.Signals(s.signum).name,
                     self.version)
            raise RunInterrupted(s.signum, len(self.history))

    def admit(self, name: str, ref: Any) -> asyncio.Future[dict[str, Any]]:
        """Add the rollout actor ``name`` (spawned and connected to its peers by the caller) to the running run.

        It receives the newest published versions before the schedule may give it a token (see the
        state machine above); until then it is not among ``rollouts``. Returns the admission's future:
        its record ``{"device", "versions", "published", "generation", "t0", "t1"}`` (times relative
        to the run's start; ``versions``: what the newcomer reports holding), also passed to
        ``on_admit`` and kept in ``admitted``.

        Raises:
            ValueError: ``name`` is already a device of this run.
        """
        if name in self.role or name in self._admissions.values():
            raise ValueError(f"{name!r} is already a device of this run")
        task = asyncio.ensure_future(self._admit(name, ref))
        self._admissions[task] = name
        return task

    # -- launching -----------------------------------------------------------------------------
    def _book(self, batch: int) -> _Book:
        book = self._books.get(batch)
        if book is None:
            ro, tr, r = self.cfg.rollout, self.cfg.train, self.cfg.reward
            assembler = GroupAssembler(ro.group_size, std=tr.adv_std, num_groups=ro.prompts_per_batch,  # type: ignore[arg-type]
                                       clip=tr.adv_clip, normalize=r.normalize, weights=r.weights,  # type: ignore[arg-type]
                                       penalty=r.penalty)
            book = self._books[batch] = _Book(batch_prompts(self.prompts, self.cfg.log.seed, batch,
                                                            ro.prompts_per_batch), assembler)
        return book

    def _wire(self, token: Token) -> dict[str, Any]:
        return {"id": token.id, "kind": token.kind.value, "batch": token.batch + self.base,
                "version": token.policy_version + self.base, "start": token.step_start, "end": token.step_end,
                "frags": [[f.index, f.prompt_start, f.prompt_end, f.member_start, f.member_end, f.group_size]
                          for f in token.fragments],
                "rows": [list(r) for r in token.rows], "sources": list(token.sources), "helper": token.helper,
                "packed": token.packed}

    def _launch(self, tokens: list[Token]) -> None:
        now = time.time()
        for token in tokens:
            if token.kind in (TokenKind.ROLLOUT, TokenKind.REWARD, TokenKind.TRAIN):
                self._dispatched[token.device] = now
            task = asyncio.ensure_future(self._execute(token))
            self._tasks[task] = token

    async def _execute(self, token: Token) -> dict[str, Any]:
        kind, w = token.kind, self._wire(token)
        if self.on_dispatch is not None and inspect.isawaitable(held := self.on_dispatch(token.device, w)):
            await held
        ref = self.refs[token.device]
        book = self._book(w["batch"])
        if kind is TokenKind.ROLLOUT:
            book.staleness = max(book.staleness, token.batch - token.policy_version)
            self._sent[token.id] = time.time()
            return await ref.rollout.call(w, book.prompts)
        if kind is TokenKind.REWARD:
            trainers = self.trainers
            store = trainers[token.fragments[0].index % len(trainers)]
            every = self.cfg.log.image_every
            images = bool(every) and self.on_images is not None and (
                w["batch"] % every == 0 or w["batch"] == self.cfg.train.iterations - 1)
            self._sent[token.id] = time.time()
            result = await ref.reward.call(w, book.prompts, store, images)
            result["store"] = store
            return result
        if kind is TokenKind.TRAIN:
            infos = await self._train_infos(book, token)
            self._sent[token.id] = time.time()  # after the wait for advantages: that is a dependency, not overhead
            if not self.followers:
                return await ref.train.call(w, infos)
            # FSDP: every member trains its slice of the token's rows; the lead reports the rows.
            results = await asyncio.gather(*(self.refs[n].train.call(w, infos) for n in self.group))
            for name, res in zip(self.group[1:], results[1:], strict=True):
                self.spans.add(name, kind, w["batch"], token.fragment, w["version"], res["t0"], res["t1"],
                               token.num_samples, False, token.id)
            return {"sums": [s for res in results for s in res["sums"]], "rows": results[0]["rows"],
                    "t0": results[0]["t0"], "t1": max(res["t1"] for res in results)}
        if kind is TokenKind.OPTIM:
            return await self._optim(token, w["batch"], book)
        if kind is TokenKind.PUBLISH:
            return await self._publish(w["version"])
        if kind is TokenKind.SWITCH:  # a hybrid actor samples and trains with its one model: nothing to move
            now = time.time()
            return {"t0": now, "t1": now}
        raise StalenessViolation(f"coordinator cannot run a {kind.value} token (disaggregated schedules only)")

    async def _train_infos(self, book: _Book, token: Token) -> list[dict[str, Any]]:
        sids = [f.sample_ids() for f in token.fragments]
        self._awaiting[token.id] = (book, [s for ss in sids for s in ss])  # (seen by _check_waits)
        try:
            async with self._adv_ready:
                await self._adv_ready.wait_for(lambda: all(s in book.adv for ss in sids for s in ss))
        finally:
            del self._awaiting[token.id]
        sign = -1.0 if self.cfg.train.control == "negated" else 1.0  # the negative control of ALGORITHM (f)
        drops = self.drops_zero_std  # Flow-GRPO leaves equal-reward groups out; the forward-process methods train them
        return [{"adv": [sign * book.adv[s][0] for s in ss], "keep": [not (drops and book.adv[s][1]) for s in ss],
                 "store": book.stored_at[f.index]} for f, ss in zip(token.fragments, sids, strict=True)]

    async def _publish(self, version: int) -> dict[str, Any]:
        async with self._weights:  # the receivers are the rollout actors live now, admitted ones included
            lead = self.trainers[0]
            t0 = time.time()
            # gloo / nccl: the lead broadcasts over its communicator group with the live rollout actors
            # (re-formed by the lead when they changed); zmq: it sends each one the buckets.
            publish = self.refs[lead].publish_comm if self.weights_lane in ("gloo", "nccl") else self.refs[lead].publish
            calls = [publish.call(version, self.rollouts)]
            calls += [self.refs[n].publish.call(version, []) for n in self.followers if n in self.alive]  # FSDP gathers
            out = (await asyncio.gather(*calls))[0]
            if version not in self._published:
                self._published.append(version)
        self._drop_failed(out)
        out.setdefault("t0", t0)
        stats = out.get("compression") or {}
        self.publications.append({"version": version, "seconds": out["t1"] - out["t0"], "bytes": out.get("bytes", 0),
                                  **{k: stats[k] for k in ("method", "full_bytes", "max_abs", "rel") if k in stats}})
        return out

    # -- the fixed evaluation (sample grids) -------------------------------------------------------
    def _launch_eval(self, version: int) -> None:
        if self.on_eval is not None and evaluation_due(self.cfg, version) and self.trainers:
            task = asyncio.ensure_future(self._evaluate(version))
            self._evals.add(task)
            task.add_done_callback(self._evals.discard)

    def _scorer(self) -> str:
        """Who decodes and scores the evaluation: a reward actor, else a rollout actor, else the lead trainer
        (then a TAG trainer, which holds the VAE and the reward)."""
        alive = [d.name for d in self.devices if d.name in self.alive]
        for role in (Role.REWARD, Role.ROLLOUT):
            names = [n for n in alive if self.role.get(n) is role]
            if names:
                return names[0]
        return self.trainers[0]

    async def _evaluate(self, version: int) -> None:
        """Version ``version``'s fixed evaluation: sampled on the lead trainer, scored by :meth:`_scorer`; a failure
        costs its grid, never the run."""
        try:
            sampled = await self.refs[self.trainers[0]].sample_evaluation.call(version, self.eval_prompts)
            scored = await self.refs[self._scorer()].score_evaluation.call(sampled["latents"], self.eval_prompts,
                                                                        version)
            assert self.on_eval is not None
            self.on_eval(Evaluation.from_wire(scored))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an actor that died is the schedule's business; a grid is not worth a run
            log.warning("coordinator: the fixed evaluation of version %d failed (%s: %s); no grid for it", version,
                        type(exc).__name__, exc)

    def _drop_failed(self, out: dict[str, Any]) -> None:
        for name in out.get("failed", []):
            # Supervision may not have reported it yet; the receiver's ActorDied is proof enough.
            self._died(name, "died while receiving weights")

    async def _admit(self, name: str, ref: Any) -> dict[str, Any]:
        await self._started.wait()
        async with self._weights:
            t0 = time.time()
            out = await self.refs[self.trainers[0]].admit.call([*self.rollouts, name], [name])
            if name in out["failed"]:
                raise ActorDied(name, "died while receiving its first weights")
            held = (await ref.weights_info.call())["versions"]
            need = self._published[-2:]  # what the schedule assumes every rollout actor holds
            if not set(need) <= set(held):
                raise StalenessViolation(f"{name} holds versions {held} after its admission; the run published {need}")
            self.refs[name] = ref
            self.devices.append(Device(name, Role.ROLLOUT))
            self.role[name] = Role.ROLLOUT
            self.alive.add(name)  # every later publication includes it
            self._unannounced.add(name)  # until the schedule hears of it in _joined
        self._drop_failed(out)
        return {"device": name, "versions": held, "published": need, "generation": out.get("generation", -1),
                "t0": t0 - self.t0, "t1": time.time() - self.t0}

    def _joined(self, task: asyncio.Future[dict[str, Any]], name: str) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, StalenessViolation):
            raise exc
        if exc is not None:  # the run goes on without it
            log.warning("coordinator: could not admit %s (%s: %s); the run goes on without it", name,
                        type(exc).__name__, exc)
            return
        record = task.result()
        if name not in self._unannounced:  # it died in between (_died dropped it)
            return
        self._unannounced.discard(name)
        self.admitted.append(record)
        # Its span: the newcomer was busy receiving weights (the trace shows them before its first token).
        self.spans.add(name, TokenKind.PUBLISH, self.version, -1, record["published"][-1], record["t0"] + self.t0,
                       record["t1"] + self.t0)
        log.info("coordinator: %s joined the run at version %d (holds %s)", name, record["published"][-1],
                 record["versions"])
        if self.lost_devices:  # a worker cut off and back (or a replacement): say what it costs
            log.warning("coordinator: %s replaces lost %s: from here this run is not the one an uninterrupted run "
                        "gives", name, ", ".join(map(str, self.lost_devices)))
        if self.on_admit is not None:
            self.on_admit(record)
        self._launch(self.schedule.on_event(DeviceJoined(Device(name, Role.ROLLOUT))))

    async def _optim(self, token: Token, batch: int, book: _Book) -> dict[str, Any]:
        group = self.group
        expected = self.workload.rows_per_batch
        covered = sum(e - s for spans in book.ledger.values() for s, e in spans)
        if covered != expected:
            raise StalenessViolation(f"batch {batch}: {covered} rows trained before its optimizer step, expected {expected}")
        if self.reward_budget is not None:  # before the step: a batch of penalties must not make a version
            try:
                self.reward_budget.add(batch, book.failed, self.workload.samples_per_batch, book.last_error)
            except RewardFailing as exc:
                raise RunStopped(f"{exc}. The last checkpoint is intact: once the reward answers, resume with "
                                 "--resume <run dir>") from exc
        terminating = self.stop is not None and self.stop.checkpoint_due  # SIGTERM: this step is the boundary
        due = self.checkpoint is not None and self.checkpoint_every and (
            (batch + 1) % self.checkpoint_every == 0 or batch + 1 == self.cfg.train.iterations or terminating)
        # A stale run's checkpoint also holds the weights before this step: the next batch uses them
        # (kept by the lead; under FSDP by every member, each its shards, gathered when written).
        keep = [bool(due and self.staleness and (n == group[0] or self.followers)) for n in group]
        # Every member enters the step together: its gradient all-reduce is a collective of the group.
        results = await asyncio.gather(*(self.refs[n].optim.call(batch, book.kept_rows, k)
                                         for n, k in zip(group, keep, strict=True)))
        for name, res in zip(group, results, strict=True):
            book.phase["t_train"] = book.phase.get("t_train", 0.0) + res["t1"] - res["t0"]
            self.spans.add(name, TokenKind.OPTIM, batch, -1, token.policy_version + self.base, res["t0"], res["t1"],
                           helper=False, token=token.id)
        metrics = self._step_metrics(batch, book, results[0])
        if due:
            assert self.checkpoint is not None
            await self.checkpoint(batch + 1, self.state(batch + 1))
        if self.on_step is not None:
            self.on_step(metrics)
        self._launch_eval(batch + 1)  # queued on the lead trainer right behind this step
        # A SIGTERM seen before this step's checkpoint was decided: the run stops here (with no checkpoints
        # configured, at the first step after it).
        self._boundary = self._boundary or (terminating and bool(due or not self.checkpoint_every
                                                                 or self.checkpoint is None))
        return results[0]

    # -- completion ----------------------------------------------------------------------------
    async def _settle(self, task: asyncio.Task[Any], token: Token) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, ActorDied):
            # The actor named in the error died.
            dead = exc.actor if exc.actor in self.role else token.device
            self._died(dead, exc.reason)
            return
        if exc is not None:
            await asyncio.sleep(0.3)  # let supervision mark a dead peer first: the error may be its echo
            self._check_deaths()
            raise exc
        result = task.result()
        self._dispatched.pop(token.device, None)
        self._record(token, result)
        seconds = max(1e-6, result["t1"] - result["t0"])
        self.token_log.append((token, seconds))
        self._launch(self.schedule.on_event(TokenDone(token, observed_seconds=seconds)))
        sent = self._sent.pop(token.id, None)
        if sent is not None:
            self.overhead_log.append((token, max(0.0, time.time() - sent - seconds)))

    def _record(self, token: Token, result: dict[str, Any]) -> None:
        kind, batch = token.kind, token.batch + self.base
        self._dropped.update(result.get("dropped") or {})
        if kind is not TokenKind.OPTIM:
            self.spans.add(token.device, kind, batch, token.fragment, token.policy_version + self.base,
                           result["t0"], result["t1"], token.num_samples, token.helper, token.id)
        book = self._books.get(batch)
        if book is not None and kind in _PHASE:
            book.phase[_PHASE[kind]] = book.phase.get(_PHASE[kind], 0.0) + result["t1"] - result["t0"]
        if kind is TokenKind.REWARD and book is not None:
            book.phase["t_reward"] -= result["decode_s"]
            book.phase["t_decode"] = book.phase.get("t_decode", 0.0) + result["decode_s"]
            book.failed += result["failed"]
            book.last_error = result.get("error") or book.last_error
            completed = []
            for frag, rewards, comps in zip(token.fragments, result["rewards"], result["components"], strict=True):
                book.stored_at[frag.index] = result["store"]
                sids = frag.sample_ids()
                book.rewards.update(zip(sids, map(float, rewards), strict=True))
                for name, scores in comps.items():
                    book.components.setdefault(name, {}).update(zip(sids, map(float, scores), strict=True))
                prompts = [frag.prompt_start + i // frag.num_members for i in range(frag.num_samples)]
                completed += book.assembler.add(prompts, sids, rewards, comps)  # comps: {} when the call failed
            for imgs, frag in zip(result.get("images", []), token.fragments, strict=False):
                book.images[frag.index] = imgs
                book.image_sids[frag.index] = frag.sample_ids()
            for group in completed:
                book.groups += 1
                book.zero_groups += group.zero_std
                book.group_std[group.prompt_id] = float(group.rewards.double().std(unbiased=False))
                for sid, a in zip(group.sample_ids, group.advantages.tolist(), strict=True):
                    book.adv[sid] = (a, group.zero_std)
            if completed:
                asyncio.ensure_future(self._notify())
        elif kind is TokenKind.TRAIN and book is not None:
            book.sums.extend(result["sums"])
            for index, s, e, kept in result["rows"]:
                spans = book.ledger.setdefault(index, [])
                if any(s < e2 and s2 < e for s2, e2 in spans):
                    raise StalenessViolation(f"batch {batch} fragment {index}: rows [{s}, {e}) trained twice")
                spans.append((s, e))
                book.kept_rows += kept
        elif kind is TokenKind.OPTIM:
            self._books.pop(batch, None)

    async def _notify(self) -> None:
        async with self._adv_ready:
            self._adv_ready.notify_all()

    def _step_metrics(self, batch: int, book: _Book, optim: dict[str, Any]) -> dict[str, Any]:
        end = time.time()
        start_rel, end_rel = self._last_optim - self.t0, end - self.t0
        running = {d: t - self.t0 for d, t in self._dispatched.items()}
        bubbles = window_bubbles(self.spans.spans, [d.name for d in self.devices if d.name in self.alive],
                                 start_rel, end_rel, running)
        bubbles["overall"] = sum(bubbles.values()) / max(1, len(bubbles))
        rewards = torch.tensor(_in_sample_order(book.rewards), dtype=torch.float64)
        stats = reduce_stats(book.sums) if book.sums else {}
        seconds = end - self._last_optim
        self._last_optim = end
        adv = _in_sample_order({sid: a for sid, (a, _) in book.adv.items()})
        dropped, by_reason = total_drops({**self._dropped, **dropped_counts()})  # the actors' and our own node's
        metrics = StepMetrics(
            step=batch, version=batch + 1, time=end_rel, seconds=seconds,
            samples_per_s=self.workload.samples_per_batch / max(seconds, 1e-9),
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
            reward_std_mean=sum(_in_sample_order(book.group_std)) / max(1, len(book.group_std)),
            reward_failures=book.failed,
            zero_std_ratio=book.zero_groups / max(1, book.groups), adv_abs_mean=sum(map(abs, adv)) / max(1, len(adv)),
            rows_trained=sum(e - s for spans in book.ledger.values() for s, e in spans), rows_kept=book.kept_rows,
            **{k: stats.get(k, 0.0) for k in LOSS_KEYS}, grad_norm=optim["grad_norm"], max_staleness=book.staleness,
            bubble_ratio=bubbles, **{k: book.phase.get(k, 0.0) for k in PHASE_KEYS},
            dropped_messages=dropped, dropped=by_reason,
            rewards={name: float(torch.tensor(_in_sample_order(v)).mean()) for name, v in book.components.items() if v},
            **parity_fields(stats), rows_by_expert=expert_fields(stats),
            algorithm=algorithm_fields(stats, optim.get("terms", {})),
        ).line()
        if (warning := parity_warning(metrics, self.cfg.train.parity_tolerance)) is not None:
            log.warning("coordinator: %s", warning)
        self.history.append(metrics)
        if book.images and self.on_images is not None:
            sids = [s for k in sorted(book.images) for s in book.image_sids.get(k, [])]
            g = self.cfg.rollout.group_size
            self.on_images(batch, torch.cat([book.images[k] for k in sorted(book.images)]),
                           [book.prompts[s // g] for s in sids], [book.rewards.get(s, float("nan")) for s in sids])
        return metrics

    # -- faults --------------------------------------------------------------------------------
    def _check_waits(self) -> None:
        """Stop a run whose every running token is a TRAIN token waiting for advantages: nothing runs that
        could score their samples, and the schedule hands out work only as tokens finish.

        Raises:
            RunStopped: naming each waiting token, the samples it lacks and the batch's scored share.
        """
        if self._admissions or not self._tasks or any(t.id not in self._awaiting for t in self._tasks.values()):
            return
        waits = []
        for token in self._tasks.values():
            book, sids = self._awaiting[token.id]
            missing = [s for s in sids if s not in book.adv]
            if not missing:
                return  # its advantages are in: it wakes at the condition's next notify
            waits.append(f"TRAIN token {token.id} on {token.device} waits for the advantages of batch "
                         f"{token.batch + self.base} samples {missing} ({len(book.rewards)} of "
                         f"{self.workload.samples_per_batch} samples of the batch scored)")
        raise RunStopped(f"the run stalled: {'; '.join(waits)}, and no running token can score them (live: "
                         f"{', '.join(sorted(self.alive))}). This is a bug of the schedule; the last checkpoint "
                         "is intact: resume with --resume <run dir>")

    def _check_deaths(self) -> None:
        for name in sorted(self.alive):
            if self.is_dead(name):
                self._died(name, "process is gone")

    def _died(self, name: str, reason: str) -> None:
        if name not in self.alive:
            return
        self.alive.discard(name)
        self.lost_devices.append(name)
        self._dispatched.pop(name, None)
        for task, token in list(self._tasks.items()):
            if name in token.devices:
                task.cancel()
                del self._tasks[task]
        if self.role[name] is Role.TRAINER:
            raise RunStopped(f"trainer {name} died ({reason}) at version {self.version}; its accumulated "
                             f"gradients are lost. The last checkpoint is intact: resume with --resume <run dir>")
        if name in self._unannounced:  # admitted, but the schedule never gave it work
            self._unannounced.discard(name)
            log.warning("coordinator: %s died (%s) right after its admission", name, reason)
            return
        log.warning("coordinator: %s died (%s); re-issuing its work", name, reason)
        self._launch(self.schedule.on_event(DeviceDied(name)))

    @property
    def version(self) -> int:
        return self.base + int(getattr(self.schedule, "version", 0))

    def state(self, version: int) -> dict[str, Any]:
        """The coordinator's checkpoint state at ``version`` (optimizer steps done)."""
        in_flight = sorted({(b, f) for b, book in self._books.items() if b >= version for f in book.stored_at})
        return {"version": version, "next_batch": version, "seed": self.cfg.log.seed, "history": self.history,
                "schedule": self.schedule.name, "in_flight": [list(x) for x in in_flight],
                "lost_devices": self.lost_devices}
