"""``digenrl bench tokens``: what each token of a config costs on the device it names, beside the simulator.

One process, the config's model at its configured size (a tiny preset on a CPU, ``model.preset =
"random"`` at real size on a GPU) on ``model.device``; on a CPU with ``placement.actor_threads`` torch
threads, what one actor process has. Each measurement runs the code a run runs:

* **rollout step**: ``FragmentEngine.advance`` of step 0 (stochastic and trained under the usual
  windows) of one fragment of B samples: the rollout's ``model.velocity`` (the config's CFG, LoRA
  merged as the rollout samples), the SDE step with its seeded noise, the recorded transitions;
  B = 1, 2, 4, ... up to ``max_batch`` (default: the config's rollout token);
* **rollout start**: ``FragmentEngine.fresh`` of the config's fragment (prompts encoded, initial noise);
* **train pass**: ``packed_backward`` of R transitions in one pass (sampled from the model by one SDE
  step, so shapes and log-probs are real), with the KL reference forward when ``train.kl_beta > 0``,
  on the model as ``prepare_for_training`` sets it up (gradient checkpointing, fp32 master LoRA); R up
  to ``max_rows`` (default: the config's train token). A one-step-stale schedule with
  ``train.check_parity`` also pays, per train token, the trainer's parity recompute of a stale batch;
* **decode** (``decode_in_chunks``, ``rollout.decode_batch``) and **reward score** (the config's reward,
  the host function a reward actor runs), B up to one fragment's samples;
* **optimizer step**: the trainer's (divide, clip, AdamW step, zero) over the trainable set;
* **publication over the zmq lane** (the gloo / nccl lanes need a second process: not measured): the
  trainable state dict, ``pack_buckets``, a ``ZmqTransport`` send to a second endpoint of this process
  (codec, same-host shared memory), ``unpack_buckets``, ``WeightStore.stage`` and the acknowledgement,
  what the lead trainer's ``publish`` span covers; the rollout's load of a staged version is its own row;
* **all-reduce** (CPU): the trainer group's all-reduce of the trainable set between two gloo processes
  (``measure_costs.measure_allreduce``, as ``bench bubbles --real`` measures it).

Times are medians of up to ``repeats`` runs after a warm-up run, each between device synchronisations
(``torch.cuda.synchronize`` on CUDA); a sweep stops at the first size that runs out of device memory.
FLOPs are the simulator's count (``sim/flops.py``) of the config's transformer as built (its config,
resolution, text length and the CFG passes its velocity makes), ``TRAIN_PASSES`` per trained row as the
cost model charges, and the decode counted by ``FlopCounterMode`` on the config's own VAE (as
``sim/profiles.py`` counts the real one). MFU = FLOPs / (seconds x peak): the catalog's peak
(``sim/devices.py``) on a known GPU; a CPU has no catalog entry, so there the peak is a matmul in the
model's dtype measured here at the same thread count. Beside each, the simulator's prediction:
``sim/cost.py`` ``CostModel`` with the calibrated parameters the planner uses, on the catalog device
``plan --fleet`` names (``measured`` on a CPU), for a profile of the config's model as built.

The report's ``calibration`` is the costs file of ``digenrl plan CONFIG --fleet Nx<device> --costs OUT``
(``MeasuredCost.from_calibration``, costs version 3) fitted to these rows; ``not_measured`` (and the
notes the planner prints) say what one process cannot measure and what is charged instead.

The CUDA paths (synchronisation, the catalog peak, out-of-memory stops) have never run on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from digenrl.config import Config
from digenrl.schedule.base import Device, Fragment, Role, Token, TokenKind
from digenrl.sim.cost import TRAIN_PASSES, CostModel
from digenrl.sim.flops import SampleShape, forward_flops
from digenrl.sim.measured import AllReduce, MeasuredCost

__all__ = ["Measurement", "ConfigProfile", "TokenBench", "run_token_bench", "fit_line", "catalog_allreduce"]

PARITY_ROWS = 16  # = roles.trainer.PARITY_SAMPLE_ROWS: rows of a stale pass recomputed for parity
SOURCE = "digenrl bench tokens"
Progress = Callable[[str, int, int], None]  # (what is measured now, done, total)
Step = tuple[str, str, Callable[[], None]]  # (label, the sweep it belongs to, run it)


@dataclass
class Measurement:
    """One measured token shape: ``size`` units (samples, rows or 1) and its median seconds."""

    kind: str
    size: int
    unit: str
    seconds: float
    runs: int
    flops: float | None = None  # the simulator's count (see flops_source)
    flops_source: str = ""
    flops_counted: float | None = None  # FlopCounterMode on the real call: what ran (LoRA, KL reference...)
    predicted_s: float | None = None
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)
    mfu: float | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted seconds."""
        return self.seconds / self.predicted_s if self.predicted_s else None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "parts" or v}
        return {**out, "per_unit_s": self.seconds / max(self.size, 1), "ratio": self.ratio}


