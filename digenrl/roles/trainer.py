"""``TrainerActor``: TSP-packed training tokens, gradient accumulation, optimizer steps, weight publication.

Data path: a REWARD token's executor hands each scored fragment's transitions to one trainer's
fragment store (``store_fragment``, a control endpoint, so it lands while this trainer computes).
A TRAIN token then takes rows ``[s, e)`` of its fragments from the local store, or pulls them from
the storing trainer (``fetch_stored``), and runs one forward/backward per ``rows_per_pass`` rows
(TSP; ``packed=False`` runs Flow-GRPO's per-timestep loop instead). Losses are *sums* over rows;
``optim`` divides the accumulated gradients by the batch's total trained rows, so any split of a
batch into tokens (GAP) gives the one-shot mean-loss gradient up to float rounding.

With several trainers, ``optim`` is a two-phase all-reduce over the actor transport: the coordinator
calls ``snapshot_grads`` on every member, then ``optim`` on every member, which sums the peers'
snapshots and steps identically. The lead trainer publishes new versions (``publish``). With TAG a
trainer also runs ROLLOUT/REWARD tokens, at its own (newest) version only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

import torch

from digenrl.actors.base import Actor, endpoint
from digenrl.config import config_from_dict
from digenrl.errors import ActorDied, ConfigError, StalenessViolation
from digenrl.models import cat_cond, reference
from digenrl.models.lora import load_trainable, load_trainable_state_dict, save_trainable, trainable_state_dict
from digenrl.policy import build_model
from digenrl.rl.loss import LossConfig
from digenrl.rl.rollout import TransitionBatch
from digenrl.rl.tsp import packed_backward, parity_recompute, per_step_backward
from digenrl.roles.fragments import FragmentData, FragmentEngine, probe_velocity
from digenrl.roles.rollout import GenerationMixin, limit_threads
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

    def __init__(self, config: dict[str, Any], threads: int = 1, staleness: int = 0, bucket_mb: float = 64.0) -> None:
        self.config = config
        self.threads = threads
        self.staleness = staleness
        self.bucket_mb = bucket_mb
        self.peers = {}

    async def setup(self) -> None:
        from digenrl.rewards import build_reward

        limit_threads(self.threads)
        self.cfg = cfg = config_from_dict(self.config)
        self.name = self.ref.name
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"digenrl-{self.name}")
        torch.manual_seed(cfg.log.seed)
        self.model, self.params = await self._compute(build_model, cfg)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.betas[0], t.betas[1]),
                                           weight_decay=t.weight_decay, eps=t.eps)
        self.loss_cfg = LossConfig(clip_range=t.clip_range, kl_beta=t.kl_beta, kl_kind=t.kl)  # type: ignore[arg-type]
        r = cfg.reward
        reward = build_reward(r.weights, url=r.url or None, timeout=r.timeout, retries=r.retries,
                              image_format=r.image_format, on_error=r.on_error, penalty=r.penalty)
        self.engine = FragmentEngine(cfg, self.model, reward)
        self.store: dict[tuple[int, int], FragmentData] = {}
        self.version = 0
        self._previous: dict[str, torch.Tensor] | None = None  # version - 1's weights, for a stale checkpoint
        self._behaviour: dict[str, torch.Tensor] | None = None  # version - 1's weights, for train.check_parity
        self._snapshot: list[torch.Tensor] = []
        self._lane: Any = None

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if getattr(self, "_lane", None) is not None:
            self._lane.close()
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)

    def _use_version(self, version: int) -> None:
        if version != self.version:
            raise StalenessViolation(f"{self.name} holds version {self.version}; a TAG token asked for {version}")

    # -- wiring --------------------------------------------------------------------------------
    @endpoint
    async def connect(self, peers: dict[str, Any], version: int = 0, dist: dict[str, Any] | None = None) -> str:
        """Learn the peers' refs and the starting version (and join the torch.distributed lane)."""
        self.peers = dict(peers)
        self.version = version
        if dist is not None:
            from digenrl.roles.weights import DistLane

            self._lane = await self._compute(lambda: DistLane(dist["rank"], dist["world_size"], dist["init_method"]))
        return self.name

    # -- fragment store ------------------------------------------------------------------------
    @endpoint(control=True)
    async def store_fragment(self, data: dict[str, Any]) -> None:
        """Keep a scored fragment's transitions until its rows are trained (replaces an older copy)."""
        frag = FragmentData.from_wire(data)
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
        return {"sums": sums, "rows": rows, "t0": t0, "t1": time.time()}

    def _train_compute(self, token: dict[str, Any], data: list[FragmentData],
                       frags: list[dict[str, Any]]) -> tuple[list[dict[str, float]], list[list[int]]]:
        parts, offsets, conds, advs, rows = [], [], [], [], []
        offset = 0
        for (s, e), frag, info in zip(token["rows"], data, frags, strict=True):
            t = frag.transitions()
            keep = torch.tensor(info["keep"], dtype=torch.bool)
            sel = torch.arange(s, e)
            sel = sel[keep[t["sample"][s:e]]]
            rows.append([frag.geo[1], s, e, int(sel.numel())])
            if sel.numel():
                parts.append(TransitionBatch(**{k: t[k][sel] for k in t}, kind=self.cfg.rollout.sde,  # type: ignore[arg-type]
                                             policy_version=frag.version))
                offsets.append(offset)
            conds.append(frag.cond)
            advs.append(torch.tensor(info["adv"], dtype=torch.float32))
            offset += frag.num_samples
        if not parts:
            return [], rows
        batch = TransitionBatch.cat(parts, offsets)
        cond, adv = cat_cond(conds), torch.cat(advs)
        ref = self._ref_velocity if self.loss_cfg.kl_beta > 0 else None
        on_policy = batch.policy_version == self.version  # then the training forward also measures parity
        if token.get("packed", True):
            per = self.cfg.train.rows_per_pass or None
            sums = packed_backward(self.model.velocity, batch, cond, adv, self.loss_cfg, rows_per_pass=per,
                                   normalizer=1.0, ref_velocity=ref, parity=on_policy)
        else:
            sums = per_step_backward(self.model.velocity, batch, cond, adv, self.loss_cfg, normalizer=1.0,
                                     ref_velocity=ref, parity=on_policy)
        if not on_policy and self.cfg.train.check_parity:
            sums.append(self._behaviour_parity(batch, cond))
        return sums, rows

    def _behaviour_parity(self, batch: TransitionBatch, cond: dict[str, torch.Tensor]) -> dict[str, float]:
        """Parity of a stale pass: a sample of its rows under the weights that sampled them (version - 1)."""
        behaviour = self._behaviour if self._behaviour is not None else self._previous
        if batch.policy_version != self.version - 1 or behaviour is None:
            return {"parity_rows": 0.0}
        current = trainable_state_dict(self.model)
        load_trainable_state_dict(self.model, behaviour)
        try:
            return parity_recompute(self.model.velocity, batch, cond, PARITY_SAMPLE_ROWS)
        finally:
            load_trainable_state_dict(self.model, current)  # bit for bit: gradients and optimizer untouched

    def _ref_velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        with reference(self.model):
            return self.model.velocity(x, sigma, cond)

    @endpoint
    async def snapshot_grads(self) -> None:
        """Phase 1 of a multi-trainer optimizer step: freeze this trainer's accumulated gradients."""
        self._snapshot = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    @endpoint(control=True)
    async def grad_snapshot(self) -> list[torch.Tensor]:
        """This trainer's frozen gradients (phase 1 output), for its peers."""
        return self._snapshot

    @endpoint
    async def optim(self, batch: int, total_rows: int, group: list[str], keep_previous: bool = False) -> dict[str, Any]:
        """The optimizer step of ``batch``: sum the group's gradients, divide by ``total_rows``, clip, step.

        ``keep_previous``: keep the weights from before the step, for the checkpoint that follows (a
        one-step-stale run resumes generating its next batch with them).

        Raises:
            FloatingPointError: a non-finite gradient norm (the step is refused).
            StalenessViolation: ``batch`` is not the batch this trainer's version trains into.
        """
        t0 = time.time()
        if batch != self.version:
            raise StalenessViolation(f"{self.name} at version {self.version} asked to step batch {batch}")
        peers = [n for n in group if n != self.name]
        others = [await self.peers[n].grad_snapshot.call() for n in peers]
        grad_norm = await self._compute(self._optim_compute, total_rows, others, keep_previous)
        self.version = batch + 1
        for key in [k for k in self.store if k[0] <= batch]:
            del self.store[key]
        for key in [k for k in self.engine.fragments if k[0] <= batch]:
            del self.engine.fragments[key]
        return {"grad_norm": grad_norm, "version": self.version, "t0": t0, "t1": time.time()}

    def _optim_compute(self, total_rows: int, others: list[list[torch.Tensor]], keep_previous: bool) -> float:
        self._previous = trainable_state_dict(self.model) if keep_previous else None
        keep_behaviour = self.cfg.train.check_parity and self.staleness > 0
        self._behaviour = (self._previous or trainable_state_dict(self.model)) if keep_behaviour else None
        if total_rows == 0:  # every group had identical rewards: nothing to learn from (as colocated)
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        for i, p in enumerate(self.params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            for other in others:
                g = g + other[i]
            p.grad = g / total_rows
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {float(grad_norm)}; refusing the optimizer step")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- weights -------------------------------------------------------------------------------
    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        """The trainable weights of ``version``: the current ones, or the kept previous ones.

        Raises:
            StalenessViolation: this trainer does not hold ``version``.
        """
        if version == self.version:
            return trainable_state_dict(self.model)
        if version == self.version - 1 and self._previous is not None:
            return self._previous
        raise StalenessViolation(f"{self.name} holds version {self.version}, asked to publish {version}")

    @endpoint
    async def publish(self, version: int, rollouts: list[str]) -> dict[str, Any]:
        """Send this trainer's weights, stamped ``version``, to ``rollouts`` (zmq lane).

        ``version`` is the trainer's, or the one before right after a one-step-stale resume.
        Returns the span, the bytes sent per receiver and ``failed``: receivers found dead.

        Raises:
            StalenessViolation: this trainer does not hold ``version``.
        """
        t0 = time.time()
        layout, buckets = pack_buckets(self._weights(version), self.bucket_mb)
        results = await asyncio.gather(*(self.peers[r].receive_weights.call(version, layout, buckets) for r in rollouts),
                                       return_exceptions=True)
        # A receiver that died is the coordinator's business (it re-plans); any other failure is a bug.
        failed = [r for r, res in zip(rollouts, results, strict=True) if isinstance(res, ActorDied)]
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, ActorDied):
                raise res
        return {"t0": t0, "t1": time.time(), "bytes": sum(b.numel() * b.element_size() for b in buckets),
                "failed": failed}

    @endpoint
    async def publish_dist(self, version: int) -> dict[str, Any]:
        """Source side of the torch.distributed broadcast of ``version`` (receivers enter it too)."""
        t0 = time.time()
        sd = self._weights(version)
        await self._compute(self._lane.broadcast, sd, self.bucket_mb)
        return {"t0": t0, "t1": time.time(), "bytes": sum(t.numel() * t.element_size() for t in sd.values())}

    @endpoint(control=True)
    async def weights_info(self) -> dict[str, Any]:
        """The version held and the digest of its trainable weights."""
        return {"version": self.version, "digest": state_digest(trainable_state_dict(self.model, copy_tensors=False))}

    @endpoint
    async def probe_velocity(self, seed: int = 0) -> torch.Tensor:
        """The velocity at this trainer's weights on the rollout actors' probe input."""
        return await self._compute(probe_velocity, self.engine, seed)

    # -- TAG: rollout / reward / take_fragment endpoints come from GenerationMixin -------------------

    # -- checkpoints -----------------------------------------------------------------------------
    @endpoint
    async def save_state(self, directory: str) -> list[str]:
        """Write trainable weights (safetensors) and optimizer state into ``directory``; returns the files.

        After an optimizer step that kept the previous weights, they go to ``previous.safetensors``.
        """
        return await self._compute(self._save, Path(directory))

    def _save(self, d: Path) -> list[str]:
        from safetensors.torch import save_file

        save_trainable(self.model, d / "trainable.safetensors")
        torch.save(self.optimizer.state_dict(), d / "optimizer.pt")
        files = [str(d / "trainable.safetensors"), str(d / "optimizer.pt")]
        if self._previous is not None:
            save_file({k: v.contiguous() for k, v in self._previous.items()}, str(d / PREVIOUS_WEIGHTS))
            files.append(str(d / PREVIOUS_WEIGHTS))
        return files

    @endpoint
    async def load_state(self, directory: str, version: int) -> str:
        """Restore weights and optimizer from a checkpoint directory; returns the weights' digest."""
        return await self._compute(self._load, Path(directory), version)

    def _load(self, d: Path, version: int) -> str:
        from safetensors.torch import load_file

        load_trainable(self.model, d / "trainable.safetensors")
        # Local file written by this program (never network data); weights_only refuses arbitrary objects.
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
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
        return state_digest(trainable_state_dict(self.model, copy_tensors=False))
