"""``RolloutActor`` and the token endpoints of every actor that generates or scores.

A ROLLOUT token names each fragment's ``source``: ``""`` starts it from noise, this actor continues
it, another actor hands it over (``take_fragment``, a control endpoint, so the holder answers even
while it computes). The fragments themselves and their numbers: :mod:`digenrl.roles.fragments`.

A REWARD token decodes and scores finished fragments and hands their transitions to the trainer-side
fragment store named by the coordinator (``store_fragment`` on a trainer) before it reports done: a
scored fragment is durable (the schedule's contract) even if this actor dies afterwards.

:class:`GenerationMixin` holds these endpoints once for the rollout actor, the reward actor and the
trainer (which generates when TAG asks it to). Role actors hold no schedule logic: they run the
tokens they are handed and return measured spans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from digenrl.actors import dropped_counts
from digenrl.actors.base import Actor, ActorRef, endpoint
from digenrl.config import Config, config_from_dict
from digenrl.errors import ActorDied, RemoteError, StalenessViolation
from digenrl.models import GeneratorModel
from digenrl.policy import build_model, prepare_for_generation
from digenrl.roles.compress import encode_fragment, rebuild
from digenrl.roles.fragments import FragmentData, FragmentEngine, probe_velocity
from digenrl.roles.sp_group import SequenceParallel, mirrored
from digenrl.roles.weights import CommReceiver, WeightStore, pack_buckets, unpack_buckets
from digenrl.telemetry.memory import peak_memory

__all__ = ["GenerationMixin", "RolloutActor", "limit_threads", "reward_builder"]

log = logging.getLogger(__name__)


def limit_threads(threads: int) -> None:
    """Give this actor process ``threads`` intra-op torch threads and one inter-op thread.

    Actors share the host's cores with each other: a second inter-op pool (or OpenMP's default of
    one thread per core) would oversubscribe them. Inter-op threads can only be set before torch's
    first parallel region; an in-process actor (tests) finds it already started and keeps it.
    """
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # parallel work already ran in this process (in-process actors)
        pass


def reward_builder(cfg: Config) -> Callable[[], Any]:
    """Builds ``cfg``'s reward (on the caller's thread: a learned reward loads its model there)."""
    from digenrl.rewards import build_reward

    r = cfg.reward
    return lambda: build_reward(r.weights, **r.build_options(cfg.model.device))


def parse_sources(token: dict[str, Any]) -> list[tuple[list[int], str]]:
    """``(geo, source)`` per fragment of a wire token."""
    b = token["batch"]
    return [([b, *geo], src) for geo, src in zip(token["frags"], token["sources"] or [""] * len(token["frags"]),
                                                 strict=True)]


class GenerationMixin(SequenceParallel):
    """ROLLOUT and REWARD token execution shared by rollout actors and (TAG) trainers (each may be a
    sequence-parallel group: :mod:`digenrl.roles.sp_group`)."""

    name: str
    config: dict[str, Any]
    threads: int
    cfg: Config
    engine: FragmentEngine
    peers: dict[str, ActorRef[Any]]
    pool: concurrent.futures.ThreadPoolExecutor
    samples_cross_link = True  # its scored fragments cross the link to the trainers (a TAG trainer's stay local)

    # Token endpoints shared by every generating or scoring actor (rollout, reward, trainer via TAG).
    @endpoint
    @mirrored
    async def rollout(self, token: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
        """Run a ROLLOUT token (denoising steps of its fragments); returns the measured span."""
        return {**await self._run_rollout(token, prompts), "dropped": dropped_counts()}

    @endpoint
    async def reward(self, token: dict[str, Any], prompts: list[str], store: str, images: bool = False) -> dict[str, Any]:
        """Run a REWARD token: take, decode, score, hand transitions to trainer ``store``; returns rewards."""
        return {**await self._run_reward(token, prompts, store, images), "dropped": dropped_counts()}

    @endpoint
    async def score_evaluation(self, latents: torch.Tensor, prompts: list[str], version: int) -> dict[str, Any]:
        """Decode and score the fixed evaluation's clean latents (``digenrl.roles.evaluation``; sampled by the lead
        trainer) with this actor's VAE and reward, on its compute thread between its tokens; returns the
        :class:`~digenrl.roles.evaluation.Evaluation` on the wire (uint8 pixels on the host)."""
        from digenrl.roles.evaluation import score_evaluation

        t0 = time.time()
        engine = self.engine
        ev = await self._compute(lambda: score_evaluation(engine.model, engine.cfg, latents.to(engine.device),
                                                          prompts, engine.reward, version))
        return {**ev.to_wire(), "t0": t0, "t1": time.time()}

    @endpoint(control=True)
    async def meet(self, peers: dict[str, Any]) -> list[str]:
        """Learn the refs of actors added to the running run (a rollout actor that joined); returns the names known."""
        self.peers.update(peers)
        return sorted(self.peers)

    @endpoint(control=True)
    async def memory_peak(self) -> dict[str, Any]:
        """This process's peak memory so far (:func:`~digenrl.telemetry.memory.peak_memory` on its model's device)."""
        return peak_memory(str(self.cfg.model.device))

    @endpoint(control=True)
    async def take_fragment(self, batch: int, index: int) -> dict[str, Any]:
        """Hand fragment ``(batch, index)`` over to the caller (it is no longer held here).

        Raises:
            KeyError: the fragment is not held here.
        """
        frag = self.engine.fragments.pop((batch, index), None)
        if frag is None:
            raise KeyError(f"{self.name} holds no fragment ({batch}, {index})")
        self.sp_tell_drop([(batch, index)])
        return frag.to_wire()

    async def _setup_frozen_engine(self, scores: bool) -> GeneratorModel:
        """Threads, config, compute thread, reward and a frozen policy copy: the setup of actors that
        generate or score but never train (``self.config``, ``self.threads`` and ``self.ref`` set).

        ``scores``: this actor scores every fragment it finishes (a reward actor; a rollout actor when there
        is none), so its reward is built now; otherwise at first use (only once every reward actor died).
        """
        limit_threads(self.threads)
        self.cfg = config_from_dict(self.config)
        self.name = self.ref.name  # type: ignore[attr-defined]  # the Actor this mixes into
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"digenrl-{self.name}")
        make = reward_builder(self.cfg)
        # On the compute thread: a learned reward loads its model there, and the event loop keeps serving.
        reward = await self._compute(make) if scores else None
        model, _ = await self._compute(build_model, self.cfg)
        model.transformer.requires_grad_(False)
        prepare_for_generation(model, self.cfg)
        self.engine = FragmentEngine(self.cfg, model, reward, make_reward=make)
        return model

    async def _compute(self, fn: Any, *args: Any) -> Any:
        # One dedicated thread per actor: torch's thread-local state stays put and the event loop
        # keeps serving heartbeats and control endpoints (weights, hand-overs) meanwhile.
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _obtain(self, geo: list[int], source: str, version: int, prompts: list[str], step: int,
                      compute_fresh: bool = True) -> FragmentData:
        key = (geo[0], geo[1])
        if source == "":
            return await self._compute(self.engine.fresh, geo, version, prompts)
        if source == self.name or (self.sp is not None and source == self.sp.leader):
            frag = self.engine.fragments.pop(key, None)
            if frag is not None:
                return frag
            raise StalenessViolation(f"{self.name}: fragment {key} is not held here")
        if self.sp_follows:  # the leader takes it from its holder for the whole group (or recomputes it)
            data = await self.sp_taken(key)
            if data is not None:
                return FragmentData.from_wire(data).to(self.engine.device)
            return await self._compute(self._recompute, geo, version, prompts, step)
        try:
            data = await self.peers[source].take_fragment.call(key[0], key[1])
            if compute_fresh:  # a ROLLOUT token's: the group's members compute with it
                self.sp_hand(key, data)
            # The one place a generating actor receives tensors: from the wire's host copy to its device.
            return FragmentData.from_wire(data).to(self.engine.device)
        except (ActorDied, RemoteError, KeyError) as exc:
            if not compute_fresh:
                raise
            self.sp_hand(key, None)
            log.warning("%s: could not take fragment %s from %s (%s); recomputing it from noise", self.name, key,
                        source, exc)
            return await self._compute(self._recompute, geo, version, prompts, step)

    def _recompute(self, geo: list[int], version: int, prompts: list[str], step: int) -> FragmentData:
        # With the token's version: the model may hold another (under async1, the newer one of the next batch).
        self._use_version(version)
        return self.engine.recompute(geo, version, prompts, step)

    async def _run_rollout(self, token: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
        t0 = time.time()
        version, start, stop = token["version"], token["start"], token["end"]
        frags = [await self._obtain(geo, src, version, prompts, start) for geo, src in parse_sources(token)]
        for frag in frags:
            if frag.version != version or frag.step != start:
                raise StalenessViolation(f"{self.name}: fragment {frag.key} is at v{frag.version} step {frag.step}, "
                                         f"token wants v{version} step {start}")
        t1 = time.time()
        await self._compute(self._rollout_compute, frags, version, start, stop)
        for frag in frags:
            self.engine.fragments[frag.key] = frag
        return {"t0": t0, "t1": time.time(), "compute_s": time.time() - t1}

    def _rollout_compute(self, frags: list[FragmentData], version: int, start: int, stop: int) -> None:
        self._use_version(version)
        self.engine.advance(frags, start, stop)

    def _use_version(self, version: int) -> None:
        raise NotImplementedError

    @property
    def _samples_codec(self) -> str:
        return self.cfg.transport.samples_codec if self.samples_cross_link else "none"

    async def _run_reward(self, token: dict[str, Any], prompts: list[str], store: str,
                          images: bool) -> dict[str, Any]:
        t0 = time.time()
        out: dict[str, Any] = {"rewards": [], "components": [], "failed": 0, "decode_s": 0.0, "images": [], "error": ""}
        for geo, src in parse_sources(token):
            frag = await self._obtain(geo, src or self.name, token["version"], prompts, 0, compute_fresh=False)
            if frag.step != self.engine.cfg.rollout.num_steps:
                raise StalenessViolation(f"{self.name}: fragment {frag.key} scored at step {frag.step}")
            scored = await self._compute(self.engine.score, frag, prompts)
            self.sp_tell_drop([frag.key])  # (scored here alone: the members' copies go)
            # (transport.samples_compression: packed for the link to the trainers, roles/compress.py)
            await self.peers[store].store_fragment.call(encode_fragment(frag.to_wire(with_latents=False),
                                                                        self._samples_codec))
            out["rewards"].append(scored.rewards)
            out["components"].append(scored.components)
            out["failed"] += scored.failed
            out["error"] = scored.error or out["error"]
            out["decode_s"] += scored.decode_s
            if images:
                out["images"].append(scored.images)
        out.update(t0=t0, t1=time.time())
        return out


class RolloutActor(GenerationMixin, Actor):
    """Generates and scores fragments at the policy versions the coordinator's tokens require.

    Args:
        config: the run config as a plain dict (``Config.to_dict()``).
        threads: torch threads of this process.
    """

    def __init__(self, config: dict[str, Any], threads: int = 1) -> None:
        self.config = config
        self.threads = threads
        self.peers = {}

    async def setup(self) -> None:
        # Without reward actors the rollout actor scores the fragments it finishes.
        model = await self._setup_frozen_engine(scores=not self.config["placement"]["reward"])
        self.weights = WeightStore(model, version=-1)
        # The gloo / nccl weight lane (idle on the zmq lane); NCCL buffers live on the model's device.
        self._lane = CommReceiver(self.weights, self.cfg.model.device if self.cfg.transport.weights == "nccl" else None)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if getattr(self, "_lane", None) is not None:
            self._lane.close()
        if exc is None:
            self.close_sp()  # (after a member died a collective may hang: the process just exits)
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)

    def _use_version(self, version: int) -> None:
        self.weights.ensure(version)

    @endpoint
    async def connect(self, peers: dict[str, Any]) -> str:
        """Learn the other actors' refs."""
        self.peers = dict(peers)
        return self.name

    @endpoint(control=True)
    @mirrored
    async def receive_weights(self, version: int, layout: list[Any], buckets: list[Any]) -> int:
        """Stage ``version`` (used from the next token that asks for it); returns the version."""
        self.weights.stage(version, unpack_buckets(layout, buckets))
        return version

    @endpoint(control=True)
    @mirrored
    async def receive_weights_delta(self, version: int, base: int, layout: list[Any], delta: list[Any]) -> int:
        """Stage ``version`` = the held ``base`` + ``delta`` (transport.weights_compression: roles/compress.py);
        returns the version.

        Raises:
            StalenessViolation: ``base`` is not held here (the trainer sends such an actor the full weights).
            ProtocolError: the delta does not fit ``base``.
        """
        base_sd = self.weights.held(base)
        # off the event loop (a full model's delta is seconds of work); publications arrive one at a time
        self.weights.stage(version, await asyncio.to_thread(rebuild, base_sd, layout, delta))
        return version

    @endpoint(control=True)
    async def join_weights_group(self, spec: dict[str, Any], rank: int) -> int:
        """Join a generation of the lead trainer's weight group (``gloo`` / ``nccl`` lane); returns it."""
        return await self._lane.join(spec, rank)

    @endpoint(control=True)
    async def receive_weights_comm(self, generation: int, seq: int, version: int, layout: list[Any],
                                   sizes: list[Any]) -> int:
        """Enter broadcast ``seq`` of the weight group and stage ``version`` from it; returns the version."""
        version = await self._lane.receive(generation, seq, version, layout, sizes)
        if self.sp_leads:  # the group's other members are not in the weight group: staged on them from here
            await self.sp_call_members("receive_weights", version,
                                       *pack_buckets(self.weights.held(version), self.cfg.transport.bucket_mb))
        return version

    @endpoint(control=True)
    async def weights_info(self, version: int | None = None) -> dict[str, Any]:
        """Loaded version, stored versions, swap count and the digest of ``version`` (None: loaded)."""
        return {"loaded": self.weights.loaded, "versions": self.weights.versions, "swaps": self.weights.swaps,
                "digest": self.weights.digest(version)}

    @endpoint
    @mirrored
    async def probe_velocity(self, version: int, seed: int = 0) -> torch.Tensor:
        """The velocity this actor samples with at ``version`` on a fixed seeded input (for sync tests)."""
        return await self._compute(self._probe, version, seed)

    def _probe(self, version: int, seed: int) -> torch.Tensor:
        self.weights.ensure(version)
        return probe_velocity(self.engine, seed)

    @endpoint
    @mirrored
    async def drop_batch(self, batch: int) -> int:
        """Forget held fragments of batches ``<= batch`` (after its optimizer step); returns how many."""
        keys = [k for k in self.engine.fragments if k[0] <= batch]
        for k in keys:
            del self.engine.fragments[k]
        return len(keys)


