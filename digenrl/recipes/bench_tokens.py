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

The measurements themselves are in ``_token_measurements.py``, the costs file and the report in
``_token_costs.py``; this module holds the bench they share.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from digenrl.config import Config
from digenrl.recipes._token_costs import catalog_allreduce, fit_line, token_costs, token_report
from digenrl.recipes._token_measurements import Measurement, Step, token_steps
from digenrl.schedule.base import Device, Role, Token
from digenrl.sim.cost import CostModel
from digenrl.sim.flops import SampleShape, forward_flops
from digenrl.sim.measured import AllReduce, MeasuredCost

__all__ = ["Measurement", "ConfigProfile", "TokenBench", "run_token_bench", "fit_line", "catalog_allreduce"]

Progress = Callable[[str, int, int], None]  # (what is measured now, done, total)


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
    reward_flops: float  # the config's learned reward models per sample (0: host rewards, sim/reward_models.py)
    forward_flops: int
    decode_flops: int
    publish_bytes: int
    weight_bytes: int
    latent_bytes: int

    @property
    def text_flops(self) -> float:
        return 2.0 * self.text_encoder_params * self.shape.text_tokens



def _geometry(samples: int, group: int) -> tuple[int, int]:
    """(prompts, members per prompt) of a fragment of ``samples``: the most members that divide it."""
    members = next(m for m in range(min(samples, group), 0, -1) if samples % m == 0)
    return samples // members, members


class TokenBench:
    """The measurements of one config (see the module docstring); :meth:`run` executes them in order.

    The bench builds the model once and holds what every measurement uses (``_token_measurements.py``): the
    harness (:meth:`timed`, :meth:`count_flops`, :meth:`fresh`, :meth:`predict`, :meth:`add`) and the model as
    the simulator sees it (FLOPs a sample, the peak for MFU, its profile and cost model).

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
        self.reward = build_reward(r.weights, **r.build_options(cfg.model.device))
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

    # -- the harness: timing, FLOP counting ------------------------------------------------------
    def sync(self) -> None:
        """Wait for the device (CUDA); a CPU has run everything already."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> tuple[float, int]:
        """Median seconds of ``fn(setup())`` over up to ``repeats`` runs after one warm-up; the setup untimed."""
        times: list[float] = []
        for i in range(self.repeats + 1):
            arg = setup() if setup else None
            self.sync()
            start = time.perf_counter()
            fn(arg)
            self.sync()
            if i:  # run 0 is the warm-up (allocations, kernel selection, lazy state)
                times.append(time.perf_counter() - start)
            else:
                self.warmup_s = time.perf_counter() - start  # with model.compile: the shape's compile, once a process
            if len(times) >= 2 and sum(times) > 2.0:  # a slow shape: two runs suffice for a median
                break
        return statistics.median(times), len(times)

    def note_compile(self, label: str) -> None:
        """With ``model.compile``: the seconds of ``label``'s warm-up run, which compiled its graph (a process pays
        it once per graph, less when the kernels are in the compile cache already; later shapes recompile little)."""
        if self.cfg.model.compile and label not in self._compiled:
            self._compiled.add(label)
            self.notes.append(f"model.compile = {self.cfg.model.compile!r}: {label} took {self.warmup_s:.2f} s "
                              "(compile and one run)")

    def count_flops(self, fn: Callable[[], Any]) -> int:
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

        m, frag = self.model, self.fresh(1)
        sigma = self.engine.sigmas[:1].float().to(frag.x.device)
        rows: list[int] = []  # samples through the transformer per velocity call: its CFG passes

        def seen(_module: Any, args: Any, kwargs: Any) -> None:
            rows.append(int(kwargs.get("hidden_states", args[0] if args else None).shape[0]))

        with sampling(m), torch.no_grad():
            # The model's first call, plain (before the hook): with model.compile it compiles the sampling graph.
            self.sync()
            start = time.perf_counter()
            m.velocity(frag.x, sigma, frag.cond)
            self.sync()
            self.warmup_s = time.perf_counter() - start
            self.note_compile("the first velocity call")
            hook = m.transformer.register_forward_pre_hook(seen, with_kwargs=True)
            try:
                self.velocity_flops_counted = self.count_flops(lambda: m.velocity(frag.x, sigma, frag.cond))
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
            self.decode_flops = self.count_flops(lambda: m.decode(frag.x))

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
        seconds, _ = self.timed(lambda _: a @ a)
        return 2.0 * size**3 / seconds, (f"measured here: {str(dtype).removeprefix('torch.')} matmul {size}^3 at "
                                         f"{torch.get_num_threads()} thread(s), a CPU has no catalog entry; "
                                         "oneDNN's convolutions can beat it: a VAE's MFU may pass 100%"), "measured"

    def _profile(self) -> ConfigProfile:
        from digenrl.models.lora import trainable_state_dict
        from digenrl.policy import text_encoders
        from digenrl.sim.reward_models import reward_flops

        m = self.model
        text = sum(p.numel() for n in text_encoders(m) for p in getattr(m.pipe, n).parameters())
        state = trainable_state_dict(m, copy_tensors=False).values()
        return ConfigProfile(
            f"{self.cfg.model.name} {self.cfg.model.preset}", self.arch, self.shape, self.passes, self.passes,
            sum(p.numel() for p in self.params), float(text), reward_flops(self.cfg.reward), self.pass_flops,
            self.decode_flops,
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

    def predict(self, token: Token) -> float | None:
        """The simulator's seconds of ``token`` on the catalog device (None: no catalog entry)."""
        return self.cost.seconds(token, Device("a", Role.ROLLOUT)) if self.cost is not None else None

    def add(self, m: Measurement) -> None:
        """Keep ``m`` with its MFU: FLOPs / (seconds x peak)."""
        if m.flops and self.peak:
            m.mfu = m.flops / (m.seconds * self.peak)
        self.results.append(m)

    # -- running the measurements ----------------------------------------------------------------
    def fresh(self, samples: int) -> Any:
        """A fresh fragment of ``samples`` (step 0, the bench's prompts): what a measurement starts from."""
        prompts, members = _geometry(samples, self.cfg.rollout.group_size)
        return self.engine.fresh([0, 0, 0, prompts, 0, members, self.cfg.rollout.group_size], 0, self.prompts)

    def plan(self) -> list[Step]:
        """Every measurement as ``(label, sweep, run)``, in the order they run."""
        return token_steps(self)

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

    # -- the costs file ----------------------------------------------------------------------------
    def costs(self) -> tuple[MeasuredCost, str, dict[str, str]]:
        """The plan costs fitted to the rows (their notes are what the planner prints), where the all-reduce
        comes from, and what was not measured with what is charged instead.

        Raises:
            RuntimeError: the rollout sweep measured nothing (out of memory at one sample).
        """
        return token_costs(self)

    def report(self) -> dict[str, Any]:
        """The rows (``testbed``: the catalog device they price) and the costs file's ``calibration``."""
        return token_report(self)


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
