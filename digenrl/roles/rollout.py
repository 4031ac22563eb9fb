"""``RolloutActor``: runs the denoising-step tokens and the scoring of the fragments it holds.

A fragment (DESIGN §2) lives on exactly one actor at a time as a :class:`FragmentData`: its latents at
``step``, the generator state of its transition noise, its conditioning and the trained transitions
recorded so far. A ROLLOUT token names each fragment's ``source``: ``""`` starts it from noise, this
actor continues it, another actor hands it over (``take_fragment``, a control endpoint, so the holder
answers even while it computes). Everything a fragment's numbers depend on is seeded per fragment
(initial noise, transition noise, step plan), so its trajectory is the same whichever actors run its
step ranges and however tokens batch fragments together, and a fragment whose holder died mid-handover
can be recomputed from step 0 bit for bit.

A REWARD token decodes and scores finished fragments and hands their transitions to the trainer-side
fragment store named by the coordinator (``store_fragment`` on a trainer) before it reports done: a
scored fragment is durable (the schedule's contract) even if this actor dies afterwards.

The same :class:`FragmentEngine` serves the trainer when TAG makes it generate. Role actors hold no
schedule logic: they run the tokens they are handed and return measured spans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from digenrl.actors.base import Actor, ActorRef, endpoint
from digenrl.actors.weights import WeightStore, unpack_buckets
from digenrl.config import Config, config_from_dict
from digenrl.errors import ActorDied, RemoteError, StalenessViolation
from digenrl.models import GeneratorModel, cat_cond, load_model, repeat_cond
from digenrl.models._toy import toy_signal_init
from digenrl.models.lora import apply_lora, enable_full_finetune, sampling
from digenrl.rl.noise import initial_keys, initial_latents, transition_noise
from digenrl.rl.sde import sde_step
from digenrl.rl.steps import plan_steps

__all__ = ["FragmentData", "FragmentEngine", "RolloutActor", "build_model", "trained_steps", "limit_threads"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRANS = ("sample", "step", "x", "x_next", "sigma", "sigma_next", "log_prob", "noise_level")


_BUILD_LOCK = threading.Lock()


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


def build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    """The generator with its trainable parameters, built exactly as the colocated recipe builds it."""
    # diffusers' lazy imports are not thread-safe: in-process actors build their models one at a time.
    with _BUILD_LOCK:
        return _build_model(cfg)


def _build_model(cfg: Config) -> tuple[GeneratorModel, list[torch.nn.Parameter]]:
    m = cfg.model
    model = load_model(m.name, m.preset, path=m.path or None, device=m.device, dtype=_DTYPES[m.dtype], seed=m.seed,
                       resolution=(m.resolution[0], m.resolution[1]),
                       num_frames=m.num_frames if m.name in ("wan21", "hunyuanvideo") else None,
                       guidance_scale=m.guidance_scale, text_len=m.text_len or None)
    if m.vae_init == "signal":  # random toy presets: make pixels depend on the latent and the prompt
        toy_signal_init(model, seed=m.seed + 3)
    if m.finetune == "lora":
        params = apply_lora(model, rank=m.lora_rank, alpha=m.lora_alpha, seed=m.seed,
                            target_modules=m.lora_targets or None)
    else:
        params = enable_full_finetune(model)
    return model, params


def trained_steps(cfg: Config) -> int:
    """Transitions trained per sample (|T|) under ``rollout.steps``."""
    ro = cfg.rollout
    if ro.steps == "window":
        return ro.window
    if ro.steps == "fraction":
        return max(1, round(ro.fraction * (ro.num_steps - 1)))
    return ro.num_steps - 1


@dataclass
class FragmentData:
    """One fragment's state on its holder. ``geo`` = ``[batch, index, p0, p1, m0, m1, group_size]``."""

    geo: list[int]
    version: int
    step: int
    x: torch.Tensor
    cond: dict[str, torch.Tensor]
    trans: list[dict[str, torch.Tensor]] = field(default_factory=list)
    rewards: torch.Tensor | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.geo[0], self.geo[1]

    @property
    def num_samples(self) -> int:
        return (self.geo[3] - self.geo[2]) * (self.geo[5] - self.geo[4])

    def sample_ids(self) -> list[int]:
        """Batch-level sample ids, in local (prompt-major) order."""
        _, _, p0, p1, m0, m1, g = self.geo
        return [p * g + m for p in range(p0, p1) for m in range(m0, m1)]

    def prompt_ids(self) -> list[int]:
        _, _, p0, p1, m0, m1, _ = self.geo
        return [p for p in range(p0, p1) for _ in range(m0, m1)]

    def transitions(self) -> dict[str, torch.Tensor]:
        """All recorded rows, concatenated."""
        return {k: torch.cat([t[k] for t in self.trans]) for k in _TRANS} if self.trans else {}

    def to_wire(self, with_latents: bool = True) -> dict[str, Any]:
        """Plain dict of ints and tensors for the transport (no pickle)."""
        out: dict[str, Any] = {"geo": list(self.geo), "version": self.version, "step": self.step,
                               "cond": self.cond, "trans": self.transitions()}
        if with_latents:
            out["x"] = self.x
        if self.rewards is not None:
            out["rewards"] = self.rewards
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FragmentData:
        trans = [d["trans"]] if d.get("trans") else []
        return cls(list(d["geo"]), int(d["version"]), int(d["step"]), d.get("x", torch.zeros(0)),
                   dict(d["cond"]), trans, d.get("rewards"))


