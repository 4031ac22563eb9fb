"""``TrainerActor``: TSP-packed training tokens, gradient accumulation, optimizer steps, weight publication.

Data path: a REWARD token's executor hands each scored fragment's transitions to one trainer's
fragment store (``store_fragment``, a control endpoint, so it lands while this trainer computes).
A TRAIN token then takes rows ``[s, e)`` of its fragments from the local store, or pulls them from
the storing trainer (``fetch_stored``), and runs one forward/backward per ``rows_per_pass`` rows
(TSP; ``packed=False`` runs Flow-GRPO's per-timestep loop instead). Losses are *sums* over rows;
``optim`` divides the accumulated gradients by the batch's total trained rows, so any split of a
batch into tokens (GAP) gives the one-shot mean-loss gradient up to float rounding.

Several trainers form one torch.distributed group when they are spawned (``open_group`` on the lead,
then ``connect`` with a rank on each; :mod:`digenrl.roles.trainer_group`). ``train.shard = "ddp"``:
each trainer accumulates its own tokens' gradients and ``optim`` sums them with one bucketed
all-reduce before the identical step on every member. ``"fsdp"``: FSDP2 shards the transformer; every
member runs every TRAIN token on its slice of the rows (``sliced_backward``), and publication and
checkpoints gather full tensors one at a time (all members enter those calls; the lead sends/writes).
The lead trainer publishes new versions (``publish``). With TAG a trainer also runs ROLLOUT/REWARD
tokens, at its own (newest) version only (not under FSDP, where a forward is a collective).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

import torch

from digenrl.actors import dropped_counts
from digenrl.actors.base import Actor, endpoint
from digenrl.algorithms import Backward, algorithm_for
from digenrl.config import config_from_dict
from digenrl.errors import ActorDied, ConfigError, StalenessViolation
from digenrl.models import cat_cond, cond_to
from digenrl.models.experts import expert_splitter
from digenrl.models.lora import (load_trainable, load_trainable_state_dict, trainable_mode, trainable_parameters,
                                 trainable_state_dict)
from digenrl.policy import build_model, prepare_for_training
from digenrl.rl.loss import Sums, host_sums
from digenrl.rl.lr import set_lr
from digenrl.roles.compress import DeltaChain, decode_fragment
from digenrl.roles.fragments import FragmentData, FragmentEngine, probe_velocity
from digenrl.roles.rollout import GenerationMixin, limit_threads, reward_builder
from digenrl.roles.sp_group import mirrored
from digenrl.roles.trainer_group import (TrainerGroup, all_reduce_buckets, gathered_state_dict, group_backend,
                                         open_store, shard_model)
from digenrl.roles.weights import pack_buckets, state_digest

__all__ = ["TrainerActor", "PREVIOUS_WEIGHTS"]

PREVIOUS_WEIGHTS = "previous.safetensors"  # in a checkpoint of a one-step-stale run: version - 1's weights
PARITY_SAMPLE_ROWS = 16  # rows of a stale pass recomputed under the behaviour weights (train.check_parity)

log = logging.getLogger(__name__)


class TrainerActor(GenerationMixin, Actor):
    """Trains on scored fragments, steps the optimizer once per logical batch, publishes versions.

    Args:
        config: the run config as a plain dict (``Config.to_dict()``).
        threads: torch threads of this process.
        staleness: the largest ``batch - policy_version`` a trained sample may have.
        bucket_mb: weight bucket size for publication.
    """

    samples_cross_link = False  # fragments it generates (TAG) go to trainers on its own fabric, uncompressed

    def __init__(self, config: dict[str, Any], threads: int = 1, staleness: int = 0, bucket_mb: float = 64.0) -> None:
        self.config = config
        self.threads = threads
        self.staleness = staleness
        self.bucket_mb = bucket_mb
        self.peers = {}

    async def setup(self) -> None:
        limit_threads(self.threads)
        self.cfg = cfg = config_from_dict(self.config)
        self.name = self.ref.name
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"digenrl-{self.name}")
        torch.manual_seed(cfg.log.seed)
        self.model, self.params = await self._compute(build_model, cfg)
        await self._compute(prepare_for_training, self.model, cfg)
        self.shard = cfg.shard
        self.group: TrainerGroup | None = None
        self._store: Any = None
        self._new_optimizer()
        # train.algorithm: its rows, loss, extra weights (an old / EMA policy) and what rollouts sample with
        self.algorithm = algorithm_for(cfg, self.model, trains=True)
        self._step_terms: dict[str, float] = {}
        # A trainer that generates (TAG) scores what it finishes when no reward actor does: its reward is built
        # now, on the compute thread (a learned one loads its model there); otherwise at first use.
        make = reward_builder(cfg)
        scores = cfg.trainers_generate and not cfg.placement.reward
        self.engine = FragmentEngine(cfg, self.model, await self._compute(make) if scores else None, make_reward=make,
                                     algorithm=self.algorithm)
        self.store: dict[tuple[int, int], FragmentData] = {}
        self.version = 0
        self._previous: dict[str, torch.Tensor] | None = None  # version - 1's weights, for a stale checkpoint
        self._behaviour: dict[str, torch.Tensor] | None = None  # version - 1's weights, for train.check_parity
        self._publisher: Any = None  # the gloo / nccl weight lane, formed at the first publication
        # zmq lane of a run that rollout actors may join (placement.max_rollout): the newest two published
        # versions, packed, for a newcomer (the gloo / nccl publisher keeps its own)
        self._kept: dict[int, tuple[list[list[Any]], list[torch.Tensor]]] | None = {} if cfg.placement.late_rollout else None
        # transport.weights_compression: the rollout pool's weights, moved by deltas (roles/compress.py; zmq lane)
        tc = cfg.transport
        self._deltas = DeltaChain(tc.weights_codec, tc.topk_fraction, tc.weights_max_error) \
            if tc.weights_codec != "none" else None

    def _new_optimizer(self) -> None:
        t = self.cfg.train
        self.params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.betas[0], t.betas[1]),
                                           weight_decay=t.weight_decay, eps=t.eps)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.close()
        if getattr(self, "group", None) is not None and exc is None:
            self.group.close()  # (after a peer died a collective may hang: the process just exits)
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)

    def _use_version(self, version: int) -> None:
        if version != self.version:
            raise StalenessViolation(f"{self.name} holds version {self.version}; a TAG token asked for {version}")

    # -- wiring --------------------------------------------------------------------------------
    @endpoint
    async def open_group(self, world_size: int) -> str:
        """Lead trainer: open the trainer group's rendezvous (a TCPStore on a free port); returns ``host:port``."""
        host = self._host()
        self._store = await self._compute(open_store, host, world_size, self.cfg.train.group_timeout)
        return f"{host}:{self._store.port}"

    def _host(self) -> str:
        # The address peers reach this trainer's host by: its actor endpoint's, when that is TCP.
        from urllib.parse import urlsplit

        address = self.ref.address
        host = urlsplit(address).hostname if address.startswith("tcp://") else None
        return host if host and host not in ("0.0.0.0", "*") else "127.0.0.1"

    @endpoint
    async def connect(self, peers: dict[str, Any], version: int = 0, group: dict[str, Any] | None = None) -> str:
        """Learn the peers' refs and the starting version; join the trainer group.

        ``group``: ``{"rank", "world_size", "address"}`` (all members call ``connect`` together: joining
        waits for every rank). Under ``fsdp`` the model is sharded and the optimizer rebuilt here.
        """
        self.peers = dict(peers)
        self.version = version
        if group is not None:
            await self._compute(self._join, group)
        return self.name

    def _join(self, group: dict[str, Any]) -> None:
        t = self.cfg.train
        self.group = TrainerGroup(group["rank"], group["world_size"], group["address"],
                                  group_backend(self.cfg.model.device), t.group_timeout,
                                  store=self._store if group["rank"] == 0 else None)
        self._join_trainer_mesh(group, self.model)  # a sequence-parallel trainer: its SP and data-parallel groups
        if self.shard == "fsdp":
            shard_model(self.model, t.fp32_master and self.cfg.model.dtype != "float32")
            self._new_optimizer()
            # the slow copies, taken again from the sharded weights (each member its shards)
            self.algorithm = self.engine.algorithm = algorithm_for(self.cfg, self.model, trains=True)

    @property
    def lead(self) -> bool:
        return self.group is None or self.group.lead

    # -- fragment store ------------------------------------------------------------------------
    @endpoint(control=True)
    async def store_fragment(self, data: dict[str, Any]) -> None:
        """Keep a scored fragment's transitions until its rows are trained (replaces an older copy)."""
        frag = FragmentData.from_wire(decode_fragment(data))  # (packed for the link: transport.samples_compression)
        self.store[frag.key] = frag

    @endpoint(control=True)
    async def fetch_stored(self, batch: int, index: int) -> dict[str, Any]:
        """A stored fragment, for a trainer that trains rows of it.

        Raises:
            KeyError: the fragment is not stored here.
        """
        frag = self.store.get((batch, index))
        if frag is None:
            raise KeyError(f"{self.name} stores no fragment ({batch}, {index})")
        return frag.to_wire(with_latents=False)

    async def _stored(self, batch: int, index: int, where: str) -> FragmentData:
        frag = self.store.get((batch, index))
        if frag is None and where != self.name:
            frag = FragmentData.from_wire(await self.peers[where].fetch_stored.call(batch, index))
            self.store[frag.key] = frag
        if frag is None:
            raise StalenessViolation(f"{self.name}: fragment ({batch}, {index}) was never stored")
        return frag

    # -- training ------------------------------------------------------------------------------
    @endpoint
    @mirrored
    async def train(self, token: dict[str, Any], frags: list[dict[str, Any]]) -> dict[str, Any]:
        """Forward/backward over a TRAIN token's rows; gradients accumulate until ``optim``.

        ``frags[j]`` holds fragment j's ``adv`` and ``keep`` (per local sample) and ``store`` (who
        stores it). Returns the loss diagnostic sums, the rows covered and the measured span.

        Raises:
            StalenessViolation: a sample older than the staleness bound, or a fragment never stored.
        """
        t0 = time.time()
        b = token["batch"]
        data = [await self._stored(b, geo[0], info["store"]) for geo, info in zip(token["frags"], frags, strict=True)]
        for frag in data:
            if not 0 <= b - frag.version <= self.staleness:
                raise StalenessViolation(f"fragment {frag.key} generated with v{frag.version} trained into "
                                         f"v{b + 1}: staleness {b - frag.version} > {self.staleness}")
        sums, rows = await self._compute(self._train_compute, token, data, frags)
        return {"sums": sums, "rows": rows, "t0": t0, "t1": time.time(), "dropped": dropped_counts()}

    def _train_compute(self, token: dict[str, Any], data: list[FragmentData],
                       frags: list[dict[str, Any]]) -> tuple[list[dict[str, float]], list[list[int]]]:
        parts, offsets, conds, advs, rows = [], [], [], [], []
        offset = 0
        for (s, e), frag, info in zip(token["rows"], data, frags, strict=True):
            keep = torch.tensor(info["keep"], dtype=torch.bool)
            part = self.algorithm.token_rows(frag.transitions(), (s, e), keep, frag.geo[0], frag.sample_ids(),
                                             frag.version)
            rows.append([frag.geo[1], s, e, len(part) if part is not None else 0])
            if part is not None:
                parts.append(part)
                offsets.append(offset)
            conds.append(frag.cond)
            advs.append(torch.tensor(info["adv"], dtype=torch.float32))
            offset += frag.num_samples
        if not parts:
            return [], rows if self._reports_rows else []
        # The token's inputs arrived over the wire (on the host): placed on the model's device here, once.
        device = self.model.device
        batch = self.algorithm.cat_rows(parts, offsets).to(device)
        cond, adv = cond_to(cat_cond(conds), device), torch.cat(advs).to(device)
        sums = self._backward(batch, cond, adv, packed=token.get("packed", True))
        return host_sums(sums), rows if self._reports_rows else []

    @property
    def _reports_rows(self) -> bool:
        # Under FSDP every member runs every token (each its slice of the rows): the lead reports them, once.
        return self.shard != "fsdp" or self.lead

    def _backward(self, batch: Any, cond: dict[str, torch.Tensor], adv: torch.Tensor,
                  packed: bool = True) -> list[Sums]:
        """A token's forward/backward passes (and a stale batch's parity recompute) on the model's device."""
        on_policy = batch.policy_version == self.version
        # a mixture of experts: passes by expert, rows_by_expert counted
        plan = Backward("packed" if packed else "per_step", self.cfg.train.rows_per_pass or None,
                        experts=expert_splitter(self.model))
        if self.shard == "fsdp":
            assert self.group is not None
            plan.mode, plan.rank, plan.world = "sliced", self.group.rank, self.group.world_size
        sums = self.algorithm.backward(batch, cond, adv, plan, version=self.version)
        if not on_policy and self.cfg.train.check_parity:
            parity = self._behaviour_parity(batch, cond)  # (under FSDP a forward: every member runs it)
            sums += [parity] if self._reports_rows else []
        return sums

    def _behaviour_parity(self, batch: Any, cond: dict[str, torch.Tensor]) -> Sums:
        """Parity of a stale pass: a sample of its rows under the weights that sampled them (version - 1)."""
        behaviour = self._behaviour if self._behaviour is not None else self._previous
        if batch.policy_version != self.version - 1 or behaviour is None:
            return {"parity_rows": 0.0}
        current = trainable_state_dict(self.model)
        load_trainable_state_dict(self.model, behaviour)
        try:
            return self.algorithm.parity_recompute(batch, cond, PARITY_SAMPLE_ROWS)
        finally:
            load_trainable_state_dict(self.model, current)  # bit for bit: gradients and optimizer untouched

    @endpoint
    @mirrored
    async def optim(self, batch: int, total_rows: int, keep_previous: bool = False) -> dict[str, Any]:
        """The optimizer step of ``batch``: sum the group's gradients, divide by ``total_rows``, clip, step.

        Every member of the trainer group is called (they enter the gradient all-reduce together).
        ``keep_previous``: keep the weights from before the step, for the checkpoint that follows (a
        one-step-stale run resumes generating its next batch with them).

        Raises:
            FloatingPointError: a non-finite gradient norm (the step is refused).
            StalenessViolation: ``batch`` is not the batch this trainer's version trains into.
        """
        t0 = time.time()
        if batch != self.version:
            raise StalenessViolation(f"{self.name} at version {self.version} asked to step batch {batch}")
        grad_norm = await self._compute(self._optim_compute, total_rows, keep_previous)
        self.version = batch + 1
        terms = self._step_terms
        for key in [k for k in self.store if k[0] <= batch]:
            del self.store[key]
        for key in [k for k in self.engine.fragments if k[0] <= batch]:
            del self.engine.fragments[key]
        return {"grad_norm": grad_norm, "version": self.version, "terms": terms, "t0": t0, "t1": time.time()}

    def _optim_compute(self, total_rows: int, keep_previous: bool) -> float:
        # version - 1's sampling weights (DiffusionNFT: the old policy), for a stale checkpoint and parity
        self._previous = self.algorithm.sampling_state() if keep_previous else None
        keep_behaviour = self.cfg.train.check_parity and self.staleness > 0
        self._behaviour = (self._previous or self.algorithm.sampling_state()) if keep_behaviour else None
        grad_norm = self._step(total_rows)
        self._step_terms = self.algorithm.after_step(self.version + 1)  # the slow copies follow version + 1
        return grad_norm

    def _step(self, total_rows: int) -> float:
        if total_rows == 0:  # every group had identical rewards: nothing to learn from (as colocated)
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        divisor = float(total_rows)
        self.sync_sp_gradients(self.params)  # a sequence-parallel group's members: the SP=1 gradients
        if self.shard == "ddp":  # (with SP: over the members of this SP rank, one per trainer)
            all_reduce_buckets([p.grad for p in self.params], self.bucket_mb, group=self.dp_group)
        elif self.shard == "fsdp" and self.group is not None:  # reduce-scattered in backward, as a mean
            divisor /= self.group.world_size
        for p in self.params:
            p.grad.div_(divisor)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {float(grad_norm)}; refusing the optimizer step")
        set_lr(self.optimizer, self.cfg.train.lr, self.cfg.train.lr_warmup, self.version)  # version = steps done
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- weights -------------------------------------------------------------------------------
    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        """The trainable weights of ``version``: the current ones, or the kept previous ones.

        Under FSDP these are gathered, tensor by tensor (every member must call this together); only
        the lead keeps them (in host memory), the others get ``{}``.

        Raises:
            StalenessViolation: this trainer does not hold ``version``.
        """
        if version == self.version:
            # what rollouts sample with (DiffusionNFT: the old policy); under FSDP views of the shards, gathered below
            sd = self.algorithm.sampling_state(copy=self.shard != "fsdp")
        elif version == self.version - 1 and self._previous is not None:
            sd = self._previous
        else:
            raise StalenessViolation(f"{self.name} holds version {self.version}, asked to publish {version}")
        return gathered_state_dict(sd, keep=self.lead) if self.shard == "fsdp" else sd

    @endpoint
    async def publish(self, version: int, rollouts: list[str]) -> dict[str, Any]:
        """Send this trainer's weights, stamped ``version``, to ``rollouts`` (zmq lane).

        ``version`` is the trainer's, or the one before right after a one-step-stale resume. Under
        FSDP every member is called (the others only help gather, with no ``rollouts``).
        Returns the span, the bytes sent per receiver and ``failed``: receivers found dead (with
        transport.weights_compression also ``compression``: :meth:`_publish_deltas`).

        Raises:
            StalenessViolation: this trainer does not hold ``version``.
        """
        t0 = time.time()
        sd = await self._compute(self._weights, version) if self.shard == "fsdp" else self._weights(version)
        keep = self._kept is not None and self.lead
        if not rollouts and not keep:
            return {"t0": t0, "t1": time.time(), "bytes": 0, "failed": []}
        layout, buckets = pack_buckets(sd, self.bucket_mb)
        if self._deltas is not None:
            return {"t0": t0, **await self._publish_deltas(version, layout, buckets, rollouts, keep)}
        if keep:
            self._keep(version, layout, buckets)
        failed = await self._send_weights(version, layout, buckets, rollouts)
        return {"t0": t0, "t1": time.time(), "bytes": sum(b.numel() * b.element_size() for b in buckets),
                "failed": failed}

    def _keep(self, version: int, layout: list[list[Any]], buckets: list[torch.Tensor]) -> None:
        assert self._kept is not None
        self._kept[version] = (layout, buckets)
        for old in sorted(self._kept)[:-2]:
            del self._kept[old]

    async def _publish_deltas(self, version: int, layout: list[list[Any]], buckets: list[torch.Tensor],
                              rollouts: list[str], keep: bool) -> dict[str, Any]:
        """``version`` as a delta against what the rollout actors hold (the view); in full to anyone else.

        Returns ``bytes`` (per receiver of the delta), ``failed`` and ``compression``: the publication's stats
        (its method, bytes, the uncompressed bytes, the receivers' max-abs / relative error, the view's digest).
        """
        assert self._deltas is not None
        pub = await self._compute(self._deltas.plan, version, layout, buckets, rollouts)
        if keep:
            self._keep(version, layout, pub.view)  # a newcomer gets what the others hold
        failed = await self._send_weights(version, layout, pub.view, pub.full_to)
        if pub.delta is not None:
            failed += await self._send_weights(version, layout, pub.delta, pub.delta_to, base=pub.base)
        self._deltas.delivered(pub, failed)
        return {"t1": time.time(), "bytes": pub.stats["bytes"], "failed": failed, "compression": pub.stats}

    async def _send_weights(self, version: int, layout: list[list[Any]], buckets: list[Any],
                            rollouts: list[str], base: int | None = None) -> list[str]:
        """zmq lane: ``version`` to each of ``rollouts`` (with ``base``: ``buckets`` is a delta against that version,
        which they hold); returns those found dead."""
        results = await asyncio.gather(*(self.peers[r].receive_weights.call(version, layout, buckets) if base is None
                                         else self.peers[r].receive_weights_delta.call(version, base, layout, buckets)
                                         for r in rollouts), return_exceptions=True)
        # A receiver that died is the coordinator's business (it re-plans); any other failure is a bug.
        failed = [r for r, res in zip(rollouts, results, strict=True) if isinstance(res, ActorDied)]
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, ActorDied):
                raise res
        return failed

    @endpoint
    async def admit(self, rollouts: list[str], newcomers: list[str]) -> dict[str, Any]:
        """Hand rollout actors that joined the running run the newest published versions (two: for staleness 1).

        ``rollouts``: every live rollout actor, ``newcomers`` included. zmq lane: the kept versions go to
        the newcomers; gloo / nccl: the weight group re-forms with ``rollouts`` and replays them.
        Returns the versions handed over (oldest first), the generation (-1 on zmq), ``failed``
        (receivers found dead) and the span.

        Raises:
            ConfigError: nothing to hand over (the run does not keep versions: placement.max_rollout).
        """
        t0 = time.time()
        lane = self.cfg.transport.weights
        if lane in ("gloo", "nccl"):
            if self._publisher is None:
                raise ConfigError("admit: no version was published over the weight group yet")
            out = await self._publisher.admit({r: self.peers[r] for r in rollouts})
            return {**out, "versions": sorted(self._publisher.recent), "t0": t0, "t1": time.time()}
        if not self._kept:
            raise ConfigError("admit: this trainer keeps no published versions; rollout actors may join a running "
                              "run only when placement.max_rollout > placement.rollout")
        failed: list[str] = []
        for version in sorted(self._kept):
            failed += await self._send_weights(version, *self._kept[version], [n for n in newcomers if n not in failed])
        if self._deltas is not None:  # they hold the view now: the next delta reaches them too
            self._deltas.admitted([n for n in newcomers if n not in failed])
        return {"versions": sorted(self._kept), "generation": -1, "failed": failed, "t0": t0, "t1": time.time()}

    @endpoint
    async def publish_comm(self, version: int, rollouts: list[str]) -> dict[str, Any]:
        """Broadcast this trainer's weights, stamped ``version``, over the communicator lane (``gloo`` / ``nccl``).

        The first call, and every call whose ``rollouts`` differ from the group's members (a death,
        a newcomer), forms a new generation of the group first; a newcomer receives the newest
        versions then. Returns the span, the bytes, the generation and ``failed`` (receivers found dead).

        Raises:
            StalenessViolation: this trainer does not hold ``version``.
            TransportBroken: the broadcast failed without a receiver dying (a timeout).
        """
        t0 = time.time()
        sd = await self._compute(self._weights, version) if self.shard == "fsdp" else self._weights(version)
        if self._publisher is None:
            from digenrl.roles.weights import CommPublisher

            lane, device = self.cfg.transport.weights, self.cfg.model.device
            self._publisher = CommPublisher(lane, self._host(), self.bucket_mb, self.cfg.train.group_timeout,
                                            device=device if lane == "nccl" else None)
        out = await self._publisher.publish(version, sd, {r: self.peers[r] for r in rollouts})
        return {**out, "t0": t0, "t1": time.time()}

    @endpoint(control=True)
    async def weights_info(self) -> dict[str, Any]:
        """The version held, the digest of its trainable weights (under FSDP: of this member's shards) and, with
        transport.weights_compression, the stats of the latest publications (``DeltaChain.log``)."""
        return {"version": self.version, "digest": self._digest(),
                "publications": list(self._deltas.log) if self._deltas is not None else []}

    def _digest(self) -> str:
        from torch.distributed.tensor import DTensor

        sd = trainable_state_dict(self.model, copy_tensors=False)
        return state_digest({k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()})

    @endpoint
    @mirrored
    async def probe_velocity(self, seed: int = 0) -> torch.Tensor:
        """The velocity at this trainer's weights on the rollout actors' probe input.

        Raises:
            ConfigError: under FSDP (a forward there is a collective of the whole group).
        """
        if self.shard == "fsdp":
            raise ConfigError("probe_velocity: not available under train.shard = 'fsdp'; probe a rollout actor")
        return await self._compute(probe_velocity, self.engine, seed)

    @endpoint
    @mirrored
    async def sample_evaluation(self, version: int, prompts: list[str]) -> dict[str, Any]:
        """The fixed evaluation's clean latents of ``prompts`` at this trainer's weights, which must be ``version``
        (:func:`digenrl.roles.evaluation.sample_evaluation`; LoRA merged and restored bit for bit, no gradients,
        no global RNG: training is unchanged). On the compute thread, between this trainer's tokens; on the host.

        Raises:
            ConfigError: under FSDP (a forward there is a collective of the whole group).
            StalenessViolation: this trainer holds another version.
        """
        if self.shard == "fsdp":
            raise ConfigError("sample_evaluation: not available under train.shard = 'fsdp'")
        t0 = time.time()
        latents = await self._compute(self._sample_evaluation, version, prompts)
        return {"latents": latents, "t0": t0, "t1": time.time()}

    def _sample_evaluation(self, version: int, prompts: list[str]) -> torch.Tensor:
        from digenrl.roles.evaluation import sample_evaluation

        if version != self.version:  # checked on the compute thread: only an optimizer step there moves it
            raise StalenessViolation(f"{self.name} holds version {self.version}; the evaluation asked for {version}")
        return sample_evaluation(self.model, self.cfg, prompts).cpu()

    # -- TAG: rollout / reward / take_fragment endpoints come from GenerationMixin -------------------

    # -- checkpoints -----------------------------------------------------------------------------
    @endpoint
    async def save_state(self, directory: str) -> list[str]:
        """Write trainable weights (safetensors) and optimizer state into ``directory``; returns the files.

        Every member of the trainer group is called; the lead writes (under FSDP the others help
        gather weights and optimizer state, under DDP they hold the same and return at once).
        After an optimizer step that kept the previous weights, they go to ``previous.safetensors``.
        """
        if not self.lead and self.shard != "fsdp":
            return []
        return await self._compute(self._save, Path(directory))

    def _save(self, d: Path) -> list[str]:
        from safetensors.torch import save_file

        meta = {"digenrl_mode": str(trainable_mode(self.model)), "model": str(self.model.name)}
        weights = self._gathered(trainable_state_dict(self.model, copy_tensors=self.shard != "fsdp"))
        # the algorithm's slow copies (DiffusionNFT's old policy: old.safetensors), gathered like the weights
        extra = {stem: self._gathered(sd) for stem, sd in self.algorithm.extra_state().items()}
        optim = self._optimizer_state()
        previous = self._weights(self.version - 1) if self._previous is not None else None
        if not self.lead:
            return []
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "trainable.safetensors"), metadata=meta)
        torch.save(optim, d / "optimizer.pt")
        files = [str(d / "trainable.safetensors"), str(d / "optimizer.pt")]
        for stem, sd in extra.items():
            save_file({k: v.contiguous() for k, v in sd.items()}, str(d / f"{stem}.safetensors"))
            files.append(str(d / f"{stem}.safetensors"))
        if previous is not None:
            save_file({k: v.contiguous() for k, v in previous.items()}, str(d / PREVIOUS_WEIGHTS))
            files.append(str(d / PREVIOUS_WEIGHTS))
        return files

    def _gathered(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors of ``sd`` (under FSDP gathered, on the lead only; every member calls this together)."""
        return gathered_state_dict(sd, keep=self.lead) if self.shard == "fsdp" else sd

    def _optimizer_state(self) -> dict[str, Any]:
        if self.shard != "fsdp":
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # Gathered to the lead's host memory (keyed by parameter name), as one full-model optimizer.
        return get_optimizer_state_dict(self.model.transformer, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @endpoint
    @mirrored
    async def load_state(self, directory: str, version: int) -> str:
        """Restore weights and optimizer from a checkpoint directory; returns the weights' digest.

        Every member of the trainer group loads the same checkpoint (under FSDP, its shards of it).
        """
        return await self._compute(self._load, Path(directory), version)

    def _load(self, d: Path, version: int) -> str:
        from safetensors.torch import load_file

        load_trainable(self.model, d / "trainable.safetensors")
        # Local file written by this program (never network data); weights_only refuses arbitrary objects.
        # Read to the host: a checkpoint written on a GPU resumes anywhere; loading moves the optimizer
        # state to each parameter's device.
        optim = torch.load(d / "optimizer.pt", weights_only=True, map_location="cpu")
        if self.shard == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model.transformer, self.optimizer, optim,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(optim)
        self.version = version
        self._previous = None
        if (d / PREVIOUS_WEIGHTS).is_file():
            try:
                previous = load_file(str(d / PREVIOUS_WEIGHTS))
            except Exception as exc:  # safetensors raises its own error types for a truncated or garbled file
                raise ConfigError(f"{d / PREVIOUS_WEIGHTS}: not a readable safetensors file ({exc})") from exc
            own = trainable_state_dict(self.model, copy_tensors=False)
            if previous.keys() != own.keys() or any(previous[k].shape != own[k].shape for k in own):
                raise ConfigError(f"{d / PREVIOUS_WEIGHTS}: its tensors do not match this model's trainable weights")
            self._previous = previous
        self.algorithm.load_extra_files(d)  # the algorithm's slow copies (DiffusionNFT's old policy)
        return self._digest()