@dataclass(frozen=True)
class ConfigProfile:
    """The cost model's view of the config's model as built; ``CostModel`` reads these attributes as it
    reads a paper model's ``sim.profiles.ModelProfile``: per sample, one transformer pass and the passes
    per velocity (CFG), the decode, the text encoder; bytes of the trainable set, weights and a latent."""

    name: str
    arch: str
    shape: SampleShape
    cfg_rollout: int
    cfg_train: int
    trainable_params: int
    text_encoder_params: float
    reward_flops: float  # the config's rewards are host functions: no device FLOPs
    forward_flops: int
    decode_flops: int
    publish_bytes: int
    weight_bytes: int
    latent_bytes: int

    @property
    def text_flops(self) -> float:
        return 2.0 * self.text_encoder_params * self.shape.text_tokens


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Non-negative ``seconds = a + b x`` through ``(x, seconds)``, least squares of the *relative*
    residuals (a sweep's small sizes count as much as its large ones).

    Returns:
        ``(a, b, largest relative residual)``.
    """
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    if len(points) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([w, x * w], 1), y * w, rcond=None)
    else:
        a, b = 0.0, float(y[0] / x[0])
    if b < 0:  # no growth measured: a constant
        a, b = float(np.sum(w * w * y) / np.sum(w * w)), 0.0
    elif a < 0:  # through the origin
        a, b = 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    return float(a), float(b), float(np.max(np.abs(a + b * x - y) * w))


def catalog_allreduce(nbytes: float, device: str, why: str) -> tuple[AllReduce, str]:
    """An all-reduce not measured here (``why``): the simulator's ring all-reduce of ``nbytes`` over the
    catalog ``device``'s intra-node link and collective latency (what ``CostModel`` charges), and the
    sentence saying so."""
    from digenrl.sim.calibration import calibrated_params
    from digenrl.sim.devices import device_spec

    latency, spec = calibrated_params().collective_latency_s, device_spec(device)
    return (AllReduce(float(nbytes), spec.intra_node_bytes_per_s, latency),
            f"{why}: charged as the simulator's ring all-reduce of the trainable set over the catalog "
            f"{spec.name}'s intra-node link ({spec.intra_node_bytes_per_s / 1e9:g} GB/s, {latency * 1e6:g} us a step)")


def _sizes(cap: int) -> list[int]:
    """1, 2, 4, ... below ``cap``, then ``cap``."""
    out, n = [], 1
    while n < cap:
        out.append(n)
        n *= 2
    return [*out, max(1, cap)]


def _geometry(samples: int, group: int) -> tuple[int, int]:
    """(prompts, members per prompt) of a fragment of ``samples``: the most members that divide it."""
    members = next(m for m in range(min(samples, group), 0, -1) if samples % m == 0)
    return samples // members, members


class TokenBench:
    """The measurements of one config (see the module docstring); :meth:`run` executes them in order.

    Args:
        cfg: the run config; its ``model.device`` is where everything runs.
        max_batch: largest rollout step batch (0: the config's rollout token); decode and reward go up to
            the smaller of it and one fragment's samples.
        max_rows: largest train pass (0: the config's train token).
        repeats: timed runs per measurement (after one warm-up run).
        allreduce: measure the 2-process gloo all-reduce on a CPU (a few seconds of process starts).
    """

    def __init__(self, cfg: Config, *, max_batch: int = 0, max_rows: int = 0, repeats: int = 5,
                 allreduce: bool = True) -> None:
        from digenrl.data.prompts import load_prompts

        self.cfg, self.repeats, self.want_allreduce = cfg, repeats, allreduce
        self.device = torch.device(cfg.model.device)
        self._build()
        self._sizes_of_tokens(max_batch, max_rows)
        prompts = load_prompts(cfg.data.prompt_set, cfg.data.prompts, cfg.data.prompt_file)
        self.prompts = [prompts[i % len(prompts)] for i in range(max(self.max_batch, self.max_rows, self.fragment))]
        self.results: list[Measurement] = []
        self.notes: list[str] = []
        self.warmup_s = 0.0  # the last measurement's warm-up run
        self._compiled: set[str] = set()  # model.compile: the warm-ups already noted
        self.allreduce: AllReduce | None = None
        self.allreduce_source = ""
        self._sample_flops()
        self.peak, self.peak_source, self.catalog = self._peak()
        self.profile = self._profile()
        self.cost = self._cost_model()

    def _build(self) -> None:
        """The model as a TAG trainer holds it (trains, samples, decodes), its engine and its reward."""
        from digenrl.models.lora import trainable_parameters
        from digenrl.policy import build_model, prepare_for_training
        from digenrl.rewards import build_reward
        from digenrl.roles.fragments import FragmentEngine

        cfg, r = self.cfg, self.cfg.reward
        torch.manual_seed(cfg.log.seed)
        self.model: Any = build_model(cfg)[0]
        prepare_for_training(self.model, cfg, generates=True)
        self.params = trainable_parameters(self.model)
        self.reward = build_reward(r.weights, url=r.url or None, timeout=r.timeout, retries=r.retries,
                                   image_format=r.image_format, on_error=r.on_error, penalty=r.penalty)
        self.engine = FragmentEngine(cfg, self.model, self.reward)

    def _sizes_of_tokens(self, max_batch: int, max_rows: int) -> None:
        """The config's token sizes (as its schedule resolves them) and the sweeps' caps."""
        from digenrl.policy import trained_steps
        from digenrl.schedule.base import Workload
        from digenrl.schedule.options import PRESETS, resolve, with_overrides

        ro, place, preset = self.cfg.rollout, self.cfg.placement, PRESETS[self.cfg.schedule.name]
        self.tsp, self.stale = preset.tsp, max(preset.staleness, self.cfg.schedule.staleness)
        work = Workload(1, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(self.cfg))
        self.sizes = resolve(with_overrides(preset, self.cfg.schedule_options), work, place.rollout, place.trainer)
        self.fragment = self.sizes.fragment_groups * self.sizes.fragment_members
        self.max_batch = max_batch or self.sizes.rollout_batch
        self.max_rows = max_rows or min(self.sizes.train_pack, self.cfg.train.rows_per_pass or self.sizes.train_pack)
        self.max_decode = min(self.max_batch, self.fragment)

    # -- timing ----------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> tuple[float, int]:
        """Median seconds of ``fn(setup())`` over up to ``repeats`` runs after one warm-up; the setup untimed."""
        times: list[float] = []
        for i in range(self.repeats + 1):
            arg = setup() if setup else None
            self._sync()
            start = time.perf_counter()
            fn(arg)
            self._sync()
            if i:  # run 0 is the warm-up (allocations, kernel selection, lazy state)
                times.append(time.perf_counter() - start)
            else:
                self.warmup_s = time.perf_counter() - start  # with model.compile: the shape's compile, once a process
            if len(times) >= 2 and sum(times) > 2.0:  # a slow shape: two runs suffice for a median
                break
        return statistics.median(times), len(times)

    def _compile_note(self, label: str) -> None:
        """With ``model.compile``: the seconds of ``label``'s warm-up run, which compiled its graph (a process pays
        it once per graph, less when the kernels are in the compile cache already; later shapes recompile little)."""
        if self.cfg.model.compile and label not in self._compiled:
            self._compiled.add(label)
            self.notes.append(f"model.compile = {self.cfg.model.compile!r}: {label} took {self.warmup_s:.2f} s "
                              "(compile and one run)")

    def _count(self, fn: Callable[[], Any]) -> int:
        """Matmul FLOPs of ``fn()`` by ``FlopCounterMode`` (a CPU runs the math attention kernel: it is counted)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        math = sdpa_kernel(SDPBackend.MATH) if self.device.type == "cpu" else contextlib.nullcontext()
        # Eager: a compiled module (model.compile) entered under a dispatch mode is left to eager for good
        with torch.compiler.set_stance("force_eager"), math, FlopCounterMode(display=False) as counter:
            fn()
        return int(counter.get_total_flops())

    # -- the model as the simulator sees it -----------------------------------------------------------
    def _sample_flops(self) -> None:
        """Per sample: the transformer passes of one velocity (CFG), one pass's FLOPs (the simulator's count
        of this transformer, else FlopCounterMode's) and one decode's (FlopCounterMode)."""
        from digenrl.models.lora import sampling
        from digenrl.sim.user import ARCH_OF_MODEL

        m, frag = self.model, self._fresh(1)
        sigma = self.engine.sigmas[:1].float().to(frag.x.device)
        rows: list[int] = []  # samples through the transformer per velocity call: its CFG passes

        def seen(_module: Any, args: Any, kwargs: Any) -> None:
            rows.append(int(kwargs.get("hidden_states", args[0] if args else None).shape[0]))

        with sampling(m), torch.no_grad():
            # The model's first call, plain (before the hook): with model.compile it compiles the sampling graph.
            self._sync()
            start = time.perf_counter()
            m.velocity(frag.x, sigma, frag.cond)
            self._sync()
            self.warmup_s = time.perf_counter() - start
            self._compile_note("the first velocity call")
            hook = m.transformer.register_forward_pre_hook(seen, with_kwargs=True)
            try:
                self.velocity_flops_counted = self._count(lambda: m.velocity(frag.x, sigma, frag.cond))
            finally:
                hook.remove()
        self.passes, self.arch = max(1, sum(rows)), ARCH_OF_MODEL[self.cfg.model.name]
        lat, embeds = m.latent_shape, frag.cond.get("prompt_embeds")
        grid = lat[1:] if len(lat) == 4 else (1, getattr(m, "lat_h", 0), getattr(m, "lat_w", 0))
        text = int(embeds.shape[1]) if embeds is not None else 0
        self.shape = SampleShape(int(grid[0]), int(grid[1]), int(grid[2]), text)
        try:
            config = {k: v for k, v in m.transformer.config.items() if not k.startswith("_")}
            self.pass_flops = forward_flops(self.arch, self.shape, config)
            self.flops_source = "simulator (sim/flops.py)"
        except (KeyError, TypeError, ZeroDivisionError):  # a transformer the formulas do not know
            self.pass_flops = self.velocity_flops_counted // self.passes
            self.flops_source = "FlopCounterMode (the simulator's formulas do not count this transformer)"
        with torch.no_grad():
            self.decode_flops = self._count(lambda: m.decode(frag.x))

    @property
    def velocity_flops(self) -> int:
        """One sample's velocity as the simulator counts it: CFG passes x one pass."""
        return self.passes * self.pass_flops

    def _peak(self) -> tuple[float | None, str, str | None]:
        """(peak FLOP/s for MFU, where it comes from, the catalog entry ``plan --fleet`` would name)."""
        from digenrl.sim.devices import CATALOG

        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device).upper().replace(" ", "")
            key = next((k for k in CATALOG if k != "measured" and k.upper() in name), None)
            if key is None:
                return None, f"{name}: no catalog entry (sim/devices.py): no MFU, no prediction", None
            return CATALOG[key].peak_bf16_flops, f"catalog {key}: dense bf16 datasheet peak", key
        size, dtype = 1024, self.model.dtype
        a = torch.randn(size, size, dtype=dtype, device=self.device)
        seconds, _ = self._time(lambda _: a @ a)
        return 2.0 * size**3 / seconds, (f"measured here: {str(dtype).removeprefix('torch.')} matmul {size}^3 at "
                                         f"{torch.get_num_threads()} thread(s), a CPU has no catalog entry; "
                                         "oneDNN's convolutions can beat it: a VAE's MFU may pass 100%"), "measured"

    def _profile(self) -> ConfigProfile:
        from digenrl.models.lora import trainable_state_dict
        from digenrl.policy import text_encoders

        m = self.model
        text = sum(p.numel() for n in text_encoders(m) for p in getattr(m.pipe, n).parameters())
        state = trainable_state_dict(m, copy_tensors=False).values()
        return ConfigProfile(
            f"{self.cfg.model.name} {self.cfg.model.preset}", self.arch, self.shape, self.passes, self.passes,
            sum(p.numel() for p in self.params), float(text), 0.0, self.pass_flops, self.decode_flops,
            sum(t.numel() * t.element_size() for t in state),
            sum(p.numel() * p.element_size() for p in m.transformer.parameters()), 4 * int(np.prod(m.latent_shape)))

    def _cost_model(self) -> CostModel | None:
        from digenrl.sim.calibration import calibrated_params
        from digenrl.sim.devices import device_spec

        if self.catalog is None:
            return None
        spec = device_spec(self.catalog)
        # two devices: the all-reduce of a group of two; rollout roles: compute alone (a dedicated trainer's
        # pull of trajectory latents over the network, which the simulator adds, is not in one process)
        return CostModel(self.profile, {"a": spec, "b": spec}, calibrated_params(),  # type: ignore[arg-type]
                         {"a": Role.ROLLOUT, "b": Role.ROLLOUT})

    def _predict(self, token: Token) -> float | None:
        return self.cost.seconds(token, Device("a", Role.ROLLOUT)) if self.cost is not None else None

    def _add(self, m: Measurement) -> None:
        """Keep ``m`` with its MFU: FLOPs / (seconds x peak)."""
        if m.flops and self.peak:
            m.mfu = m.flops / (m.seconds * self.peak)
        self.results.append(m)

    # -- the measurements --------------------------------------------------------------------------
    def plan(self) -> list[Step]:
        """Every measurement as ``(label, sweep, run)``, in the order they run."""
        each = functools.partial
        steps: list[Step] = [(f"rollout step, {b} samples", "rollout step", each(self._rollout_step, b))
                             for b in _sizes(self.max_batch)]
        steps.append(("rollout start", "rollout start", self._rollout_start))
        steps += [(f"train pass, {r} rows", "train pass", each(self._train_pass, r)) for r in _sizes(self.max_rows)]
        if self.stale and self.cfg.train.check_parity:
            steps.append(("stale-batch parity", "stale-batch parity", self._parity))
        for b in _sizes(self.max_decode):
            steps += [(f"decode, {b} samples", "decode", each(self._decode, b)),
                      (f"reward score, {b} samples", "reward score", each(self._score, b))]
        steps += [("optimizer step", "optimizer step", self._optim), ("publication", "publication", self._publish)]
        if self.want_allreduce and self.device.type == "cpu":
            steps.append(("all-reduce (2 gloo processes)", "all-reduce", self._allreduce))
        return steps

    def run(self, progress: Progress | None = None) -> list[Measurement]:
        """Run :meth:`plan`'s steps; a sweep that runs out of device memory stops there (noted)."""
        steps, stopped = self.plan(), set()
        for i, (label, sweep, step) in enumerate(steps):
            if progress:
                progress(label, i, len(steps))
            if sweep in stopped:
                continue
            try:
                step()
            except torch.cuda.OutOfMemoryError:
                stopped.add(sweep)
                self.notes.append(f"{label}: out of device memory; {sweep} measured up to the size before")
                torch.cuda.empty_cache()
        if progress:
            progress("done", len(steps), len(steps))
        return self.results

    def _fresh(self, samples: int) -> Any:
        prompts, members = _geometry(samples, self.cfg.rollout.group_size)
        return self.engine.fresh([0, 0, 0, prompts, 0, members, self.cfg.rollout.group_size], 0, self.prompts)

    def _rollout_step(self, b: int) -> None:
        seconds, runs = self._time(lambda frag: self.engine.advance([frag], 0, 1), lambda: self._fresh(b))
        self._compile_note("the first rollout step")
        token = Token(0, TokenKind.ROLLOUT, "a", 0, num_samples=b, step_start=1, step_end=2)
        self._add(Measurement("rollout step", b, "samples", seconds, runs, b * self.velocity_flops, self.flops_source,
                              b * self.velocity_flops_counted, self._predict(token),
                              f"velocity x {self.passes} CFG pass(es) + SDE step"))

    def _rollout_start(self) -> None:
        g, prompts, members = self.cfg.rollout.group_size, self.sizes.fragment_groups, self.sizes.fragment_members

        def fresh(_: Any) -> None:
            self.engine._cond_cache.clear()  # a new batch's prompts are encoded again
            self.engine.fresh([0, 0, 0, prompts, 0, members, g], 0, self.prompts)

        seconds, runs = self._time(fresh)
        flops = prompts * self.profile.text_flops
        token = Token(0, TokenKind.ROLLOUT, "a", 0, num_samples=prompts * members, step_start=0, step_end=0,
                      fragments=(Fragment(0, 0, 0, prompts, 0, members, g),))
        self._add(Measurement("rollout start", prompts * members, "samples", seconds, runs, flops or None,
                              "2 x text encoder params x tokens" if flops else "", None, self._predict(token),
                              f"one fragment: {prompts} prompts encoded, initial noise"))

    def _transitions(self, rows: int) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        """``rows`` transitions of step 0 sampled by the model (one SDE step), their conditioning and advantages."""
        from digenrl.models.lora import sampling
        from digenrl.rl.rollout import TransitionBatch
        from digenrl.rl.sde import sde_step

        ro, frag = self.cfg.rollout, self._fresh(rows)
        sig = self.engine.sigmas.float().to(frag.x.device)
        s, sn = sig[0].expand(rows), sig[1].expand(rows)
        level = torch.full((rows,), ro.noise_level, device=frag.x.device)
        with sampling(self.model), torch.no_grad():
            v = self.model.velocity(frag.x, s, frag.cond)
            out = sde_step(frag.x, v, s, sn, level, kind=ro.sde)  # type: ignore[arg-type]
        assert out.log_prob is not None  # every row is stochastic (noise_level > 0)
        idx = torch.arange(rows)
        batch = TransitionBatch(idx, torch.zeros_like(idx), frag.x, out.x_next, s.clone(), sn.clone(), out.log_prob,
                                level, kind=ro.sde)  # type: ignore[arg-type]
        return batch, frag.cond, torch.randn(rows, device=frag.x.device)

    def _reference(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        from digenrl.models.lora import reference

        with reference(self.model):
            return self.model.velocity(x, sigma, cond)

    def _train_pass(self, r: int) -> None:
        from digenrl.rl.loss import LossConfig
        from digenrl.rl.tsp import packed_backward

        t = self.cfg.train
        loss = LossConfig(clip_range=t.clip_range, kl_beta=t.kl_beta, kl_kind=t.kl)  # type: ignore[arg-type]
        ref = self._reference if t.kl_beta > 0 else None
        batch, cond, adv = self._transitions(r)

        def backward() -> None:  # the trainer's _backward of one token in one pass, on-policy
            packed_backward(self.model.velocity, batch, cond, adv, loss, normalizer=1.0, ref_velocity=ref)

        try:
            seconds, runs = self._time(lambda _: backward())
            self._compile_note("the first train pass")
            counted = self._count(backward)
        finally:
            for p in self.params:
                p.grad = None
        flops = r * TRAIN_PASSES * self.velocity_flops
        note = "fwd + bwd" + (" + KL reference fwd" if ref else "") + (" + recompute" if t.grad_checkpointing else "")
        self._add(Measurement("train pass", r, "rows", seconds, runs, flops,
                              f"{self.flops_source} x {TRAIN_PASSES:g} passes a row (sim/cost.py)", counted,
                              self._predict(Token(0, TokenKind.TRAIN, "a", 0, transitions=r, packed=self.tsp)), note))

    def _parity(self) -> None:
        from digenrl.models.lora import load_trainable_state_dict, trainable_state_dict
        from digenrl.rl.tsp import parity_recompute

        batch, cond, _ = self._transitions(PARITY_ROWS)
        behaviour = trainable_state_dict(self.model)

        def recompute(_: Any) -> None:  # the trainer's _behaviour_parity: swap in, recompute, swap back
            current = trainable_state_dict(self.model)
            load_trainable_state_dict(self.model, behaviour)
            parity_recompute(self.model.velocity, batch, cond, PARITY_ROWS)
            load_trainable_state_dict(self.model, current)

        seconds, runs = self._time(recompute)
        self._add(Measurement("stale-batch parity", 1, "token", seconds, runs, PARITY_ROWS * self.velocity_flops,
                              self.flops_source, note=f"each train token of a stale batch (train.check_parity): "
                              f"{PARITY_ROWS} rows between two weight swaps; the simulator has no term"))

    def _decode(self, b: int) -> None:
        from digenrl.models import decode_in_chunks

        x = self._fresh(b).x
        with torch.no_grad():
            seconds, runs = self._time(lambda _: decode_in_chunks(self.model, x, self.cfg.rollout.decode_batch))
        flops, predicted = b * self.decode_flops, None
        if self.cost is not None:  # the cost model's decode term of a REWARD token
            predicted = flops / (self.cost.specs["a"].peak_bf16_flops * self.cost.params.mfu_rollout)
        self._add(Measurement("decode", b, "samples", seconds, runs, flops, "FlopCounterMode on this decode (as "
                              "sim/profiles.py counts the real VAE)", flops, predicted))

    def _score(self, b: int) -> None:
        with torch.no_grad():
            images, prompts = self.model.decode(self._fresh(b).x), self.prompts[:b]
        seconds, runs = self._time(lambda _: self.reward.score(images, prompts))
        self._add(Measurement("reward score", b, "samples", seconds, runs, note=(
            "the config's reward on the host; the simulator prices a reward model's FLOPs on the device "
            "(its paper profiles'), none here")))

    def _optim(self) -> None:
        t = self.cfg.train
        opt = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay,
                                eps=t.eps)

        def grads() -> None:
            for p in self.params:
                p.grad = torch.randn_like(p)

        def step(_: Any) -> None:  # TrainerActor._optim_compute of one trainer
            for p in self.params:
                p.grad.div_(128.0)  # type: ignore[union-attr]  # set by grads()
            torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            seconds, runs = self._time(step, grads)
            for p, s in zip(self.params, saved, strict=True):
                p.copy_(s)  # the bench's later rows see the weights it built
        nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self._add(Measurement("optimizer step", 1, "step", seconds, runs, predicted_s=self._predict(
            Token(0, TokenKind.OPTIM, "a", 0)), note=f"AdamW over {sum(p.numel() for p in self.params):,} params "
                                                     f"({nbytes / 2**20:.2f} MiB); memory-bound: no FLOPs"))

    def _publish(self) -> None:
        from digenrl.models.lora import trainable_state_dict
        from digenrl.roles.weights import WeightStore

        store = WeightStore(self.model)
        parts = asyncio.run(self._zmq_publish(store))

        def restage() -> int:
            version = max(store.versions) + 1  # newer than every kept one, or the store drops it
            store.stage(version, trainable_state_dict(self.model))
            return version

        load, runs = self._time(store.ensure, restage)
        nbytes = self.profile.publish_bytes
        lane = self.cfg.transport.weights
        note = (f"{nbytes / 2**20:.2f} MiB: state dict + pack_buckets + ZmqTransport send/recv (same host) + unpack "
                "+ stage + ack" + ("" if lane == "zmq" else f"; the config's lane ({lane}) needs two processes"))
        publish = parts.pop("publish")
        self._add(Measurement("publication (zmq)", 1, "version", statistics.median(publish), len(publish),
                              predicted_s=self._predict(Token(0, TokenKind.PUBLISH, "a", 0)), note=note,
                              parts={k: statistics.median(v) for k, v in parts.items()}))
        self._add(Measurement("weight load (rollout)", 1, "version", load, runs, note=(
            "WeightStore.ensure of a staged version: the first rollout token at a new version pays it")))

    async def _zmq_publish(self, store: Any) -> dict[str, list[float]]:
        """The zmq lane's publication between two endpoints of this process: phase -> seconds of each run."""
        from digenrl.models.lora import trainable_state_dict
        from digenrl.roles.weights import pack_buckets, unpack_buckets
        from digenrl.transport.zmq import ZmqTransport

        trainer, rollout = ZmqTransport(), ZmqTransport()
        parts: dict[str, list[float]] = {"pack": [], "send_receive": [], "stage": [], "publish": []}
        try:
            for version in range(1, self.repeats + 2):  # version 1: the warm-up (connections, shm segments)
                self._sync()
                t0 = time.perf_counter()
                layout, buckets = pack_buckets(trainable_state_dict(self.model), self.cfg.transport.bucket_mb)
                self._sync()
                t1 = time.perf_counter()
                await trainer.send(rollout.address, {"op": "receive_weights", "v": version}, [layout, buckets])
                msg = await rollout.recv()
                t2 = time.perf_counter()
                store.stage(version, unpack_buckets(*msg.payload))
                t3 = time.perf_counter()
                await rollout.send(trainer.address, {"op": "ack", "v": version})
                await trainer.recv()
                for key, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t0), strict=True):
                    parts[key] += [seconds] if version > 1 else []
        finally:
            await trainer.aclose()
            await rollout.aclose()
        return parts

    def _allreduce(self) -> None:
        from digenrl.recipes.measure_costs import measure_allreduce

        self.allreduce = a = measure_allreduce(self.cfg)
        self.allreduce_source = "measured: 2 gloo processes, all_reduce_buckets of the trainable set"
        predicted = self.cost.allreduce_seconds(("a", "b")) if self.cost is not None else None
        self._add(Measurement("all-reduce (2 trainers)", 1, "step", a.seconds(2), 30, predicted_s=predicted,
                              note=f"{a.nbytes / 2**20:.2f} MiB; latency and bandwidth from two sizes"))

    # -- the costs file ----------------------------------------------------------------------------
    def _fit(self, kind: str) -> tuple[float, float, float] | None:
        points = [(m.size, m.seconds) for m in self.results if m.kind == kind]
        return fit_line(points) if points else None

    def _one(self, kind: str, not_measured: dict[str, str]) -> float:
        seconds = next((m.seconds for m in self.results if m.kind == kind), None)
        if seconds is None:
            not_measured[kind] = "out of device memory: 0 charged"
        return seconds or 0.0

    def costs(self) -> tuple[MeasuredCost, str, dict[str, str]]:
        """The plan costs fitted to the rows (their notes are what the planner prints), where the all-reduce
        comes from, and what was not measured with what is charged instead.

        Raises:
            RuntimeError: the rollout sweep measured nothing (out of memory at one sample).
        """
        notes = [f"from `{SOURCE}` (one process on {self.cfg.model.device}, {self.cfg.model.name} "
                 f"{self.cfg.model.preset}): fits of its sweeps, relative least squares"]
        not_measured = {
            "dispatch_s": "the per-token overhead between actors (the call's trip, the coordinator's handling) "
                          "needs actor processes: 0 charged; `bench bubbles --real` measures it on a CPU",
            "contention": "how busy processes on one host slow each other: none applied (each device owns its "
                          "compute, as on a GPU fleet); `bench bubbles --real` measures it for CPU actors",
            "placement_error": "the simulator's error on the ratio of two splits needs real runs: plan "
                               "--tolerance defaults to 0"}
        step = self._fit("rollout step")
        if step is None:
            raise RuntimeError("the rollout sweep measured nothing (out of device memory at one sample)")
        fits = {"rollout": (self._one("rollout start", not_measured), step[1])}
        notes.append(f"rollout step: {step[0] * 1e3:.3f} ms/step + {step[1] * 1e3:.4f} ms/sample-step (largest "
                     f"relative residual {step[2]:.0%}); a token's overhead: one fragment's start")
        for kind, name in (("train", "train pass"), ("decode", "decode"), ("score", "reward score")):
            if (fit := self._fit(name)) is not None:
                fits[kind] = (fit[0], fit[1])
                notes.append(f"{name}: {fit[0] * 1e3:.3f} ms + {fit[1] * 1e3:.4f} ms/unit (largest relative "
                             f"residual {fit[2]:.0%})")
            else:
                not_measured[name] = "out of device memory: 0 charged"
        decode, score = fits.pop("decode", (0.0, 0.0)), fits.pop("score", (0.0, 0.0))
        fits["reward"] = (decode[0] + score[0], decode[1] + score[1])  # a REWARD token decodes, then scores
        fits.setdefault("train", (0.0, 0.0))
        if self.stale and self.cfg.train.check_parity:
            fits["train"] = (fits["train"][0] + self._one("stale-batch parity", not_measured), fits["train"][1])
            notes.append("train: each token's overhead includes a stale batch's parity recompute")
        fits["optim"] = (self._one("optimizer step", not_measured), 0.0)
        fits["publish"] = (self._one("publication (zmq)", not_measured), 0.0)
        allreduce, source = self.allreduce, self.allreduce_source
        if allreduce is None:
            why = "on a GPU the trainers' NCCL all-reduce is not measured" if self.device.type == "cuda" \
                else "--no-allreduce"
            allreduce, source = catalog_allreduce(sum(p.numel() * p.element_size() for p in self.params),
                                                  self.catalog or "measured", why)
            not_measured["allreduce"] = source
        else:
            notes.append(f"allreduce: {source}")
        notes += [f"not measured: {k}: {v}" for k, v in not_measured.items()] + self.notes
        return MeasuredCost(fits, 0.0, allreduce, None, step[0], tuple(notes)), source, not_measured

    def report(self) -> dict[str, Any]:
        """The rows (``testbed``: the catalog device they price) and the costs file's ``calibration``."""
        from digenrl.sim.calibration import calibrated_params

        cost, source, not_measured = self.costs()
        calibration = cost.to_calibration()
        calibration["allreduce"]["source"] = source
        calibration.update(source=SOURCE, not_measured=not_measured, device=self.catalog,
                           sizes={"fragment_samples": self.fragment, "rollout_batch": self.sizes.rollout_batch,
                                  "train_pack": self.sizes.train_pack})
        m, params = self.cfg.model, calibrated_params()
        model = f"{m.name}-{m.preset}"
        return {
            "bench": "tokens", "train_passes": TRAIN_PASSES,
            "model": {"name": m.name, "preset": m.preset, "dtype": m.dtype, "device": m.device,
                      "threads": torch.get_num_threads() if self.device.type == "cpu" else None,
                      "cfg_passes": self.passes, "shape": asdict(self.shape), "pass_flops": self.pass_flops,
                      "decode_flops": self.decode_flops, "trainable_params": self.profile.trainable_params},
            "peak": {"flops_per_s": self.peak, "source": self.peak_source},
            "prediction": {"catalog_device": self.catalog, "mfu_rollout": params.mfu_rollout,
                           "mfu_train": params.mfu_train, "pass_latency_s": params.pass_latency_s,
                           "profile": "the config's model as built (transformer, resolution, CFG, trainable set) "
                                      "priced by sim/cost.py CostModel with the calibrated parameters"},
            "rows": [{**r.to_json(), "testbed": self.catalog, "model": model} for r in self.results],
            "calibration": calibration,
        }


def run_token_bench(cfg: Config, *, max_batch: int = 0, max_rows: int = 0, repeats: int = 5, allreduce: bool = True,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Measure every token of ``cfg`` on its device (see the module docstring); returns the report.

    On a CPU the process runs ``placement.actor_threads`` torch threads meanwhile (restored after).
    """
    threads = torch.get_num_threads()
    if cfg.model.device == "cpu":
        torch.set_num_threads(cfg.placement.actor_threads)
    try:
        bench = TokenBench(cfg, max_batch=max_batch, max_rows=max_rows, repeats=repeats, allreduce=allreduce)
        bench.run(progress)
        if cfg.model.compile:  # what was compiled: a pass that ran eager (a graph break, a skipped frame) shows here
            from torch._dynamo.utils import counters

            bench.notes.append(f"model.compile = {cfg.model.compile!r}: {counters['stats']['unique_graphs']} graph(s) "
                               f"compiled, {counters['aot_autograd']['total']} with autograd; graph breaks "
                               f"{sum(counters['graph_break'].values())}")
        return bench.report()
    finally:
        torch.set_num_threads(threads)
