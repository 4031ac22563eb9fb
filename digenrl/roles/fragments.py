"""Fragments on the device that holds them: their state, and how they are generated and scored.

A fragment (DESIGN §2) lives on exactly one actor at a time as a :class:`FragmentData`: its latents at
``step``, its conditioning and the trained transitions recorded so far. Everything a fragment's
numbers depend on is seeded per sample (initial noise, transition noise, step plan:
:mod:`digenrl.rl.noise`), so its trajectory is the same whichever actors run its step ranges and
however tokens batch fragments together, and a fragment whose holder died mid-handover can be
recomputed from step 0 bit for bit.

:class:`FragmentEngine` advances fragments through denoising steps in batched forwards and decodes
and scores finished ones, with one model: a rollout actor's, or a trainer's when TAG makes it generate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from digenrl.algorithms import Algorithm, algorithm_for
from digenrl.config import Config
from digenrl.data.images import reward_inputs
from digenrl.errors import StalenessViolation
from digenrl.models import GeneratorModel, cat_cond, cond_to, decode_in_chunks, repeat_cond
from digenrl.models.experts import has_experts
from digenrl.models.lora import sampling
from digenrl.policy import trained_steps
from digenrl.rl.flash import run_tail
from digenrl.rl.forward import velocity_probe
from digenrl.rl.noise import initial_keys, initial_latents, probe_direction, transition_noise
from digenrl.rl.ode import ode_step
from digenrl.rl.sde import sde_step

__all__ = ["FragmentData", "FragmentEngine", "Scored", "probe_velocity"]

_INDICES = ("sample", "step")  # host indices (TransitionBatch): they pick rows, the math never reads them


@dataclass
class FragmentData:
    """One fragment's state on its holder. ``geo`` = ``[batch, index, p0, p1, m0, m1, group_size]``.

    ``trans``: what the trainer will need, recorded so far: Flow-GRPO's trained transitions, or (once
    finished) a forward-process method's clean samples ``{"sample", "probe", "y"}`` (the probe: parity). ``x0``: a multistep ODE solver's
    state, the previous step's data prediction (``rl.ode``), which travels with the latents.
    """

    geo: list[int]
    version: int
    step: int
    x: torch.Tensor
    cond: dict[str, torch.Tensor]
    trans: list[dict[str, torch.Tensor]] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    x0: torch.Tensor | None = None

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
        return {k: torch.cat([t[k] for t in self.trans]) for k in self.trans[0]} if self.trans else {}

    def to(self, device: torch.device | str) -> FragmentData:
        """This fragment with its latents, conditioning and recorded values on ``device`` (indices stay on the host)."""
        return replace(self, x=self.x.to(device), cond=cond_to(self.cond, device),
                       trans=[{k: v if k in _INDICES else v.to(device) for k, v in t.items()} for t in self.trans],
                       x0=None if self.x0 is None else self.x0.to(device))

    def to_wire(self, with_latents: bool = True) -> dict[str, Any]:
        """Plain dict of ints and tensors for the transport (no pickle)."""
        out: dict[str, Any] = {"geo": list(self.geo), "version": self.version, "step": self.step,
                               "cond": self.cond, "trans": self.transitions()}
        if with_latents:
            out["x"] = self.x
            if self.x0 is not None:
                out["x0"] = self.x0
        if self.rewards is not None:
            out["rewards"] = self.rewards
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FragmentData:
        """The fragment as it arrived, on the host (:meth:`to` places it where its receiver computes)."""
        trans = [d["trans"]] if d.get("trans") else []
        return cls(list(d["geo"]), int(d["version"]), int(d["step"]), d.get("x", torch.zeros(0)),
                   dict(d["cond"]), trans, d.get("rewards"), d.get("x0"))


@dataclass
class Scored:
    """A decoded and scored fragment.

    Attributes:
        rewards: ``[n]`` the weighted reward of each sample.
        images: ``[n, 3, H, W]`` uint8 (the first frame of videos).
        components: each weighted reward's own ``[n]`` scores.
        failed: samples scored with the failure penalty.
        decode_s: seconds spent decoding (the rest of the scoring is the reward itself).
        error: the reward's failure message when ``failed`` (the run's failure budget quotes it).
    """

    rewards: torch.Tensor
    images: torch.Tensor
    components: dict[str, torch.Tensor]
    failed: int
    decode_s: float
    error: str = ""


class FragmentEngine:
    """Generation and scoring of fragments with one model (a rollout actor's, or a trainer's for TAG)."""

    def __init__(self, cfg: Config, model: GeneratorModel, reward: Any | None = None,
                 make_reward: Callable[[], Any] | None = None, algorithm: Algorithm | None = None) -> None:
        self.cfg = cfg
        self.model = model
        # what the rollout records and with which weights it samples (a trainer's own, with its slow copies)
        self.algorithm = algorithm or algorithm_for(cfg, model, trains=False)
        self._reward, self._make_reward = reward, make_reward
        self.sigmas = model.sigmas(cfg.rollout.num_steps)
        self.fragments: dict[tuple[int, int], FragmentData] = {}
        self._cond_cache: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def reward(self) -> Any | None:
        """The reward; given only ``make_reward``, built at its first use: an actor that scores only when every
        reward actor has died holds no reward model until then (a learned one is gigabytes)."""
        if self._reward is None and self._make_reward is not None:
            self._reward = self._make_reward()
        return self._reward

    @property
    def device(self) -> torch.device:
        """Where this engine's fragments live: its model's device."""
        return self.model.device  # type: ignore[attr-defined, no-any-return]

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
        # (a deterministic sampler would make a group sharing x_0 one image: only an SDE shares it)
        keys = initial_keys(frag.sample_ids(), g, self.cfg.rollout.same_init_noise and self.algorithm.coupled)
        frag.x = initial_latents(self.model, self.cfg.log.seed, b, keys)
        return frag

    def _plan(self, frag: FragmentData) -> Any:
        # the version that samples the fragment decides its steps (MixGRPO's window moves with it)
        return self.algorithm.step_plan(frag.prompt_ids(), frag.sample_ids(),
                                        self.cfg.log.seed * 1_000_003 + frag.geo[0], frag.version)

    def advance(self, frags: list[FragmentData], start: int, stop: int) -> None:
        """Run steps ``[start, stop)`` of ``frags`` (all at ``start``, one version) in batched forwards.

        The forwards run with the algorithm's sampling weights (DiffusionNFT: the old policy), LoRA merged
        into fp32 weights (:func:`~digenrl.models.lora.sampling`).
        """
        with self.algorithm.sampling(), sampling(self.model):
            if self.algorithm.coupled:
                self._advance(frags, start, stop)
            else:
                self._integrate(frags, start, stop)

    def _integrate(self, frags: list[FragmentData], start: int, stop: int) -> None:
        """A forward-process rollout: the deterministic ODE over ``[start, stop)``, no transitions kept."""
        sizes = [f.num_samples for f in frags]
        x, cond = torch.cat([f.x for f in frags]), cat_cond([f.cond for f in frags])
        x0 = torch.cat([f.x0 for f in frags]) if start and frags[0].x0 is not None else None
        solver = self.algorithm.solver
        sigmas = self.sigmas.float().to(x.device)
        for i in range(start, stop):
            v = self.model.velocity(x, sigmas[i].expand(x.shape[0]), cond)
            if i == 0:  # the first step's velocity probe, which the trainer recomputes (parity)
                probes = velocity_probe(v, probe_direction(self.cfg.log.seed, v.shape[1:])).split(sizes)
                for frag, p in zip(frags, probes, strict=True):
                    frag.trans = [{"sample": torch.arange(frag.num_samples), "probe": p}]
            x, x0 = ode_step(solver, x, v, self.sigmas, i, x0)
        for frag, xs, x0s in zip(frags, x.split(sizes), x0.split(sizes), strict=True):
            frag.x, frag.x0, frag.step = xs.contiguous(), x0s.contiguous(), stop
            if stop == self.cfg.rollout.num_steps:
                # The trainer's data: each sample's clean latent and its probe (nothing of the trajectory).
                frag.trans = [{**frag.transitions(), "y": frag.x}]
                frag.x0 = None

    def _advance(self, frags: list[FragmentData], start: int, stop: int) -> None:
        ro = self.cfg.rollout
        tail = self.algorithm.ode_tail(frags[0].version)
        if tail is not None and any(f.version != frags[0].version for f in frags):
            raise StalenessViolation(f"one token advances fragments of versions {sorted({f.version for f in frags})}")
        sde_stop = stop if tail is None else min(stop, tail[0])
        plans = [self._plan(f) for f in frags]
        sample_ids = [f.sample_ids() for f in frags]
        sizes = [f.num_samples for f in frags]
        x = torch.cat([f.x for f in frags])
        cond = cat_cond([f.cond for f in frags])
        # The step plans are host data: their noise levels and the sigmas join the latents once per
        # token; which rows draw noise and which steps are ODE steps is read from the host copy.
        levels = [plan.stochastic.float() * ro.noise_level for plan in plans]
        levels_here = [a.to(x.device) for a in levels]
        sigmas = self.sigmas.float().to(x.device)
        # a solver that takes over after the window continues from the window's last data prediction
        x0 = torch.cat([f.x0 for f in frags]) if tail is not None and start >= tail[0] else None
        for i in range(start, sde_stop):
            sig = sigmas[i].expand(x.shape[0])
            sig_next = sigmas[i + 1].expand(x.shape[0])
            v = self.model.velocity(x, sig, cond)
            if tail is not None and i == tail[0] - 1:
                x0 = x - sigmas[i] * v.float()
            outs = []
            for frag, ids, plan, level, xs, vs, ss, sn, a in zip(
                    frags, sample_ids, plans, levels, x.split(sizes), v.split(sizes), sig.split(sizes),
                    sig_next.split(sizes), (lv[:, i] for lv in levels_here), strict=True):
                z = transition_noise(self.cfg.log.seed, frag.geo[0], ids, i, xs, active=level[:, i] > 0)
                out = sde_step(xs, vs, ss, sn, level[:, i], z, kind=ro.sde)  # type: ignore[arg-type]
                idx = plan.trained[:, i].nonzero().flatten()
                if idx.numel():
                    frag.trans.append({"sample": idx, "step": torch.full_like(idx, i), "x": xs[idx],
                                       "x_next": out.x_next[idx], "sigma": ss[idx].clone(),
                                       "sigma_next": sn[idx].clone(), "log_prob": out.log_prob[idx],
                                       "noise_level": a[idx]})
                outs.append(out.x_next)
            x = torch.cat(outs)
        if tail is not None and stop > tail[0]:
            x, x0 = run_tail(self.model.velocity, x, cond, tail[1], x0, max(start, tail[0]), stop)
        x0s = x0.split(sizes) if x0 is not None else [None] * len(frags)
        for frag, xs, x0f in zip(frags, x.split(sizes), x0s, strict=True):
            frag.x, frag.step = xs.contiguous(), stop
            frag.x0 = None if x0f is None or stop == ro.num_steps else x0f.contiguous()
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
    def score(self, frag: FragmentData, prompts: list[str]) -> Scored:
        """Decode and score a finished fragment."""
        if self.reward is None:
            raise RuntimeError("this engine has no reward function")
        t0 = time.perf_counter()
        images = decode_in_chunks(self.model, frag.x, self.cfg.rollout.decode_batch)
        decode_s = time.perf_counter() - t0
        # rewards read the prompts' texts; an edit reward also the samples' input images (data/images.py)
        texts, sources = reward_inputs([prompts[p] for p in frag.prompt_ids()], images, self.reward.uses_sources)
        failures = self.reward.failures
        rewards = self.reward.score(images, texts, sources=sources).float().flatten()
        # A failed call scores every sample of it with the penalty (GuardedReward).
        failed = frag.num_samples if self.reward.failures > failures else 0
        components = {} if failed else dict(getattr(self.reward.inner, "last_components", {}))
        if images.ndim == 5:
            images = images[:, :, 0]
        frag.rewards = rewards
        return Scored(rewards, (images.clamp(0, 1) * 255).round().to(torch.uint8), components, failed, decode_s,
                      self.reward.last_error if failed else "")


def probe_velocity(engine: FragmentEngine, seed: int) -> torch.Tensor:
    """Velocity the engine samples with (its algorithm's sampling weights, LoRA merged as in ``advance``) on seeded
    noise and a fixed prompt.

    Both rows at the first step's sigma; with experts (Wan2.2 A14B), the second row at the last step's, so
    each expert answers one row.
    """
    gen = torch.Generator().manual_seed(seed)
    x = engine.model.prepare_latents(2, generator=gen)
    cond = repeat_cond(engine.model.encode_prompts(["a red square"]), 2)
    sigma = engine.sigmas[[0, -2] if has_experts(engine.model) else [0, 0]].float()
    with engine.algorithm.sampling(), sampling(engine.model):
        return engine.model.velocity(x, sigma, cond)
