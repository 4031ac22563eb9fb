"""The harness of ``digenrl bench tokens`` (``bench_tokens.py``): the config's model built once, timed and counted.

:class:`TokenBench` holds what every measurement uses: the model as a TAG trainer holds it (it trains, and with a
forward-process algorithm keeps its slow copy), the rollout's engine (a rollout actor's: it samples with the
published weights), the reward and the trainable set; the harness (:meth:`~TokenBench.timed`,
:meth:`~TokenBench.count_flops`, :meth:`~TokenBench.fresh`, :meth:`~TokenBench.predict`, :meth:`~TokenBench.add`);
and the model as the simulator sees it (FLOPs a sample, the no-grad forwards of a training row, the peak for MFU,
its profile and cost model). :class:`Measurement` is one measured token shape.

The measurements (``_token_measurements.py``) and the costs file (``_token_costs.py``) build on this module, and
``bench_tokens.py`` on all three: each imports only the ones below it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from digenrl.config import Config
from digenrl.schedule.base import Device, Role, Token
from digenrl.sim.cost import CostModel
from digenrl.sim.flops import SampleShape, forward_flops
from digenrl.sim.measured import AllReduce
from digenrl.sim.profiles import RowCost, clean_sample_rows
from digenrl.sim.window import SlidingWindow

__all__ = ["Measurement", "ConfigProfile", "TokenBench", "Progress"]

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


Progress = Callable[[str, int, int], None]  # (what is measured now, done, total)


@dataclass(frozen=True)
class ConfigProfile:
    """The cost model's view of the config's model as built; ``CostModel`` reads these attributes as it
    reads a paper model's ``sim.profiles.ModelProfile``: per sample, one transformer pass and the passes
    per velocity (CFG), the decode, the text encoder; bytes of the trainable set, weights, a latent and a
    sample's conditioning; what the algorithm adds per row and ships per sample (``rows``, measured)."""

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
    cond_bytes: int
    rows: RowCost
    window: SlidingWindow | None = None  # MixGRPO's moving window: its rollout forwards change with the version

    @property
    def text_flops(self) -> float:
        return 2.0 * self.text_encoder_params * self.shape.text_tokens


def _geometry(samples: int, group: int) -> tuple[int, int]:
    """(prompts, members per prompt) of a fragment of ``samples``: the most members that divide it."""
    members = next(m for m in range(min(samples, group), 0, -1) if samples % m == 0)
    return samples // members, members