class FragmentEngine:
    """Generation and scoring of fragments with one model (a rollout actor's, or a trainer's for TAG)."""

    def __init__(self, cfg: Config, model: GeneratorModel, reward: Any | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.reward = reward
        self.sigmas = model.sigmas(cfg.rollout.num_steps)
        self.fragments: dict[tuple[int, int], FragmentData] = {}
        self._cond_cache: dict[str, dict[str, torch.Tensor]] = {}

    # -- fragments ---------------------------------------------------------------------------
    def _cond(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        key = "\x00".join(prompts)
        if key not in self._cond_cache:
            if len(self._cond_cache) > 256:
                self._cond_cache.clear()
            with torch.no_grad():
                self._cond_cache[key] = self.model.encode_prompts(prompts)
        return self._cond_cache[key]

    def fresh(self, geo: list[int], version: int, prompts: list[str]) -> FragmentData:
        """A fragment at step 0: its samples' initial latents (per-sample seeds, :mod:`digenrl.rl.noise`)."""
        b, _, p0, p1, m0, m1, g = geo
        frag = FragmentData(list(geo), version, 0, torch.zeros(0), repeat_cond(self._cond(prompts[p0:p1]), m1 - m0))
        keys = initial_keys(frag.sample_ids(), g, self.cfg.rollout.same_init_noise)
        frag.x = initial_latents(self.model, self.cfg.log.seed, b, keys)
        return frag

    def _plan(self, frag: FragmentData) -> Any:
        ro = self.cfg.rollout
        return plan_steps(ro.num_steps, frag.prompt_ids(), frag.sample_ids(), mode=ro.steps,  # type: ignore[arg-type]
                          window=ro.window, window_range=ro.window_bounds(), fraction=ro.fraction,
                          seed=self.cfg.log.seed * 1_000_003 + frag.geo[0])

    def advance(self, frags: list[FragmentData], start: int, stop: int) -> None:
        """Run steps ``[start, stop)`` of ``frags`` (all at ``start``, one version) in batched forwards.

        The forwards run with LoRA merged into fp32 weights (:func:`~digenrl.models.lora.sampling`).
        """
        with sampling(self.model):
            self._advance(frags, start, stop)

    def _advance(self, frags: list[FragmentData], start: int, stop: int) -> None:
        ro = self.cfg.rollout
        plans = [self._plan(f) for f in frags]
        sample_ids = [f.sample_ids() for f in frags]
        sizes = [f.num_samples for f in frags]
        x = torch.cat([f.x for f in frags])
        cond = cat_cond([f.cond for f in frags])
        for i in range(start, stop):
            sig = self.sigmas[i].float().expand(x.shape[0])
            sig_next = self.sigmas[i + 1].float().expand(x.shape[0])
            v = self.model.velocity(x, sig, cond)
            outs = []
            for frag, ids, plan, xs, vs, ss, sn in zip(frags, sample_ids, plans, x.split(sizes), v.split(sizes),
                                                        sig.split(sizes), sig_next.split(sizes), strict=True):
                a = plan.stochastic[:, i].float() * ro.noise_level
                z = transition_noise(self.cfg.log.seed, frag.geo[0], ids, i, xs, active=a > 0)
                out = sde_step(xs, vs, ss, sn, a, z, kind=ro.sde)  # type: ignore[arg-type]
                idx = plan.trained[:, i].nonzero().flatten()
                if idx.numel():
                    frag.trans.append({"sample": idx, "step": torch.full_like(idx, i), "x": xs[idx],
                                       "x_next": out.x_next[idx], "sigma": ss[idx].clone(),
                                       "sigma_next": sn[idx].clone(), "log_prob": out.log_prob[idx],
                                       "noise_level": a[idx]})
                outs.append(out.x_next)
            x = torch.cat(outs)
        for frag, xs in zip(frags, x.split(sizes), strict=True):
            frag.x, frag.step = xs.contiguous(), stop
            if stop == ro.num_steps:
                self._finish(frag)

    def _finish(self, frag: FragmentData) -> None:
        """Order rows as the schedule indexes them: row ``i * T + t`` = local sample i, t-th trained step."""
        t = frag.transitions()
        order = torch.argsort(t["sample"] * (self.cfg.rollout.num_steps + 1) + t["step"], stable=True)
        frag.trans = [{k: v[order].contiguous() for k, v in t.items()}]
        want = frag.num_samples * trained_steps(self.cfg)
        if len(order) != want:
            raise StalenessViolation(f"fragment {frag.key} recorded {len(order)} trained rows, expected {want}")

    def recompute(self, geo: list[int], version: int, prompts: list[str], step: int) -> FragmentData:
        """Regenerate a fragment from noise up to ``step`` (its holder died while handing it over)."""
        frag = self.fresh(geo, version, prompts)
        if step:
            self.advance([frag], 0, step)
        return frag

    @torch.no_grad()
    def score(self, frag: FragmentData, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode and score a finished fragment; returns (rewards ``[n]``, uint8 images)."""
        if self.reward is None:
            raise RuntimeError("this engine has no reward function")
        images = self.model.decode(frag.x)
        sample_prompts = [prompts[p] for p in frag.prompt_ids()]
        rewards = self.reward.score(images, sample_prompts).float().flatten()
        if images.ndim == 5:
            images = images[:, :, 0]
        frag.rewards = rewards
        return rewards, (images.clamp(0, 1) * 255).round().to(torch.uint8)


def parse_sources(token: dict[str, Any]) -> list[tuple[list[int], str]]:
    """``(geo, source)`` per fragment of a wire token."""
    b = token["batch"]
    return [([b, *geo], src) for geo, src in zip(token["frags"], token["sources"] or [""] * len(token["frags"]),
                                                 strict=True)]


class GenerationMixin:
    """ROLLOUT and REWARD token execution shared by rollout actors and (TAG) trainers."""

    name: str
    config: dict[str, Any]
    threads: int
    cfg: Config
    engine: FragmentEngine
    peers: dict[str, ActorRef[Any]]
    pool: concurrent.futures.ThreadPoolExecutor

    # Token endpoints shared by every generating or scoring actor (rollout, reward, trainer via TAG).
    @endpoint
    async def rollout(self, token: dict[str, Any], prompts: list[str]) -> dict[str, Any]:
        """Run a ROLLOUT token (denoising steps of its fragments); returns the measured span."""
        return await self._run_rollout(token, prompts)

    @endpoint
    async def reward(self, token: dict[str, Any], prompts: list[str], store: str, images: bool = False) -> dict[str, Any]:
        """Run a REWARD token: take, decode, score, hand transitions to trainer ``store``; returns rewards."""
        return await self._run_reward(token, prompts, store, images)

    @endpoint(control=True)
    async def take_fragment(self, batch: int, index: int) -> dict[str, Any]:
        """Hand fragment ``(batch, index)`` over to the caller (it is no longer held here).

        Raises:
            KeyError: the fragment is not held here.
        """
        frag = self.engine.fragments.pop((batch, index), None)
        if frag is None:
            raise KeyError(f"{self.name} holds no fragment ({batch}, {index})")
        return frag.to_wire()

    async def _setup_frozen_engine(self) -> GeneratorModel:
        """Threads, config, compute thread, reward and a frozen policy copy: the setup of actors that
        generate or score but never train (``self.config``, ``self.threads`` and ``self.ref`` set)."""
        from digenrl.rewards import build_reward

        limit_threads(self.threads)
        self.cfg = config_from_dict(self.config)
        self.name = self.ref.name  # type: ignore[attr-defined]  # the Actor this mixes into
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"digenrl-{self.name}")
        r = self.cfg.reward
        reward = build_reward(r.weights, url=r.url or None, timeout=r.timeout, retries=r.retries,
                              image_format=r.image_format, on_error=r.on_error, penalty=r.penalty)
        model, _ = await self._compute(build_model, self.cfg)
        model.transformer.requires_grad_(False)
        self.engine = FragmentEngine(self.cfg, model, reward)
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
        if source == self.name:
            frag = self.engine.fragments.pop(key, None)
            if frag is not None:
                return frag
            raise StalenessViolation(f"{self.name}: fragment {key} is not held here")
        try:
            data = await self.peers[source].take_fragment.call(key[0], key[1])
            return FragmentData.from_wire(data)
        except (ActorDied, RemoteError, KeyError) as exc:
            if not compute_fresh:
                raise
            log.warning("%s: could not take fragment %s from %s (%s); recomputing it from noise", self.name, key,
                        source, exc)
            return await self._compute(self.engine.recompute, geo, version, prompts, step)

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

    async def _run_reward(self, token: dict[str, Any], prompts: list[str], store: str,
                          images: bool) -> dict[str, Any]:
        t0 = time.time()
        out: dict[str, Any] = {"rewards": [], "images": []}
        for geo, src in parse_sources(token):
            frag = await self._obtain(geo, src or self.name, token["version"], prompts, 0, compute_fresh=False)
            if frag.step != self.engine.cfg.rollout.num_steps:
                raise StalenessViolation(f"{self.name}: fragment {frag.key} scored at step {frag.step}")
            rewards, imgs = await self._compute(self.engine.score, frag, prompts)
            await self.peers[store].store_fragment.call(frag.to_wire(with_latents=False))
            out["rewards"].append(rewards)
            if images:
                out["images"].append(imgs)
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
        model = await self._setup_frozen_engine()
        self.weights = WeightStore(model, version=-1)
        self._lane: Any = None

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if getattr(self, "_lane", None) is not None:
            self._lane.close()
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)

    def _use_version(self, version: int) -> None:
        self.weights.ensure(version)

    @endpoint
    async def connect(self, peers: dict[str, Any], dist: dict[str, Any] | None = None) -> str:
        """Learn the other actors' refs (and join the torch.distributed weight lane when configured)."""
        self.peers = dict(peers)
        if dist is not None:
            from digenrl.actors.weights import DistLane

            self._lane = await self._compute(lambda: DistLane(dist["rank"], dist["world_size"], dist["init_method"]))
        return self.name

    @endpoint(control=True)
    async def receive_weights(self, version: int, layout: list[Any], buckets: list[Any]) -> int:
        """Stage ``version`` (used from the next token that asks for it); returns the version."""
        self.weights.stage(version, unpack_buckets(layout, buckets))
        return version

    @endpoint
    async def receive_weights_dist(self, version: int, bucket_mb: float) -> int:
        """Enter the torch.distributed broadcast of ``version`` (the trainer is its source)."""
        sd = await self._compute(self._lane.broadcast, None, bucket_mb)
        self.weights.stage(version, sd)
        return version

    @endpoint(control=True)
    async def weights_info(self, version: int | None = None) -> dict[str, Any]:
        """Loaded version, stored versions, swap count and the digest of ``version`` (None: loaded)."""
        return {"loaded": self.weights.loaded, "versions": self.weights.versions, "swaps": self.weights.swaps,
                "digest": self.weights.digest(version)}

    @endpoint
    async def probe_velocity(self, version: int, seed: int = 0) -> torch.Tensor:
        """The velocity this actor samples with at ``version`` on a fixed seeded input (for sync tests)."""
        return await self._compute(self._probe, version, seed)

    def _probe(self, version: int, seed: int) -> torch.Tensor:
        self.weights.ensure(version)
        return probe_velocity(self.engine, seed)

    @endpoint
    async def drop_batch(self, batch: int) -> int:
        """Forget held fragments of batches ``<= batch`` (after its optimizer step); returns how many."""
        keys = [k for k in self.engine.fragments if k[0] <= batch]
        for k in keys:
            del self.engine.fragments[k]
        return len(keys)


def probe_velocity(engine: FragmentEngine, seed: int) -> torch.Tensor:
    """Velocity the engine samples with (LoRA merged as in ``advance``) on seeded noise and a fixed prompt."""
    gen = torch.Generator().manual_seed(seed)
    x = engine.model.prepare_latents(2, generator=gen)
    cond = repeat_cond(engine.model.encode_prompts(["a red square"]), 2)
    with sampling(engine.model):
        return engine.model.velocity(x, engine.sigmas[0].float().expand(2), cond)