class TokenBench:
    """What the measurements of one config share (the module docstring; ``bench_tokens.run_steps`` runs them).

    The bench builds the model once and holds what every measurement uses (``_token_measurements.py``): the
    harness (:meth:`timed`, :meth:`count_flops`, :meth:`fresh`, :meth:`train_rows`, :meth:`predict`, :meth:`add`)
    and the model as the simulator sees it (FLOPs a sample, the no-grad forwards a training row runs, the peak for
    MFU, its profile and cost model).

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
        self.nograd_forwards = self._row_forwards()
        self.peak, self.peak_source, self.catalog = self._peak()
        self.profile = self._profile()
        self.cost = self._cost_model()

    def _build(self) -> None:
        """The model as a TAG trainer holds it (trains, samples, decodes; its algorithm's slow copy), the rollout's
        engine (a rollout actor's: it samples with the weights it was sent) and the reward."""
        from digenrl.algorithms import algorithm_for
        from digenrl.models.lora import trainable_parameters
        from digenrl.policy import build_model, prepare_for_training
        from digenrl.rewards import build_reward
        from digenrl.rewards.user import allow_user_rewards
        from digenrl.roles.fragments import FragmentEngine

        cfg, r = self.cfg, self.cfg.reward
        allow_user_rewards(r.models)  # the bench's own config
        torch.manual_seed(cfg.log.seed)
        self.model: Any = build_model(cfg)[0]
        prepare_for_training(self.model, cfg, generates=True)
        self.params = trainable_parameters(self.model)
        self.reward = build_reward(r.weights, **r.build_options(cfg.model.device))
        self.algorithm = algorithm_for(cfg, self.model, trains=True)
        self.engine = FragmentEngine(cfg, self.model, self.reward)

    def _sizes_of_tokens(self, max_batch: int, max_rows: int) -> None:
        """The config's token sizes (as its schedule resolves them) and the sweeps' caps."""
        from digenrl.policy import trained_steps
        from digenrl.schedule.base import Workload
        from digenrl.schedule.options import PRESETS, resolve, with_overrides

        ro, place, preset = self.cfg.rollout, self.cfg.placement, PRESETS[self.cfg.schedule.name]
        self.tsp, self.stale = preset.tsp, max(preset.staleness, self.cfg.schedule.staleness)
        self.rows_per_sample = trained_steps(self.cfg)
        work = Workload(1, ro.prompts_per_batch, ro.group_size, ro.num_steps, self.rows_per_sample)
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

        m, frag = self.model, self.fresh(1)
        text = sum(p.numel() for n in text_encoders(m) for p in getattr(m.pipe, n).parameters())
        state = trainable_state_dict(m, copy_tensors=False).values()
        cond = sum(t.numel() * t.element_size() for t in frag.cond.values())
        coupled = self.algorithm.coupled
        rows = RowCost(self.nograd_forwards) if coupled else clean_sample_rows(self.nograd_forwards)
        window = self.algorithm.rollout_window(self.cfg)  # MixGRPO's, priced per version
        return ConfigProfile(
            f"{self.cfg.model.name} {self.cfg.model.preset}", self.arch, self.shape, self.passes, self.passes,
            sum(p.numel() for p in self.params), float(text), reward_flops(self.cfg.reward), self.pass_flops,
            self.decode_flops,
            sum(t.numel() * t.element_size() for t in state),
            sum(p.numel() * p.element_size() for p in m.transformer.parameters()), 4 * int(np.prod(m.latent_shape)),
            cond, rows, window if isinstance(window, SlidingWindow) else None)

    # -- a training row ------------------------------------------------------------------------------
    def train_rows(self, rows: int) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        """``rows`` training rows of the config's algorithm as its trainer gets them, their samples' conditioning
        and advantages: Flow-GRPO's transitions of step 0 sampled by one SDE step of the model (real shapes and
        log-probs); a forward-process method's rows of the clean samples the rollout's ODE made (``token_rows``:
        the levels and fresh noise the trainer draws)."""
        if self.algorithm.coupled:
            return self._transitions(rows)
        samples = -(-rows // self.rows_per_sample)
        frag = self.fresh(samples)
        with torch.no_grad():
            self.engine.advance([frag], 0, self.cfg.rollout.num_steps)
        batch = self.algorithm.token_rows(frag.transitions(), (0, rows), torch.ones(samples, dtype=torch.bool), 0,
                                          frag.sample_ids(), 0)
        return batch, frag.cond, torch.randn(samples, device=frag.x.device)

    def _transitions(self, rows: int) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        from digenrl.models.lora import sampling
        from digenrl.rl.rollout import TransitionBatch
        from digenrl.rl.sde import sde_step

        ro, frag = self.cfg.rollout, self.fresh(rows)
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

    def trained_version(self, batch: Any) -> int:
        """The trainer's version for a token of ``batch``: one ahead under a one-step-stale schedule (its tokens
        are then stale: no on-policy parity pass, AWM's ratio against its EMA policy), else the batch's own."""
        return batch.policy_version + (1 if self.stale else 0)

    def backward(self, batch: Any, cond: dict[str, torch.Tensor], adv: torch.Tensor) -> Any:
        """The trainer's ``_backward`` of one token in one packed pass (gradients accumulate)."""
        from digenrl.algorithms import Backward

        return self.algorithm.backward(batch, cond, adv, Backward("packed", None), version=self.trained_version(batch))

    def _row_forwards(self, rows: int = 2) -> float:
        """Velocity calls without gradient per training row, counted on one token's pass (the reference, an old
        or EMA policy's velocity; one velocity call = ``passes`` transformer passes)."""
        batch, cond, adv = self.train_rows(rows)
        counted = {True: 0, False: 0}
        velocity = self.model.velocity

        def counting(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            counted[torch.is_grad_enabled()] += int(x.shape[0])
            return velocity(x, *args, **kwargs)

        self.model.velocity = counting
        try:
            self.backward(batch, cond, adv)
        finally:
            del self.model.velocity  # the instance attribute: the method again
            for p in self.params:
                p.grad = None
        return counted[False] / max(1, counted[True])

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

