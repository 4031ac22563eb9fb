"""The memory plan: what each role holds on each of its devices, and whether it fits.

``memory_plan(cfg)`` builds the configured model on the meta device (preset ``pretrained``, ``full`` or
``random``: the published architecture at real size, ``models/full.py``; ``tiny``/``small``: that preset) and
counts, per role:

* weights: the transformer in ``model.dtype`` (trainers: divided over the group under FSDP, plus a
  frozen reference copy for full fine-tuning with the algorithm's KL term; FSDP also gathers two blocks at a time);
* slow copy (DiffusionNFT's old policy, AWM's EMA policy; ``plan/rows.py``): every trainer keeps a second copy of
  the trained weights in their own dtype, a second LoRA adapter or (``model.finetune = "full"``) a second
  transformer (divided over the group under FSDP: each member its shards);
* trainable: LoRA (``r·(in + out)`` per targeted linear) or every transformer parameter, in
  ``model.dtype`` for LoRA plus an fp32 master copy when ``train.fp32_master`` and the model is not fp32;
* gradients (fp32 with ``train.fp32_master``, else the model dtype) and Adam's two fp32 moments;
* activations: the peak of one forward + backward of ``rows_per_pass`` rows (both CFG branches where the
  model runs them), **traced** at the real dimensions on the meta device (``plan/trace.py``: every
  tensor an operator creates, attention as a fused kernel keeps it, depth extrapolated from two- and
  three-block copies), plus the fp32 velocities of the loss's no-grad forwards (old policy, reference, EMA)
  held through it; a slow copy's forward also holds the trained weights it swapped out (``PolicyCopy.active``
  clones them) beside that forward's own peak; rollout devices: the peak of one no-grad forward of a rollout
  token's samples, or of decoding one fragment, whichever is larger;
* Wan2.2 A14B's two experts (``transformer`` and ``transformer_2``, 14 B each): every role that runs the
  policy holds both, unless ``model.expert_offload``: then the idle expert's frozen weights wait in host
  memory (``host (offloaded)``) and one expert is on the device at a time; trained weights (LoRA, a fully
  fine-tuned expert) never move. LoRA, gradients and Adam states count every trained expert
  (``model.train_experts``); activations are one expert's (a pass never mixes experts);
* the VAE where decoding happens (rollout devices; trainers too when they generate, TAG) and the text
  encoders there unless ``model.offload_text_encoder`` (then they sit in host memory between uses);
* the learned reward models (``sim/reward_models.py``: CLIP-L for ``clipscore`` / ``aesthetic``, CLIP-H for
  ``pickscore`` / ``hpsv2``; read from the model directory's ``config.json`` when there is one, else the
  published size, which the notes say) in ``reward.dtype`` (``""``: bf16 on CUDA, fp32 elsewhere, as the
  rewards resolve it), plus the activations of one scoring forward (``batch_size`` images of a fragment; the
  colocated loop scores its whole batch) where scoring happens: on the reward actors with
  ``placement.reward >= 1``; otherwise on whoever holds the finished latents, the rollout actors and the
  trainers that generate (TAG), or the colocated device. ``reward.device = "cpu"`` keeps them in host memory
  instead. Rewards scored on the host or on a server hold nothing here. Every generating actor builds the
  reward in its setup, so beside reward actors the rollout actors and TAG trainers hold an unused copy (no
  activations), which the plan counts as it is.
  A reward actor also builds the frozen policy (``RewardActor`` sets up the whole pipeline for its VAE),
  which the plan counts as it is.

The device is ``placement.gpu`` (the simulator's catalog) when ``model.device`` is CUDA, else this
host's memory. ``RESERVE_BYTES`` per device is kept back for the CUDA context and allocator slack.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from digenrl.config import Config
from digenrl.errors import ConfigError
from digenrl.plan.rows import Boundary, boundary, kl_beta, latent_bytes, nograd_forwards, slow_copies
from digenrl.plan.sequence import activation_share, fitting_sp

__all__ = ["SharedGpu", "planned_vs_measured", "RESERVE_BYTES", "RoleMemory", "RewardModelMemory", "MemoryPlan", "memory_plan", "check_memory", "memory_problems", "device_capacity"]

GB = 1e9
RESERVE_BYTES = int(2 * GB)  # CUDA context (~0.5 GB) + caching-allocator fragmentation
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TEXT_LEN = {"qwenimage": 512, "qwenimage_edit": 1536, "flux": 512, "wan21": 512, "wan22": 512, "hunyuanvideo": 256,
             "sd3": 128}  # the adapters' pretrained defaults (SD3.5: T5 tokens, after its 77 CLIP tokens)
ACTIVATIONS_METHOD = ("traced: peak live bytes of one forward+backward on the meta device at the real "
                      "dimensions (attention as a fused kernel), depth extrapolated from 2- and 3-block copies")


@dataclass
class RoleMemory:
    """One role on one of its devices (bytes unless named ``*_params``)."""

    role: str
    devices: int
    device: str = ""  # the device type it runs on
    weights: int = 0
    reference: int = 0
    slow_copy: int = 0  # the old / EMA policy's copy of the trained weights (forward-process algorithms)
    trainable_params: int = 0
    trainable: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    vae: int = 0
    text_encoders: int = 0
    reward_models: int = 0  # the learned reward models' weights where this role scores
    host_bytes: int = 0  # offloaded text encoders (and reward models under reward.device = "cpu"), in host memory
    capacity: int = 0
    notes: list[str] = field(default_factory=list)
    sp: int = 1  # devices per actor: a sequence-parallel group (``devices`` counts them all)

    @property
    def bytes_per_device(self) -> int:
        return (self.weights + self.reference + self.slow_copy + self.trainable + self.grads + self.optimizer
                + self.activations + self.vae + self.text_encoders + self.reward_models)

    @property
    def headroom(self) -> int:
        return self.capacity - RESERVE_BYTES - self.bytes_per_device

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_device": self.bytes_per_device, "headroom": self.headroom, "fits": self.fits}


@dataclass
class MemoryPlan:
    """Every role's footprint for one config."""

    model: str
    variant: str
    preset: str
    device: str
    capacity: int
    shard: str
    transformer_params: int
    text_encoder_params: int
    vae_params: int
    rows_per_pass: int
    activations: str
    roles: dict[str, RoleMemory]
    # what the activations scale with: bytes per training row and the row-independent part, per role
    train_row_bytes: int = 0
    train_activations: int = 0  # of one training pass (a role's activations may be its rollout peak instead)
    train_peak: int = 0  # the trainer's pass with the loss's no-grad forwards (``_loss_passes``), >= train_activations
    rollout_forward: int = 0  # one no-grad forward of a rollout token's samples
    decode_sample: int = 0  # decoding one sample (rollout.decode_batch of them at once)
    decode_samples: int = 0  # samples decoded at once now
    shared: list[SharedGpu] = field(default_factory=list)  # GPUs that several actors share (placement.actors_per_gpu)
    rewards: list[RewardModelMemory] = field(default_factory=list)  # the weighted rewards' models, where they score
    # a second expert (Wan2.2 A14B's transformer_2; transformer_params is then one expert's): its parameters,
    # and whether the idle expert waits in host memory (model.expert_offload)
    expert_params: int = 0
    expert_offload: bool = False
    boundary: Boundary | None = None  # bytes a sample moves from the rollout to the trainer (plan/rows.py)
    traces: Traces | None = field(default=None, repr=False, compare=False)  # what priced the activations (reused)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.roles.values()) and all(g.fits for g in self.shared)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {"name": self.model, "variant": self.variant, "preset": self.preset,
                      "transformer_params": self.transformer_params, "text_encoder_params": self.text_encoder_params,
                      "expert_params": self.expert_params, "expert_offload": self.expert_offload,
                      "vae_params": self.vae_params},
            "device": {"type": self.device, "capacity_bytes": self.capacity, "reserve_bytes": RESERVE_BYTES},
            "train": {"shard": self.shard, "rows_per_pass": self.rows_per_pass},
            "activations": self.activations,
            "roles": {name: r.to_json() for name, r in self.roles.items()},
            "reward_models": [asdict(m) for m in self.rewards],
            **({"shared_gpus": [g.to_json() for g in self.shared]} if self.shared else {}),
            **({"boundary": self.boundary.to_json()} if self.boundary else {}),
            "fits": self.fits,
        }


@dataclass
class RewardModelMemory:
    """One weighted reward's model as the plan counts it (bytes; ``source``: its ``config.json`` or the
    published size)."""

    reward: str
    arch: str
    params: int
    dtype: str
    weights: int
    activations: int  # scoring ``batch`` samples
    batch: int
    source: str
    where: str  # the roles that score, or "host"

    def note(self) -> str:
        return (f"reward model {self.reward}: {self.arch}, {self.params / 1e6:.1f} M params x "
                f"{self.weights // max(1, self.params)} B ({self.dtype}) = {self.weights / GB:.2f} GB, scoring "
                f"{self.batch} samples {self.activations / GB:.2f} GB of activations; {self.source}")


@dataclass
class SharedGpu:
    """One GPU that several actor processes share: what they hold there together.

    Each process pays its own CUDA context and allocator slack (``RESERVE_BYTES``).
    """

    gpu: int
    roles: list[str]
    bytes: int  # the sum of the roles' bytes per device
    capacity: int
    device: str

    @property
    def headroom(self) -> int:
        return self.capacity - len(self.roles) * RESERVE_BYTES - self.bytes

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "headroom": self.headroom, "fits": self.fits}


def device_capacity(cfg: Config, role: str = "trainer") -> tuple[str, int]:
    """(device type, bytes per device) of ``role``: ``placement.gpu`` (``rollout_gpu`` for rollout actors
    when set) on CUDA, this host's memory on CPU."""
    if cfg.model.device.startswith("cuda"):
        from digenrl.sim.devices import device_spec

        gpu = cfg.placement.rollout_gpu if role == "rollout" and cfg.placement.rollout_gpu else cfg.placement.gpu
        return gpu, int(device_spec(gpu).memory_bytes)
    return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _components(cfg: Config, dtype: torch.dtype) -> Any:
    m = cfg.model
    return _build_components(m.name, m.variant, m.preset, m.seed, dtype, m.layers, m.text_encoder)


@functools.lru_cache(maxsize=4)
def _build_components(name: str, variant: str, preset: str, seed: int, dtype: torch.dtype, layers: int = 0,
                      text_encoder: str = "model") -> Any:
    """The model's parts on the meta device (cached: a plan search asks for them per candidate).

    ``random`` is the published architecture, as ``pretrained`` and ``full``: the same plan, less the text
    encoders under ``model.text_encoder = "random-embeds"``, with the blocks ``model.layers`` keeps.
    """
    from digenrl.models.full import FullModel, build_full, cast_quietly

    if preset in ("pretrained", "full", "random"):
        return build_full(name, variant, dtype, layers=layers, text_encoders=text_encoder == "model")
    import importlib

    module = {"wan21": "wan", "hunyuanvideo": "hunyuan"}.get(name, name)  # the adapter's module
    builder = getattr(importlib.import_module(f"digenrl.models.{module}"), f"build_{module}_pipeline")
    # a tiny preset builds in moments; then only its shapes are kept
    pipe = builder(preset, seed, variant) if name == "wan22" else builder(preset, seed)  # qwenimage_edit: "edit"
    texts = {k: getattr(pipe, k) for k in ("text_encoder", "text_encoder_2", "text_encoder_3")
             if getattr(pipe, k, None) is not None}
    second = getattr(pipe, "transformer_2", None)
    for part in (pipe.transformer, pipe.vae, *texts.values(), *([second] if second is not None else [])):
        cast_quietly(part.to("meta"), dtype)
    return FullModel(name, preset, pipe.transformer, pipe.vae, texts, second)


def _counts(module: torch.nn.Module) -> dict[Any, int]:
    """Counts memoised on the module itself (walking a 20 B meta model's parameters takes a while)."""
    if "_digenrl_counts" not in module.__dict__:
        module.__dict__["_digenrl_counts"] = {}
    return module.__dict__["_digenrl_counts"]


def _numel(module: torch.nn.Module) -> int:
    memo = _counts(module)
    if "numel" not in memo:
        memo["numel"] = sum(p.numel() for p in module.parameters())
    return memo["numel"]


def lora_params(cfg: Config, transformer: torch.nn.Module) -> int:
    """Parameters peft's LoRA adds: ``r·(in + out)`` per targeted linear layer (models/lora.py's targets)."""
    from digenrl.models.lora import DEFAULT_LORA_TARGETS

    targets = cfg.model.lora_targets or list(DEFAULT_LORA_TARGETS[cfg.model.name])
    key, memo = ("lora", cfg.model.lora_rank, tuple(targets)), _counts(transformer)
    if key in memo:
        return memo[key]
    total = 0
    for name, mod in transformer.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += cfg.model.lora_rank * (mod.in_features + mod.out_features)
    memo[key] = total
    return total


def _largest_block(transformer: torch.nn.Module) -> int:
    blocks = [b for lst in transformer.children() if isinstance(lst, torch.nn.ModuleList) for b in lst]
    return max((_numel(b) for b in blocks), default=0)


def _sizes(cfg: Config) -> tuple[int, int]:
    """(rows of one training pass on one trainer, samples of one rollout token) as the schedule resolves them."""
    from digenrl.policy import trained_steps
    from digenrl.schedule.base import Workload
    from digenrl.schedule.options import PRESETS, resolve, with_overrides

    ro, place = cfg.rollout, cfg.placement
    w = Workload(1, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    opts = with_overrides(PRESETS[cfg.schedule.name], cfg.schedule_options)
    colocated = cfg.schedule.name == "colocated"
    n_train = 1 if colocated else place.trainer
    # colocated-tsp: every trainer is a hybrid that samples its share (the schedule resolves over them all)
    n_roll = 1 if colocated else n_train if opts.colocated else max(1, place.rollout)
    sizes = resolve(opts, w, n_roll, n_train)
    rows = cfg.train.rows_per_pass or math.ceil(w.rows_per_batch / n_train)
    # the colocated loop (recipes/colocated.py) samples and decodes the whole batch at once
    return rows, w.samples_per_batch if colocated else sizes.rollout_batch


def _score_batch(cfg: Config) -> int:
    """Samples one reward call scores: a fragment (a REWARD token scores its fragments one at a time); the
    colocated loop scores its whole batch at once (each learned reward then forwards ``batch_size`` at a time)."""
    from digenrl.policy import trained_steps
    from digenrl.schedule.base import Workload
    from digenrl.schedule.options import PRESETS, resolve, with_overrides

    ro, place = cfg.rollout, cfg.placement
    w = Workload(1, ro.prompts_per_batch, ro.group_size, ro.num_steps, trained_steps(cfg))
    if cfg.schedule.name == "colocated":
        return w.samples_per_batch
    opts = with_overrides(PRESETS[cfg.schedule.name], cfg.schedule_options)
    sizes = resolve(opts, w, place.trainer if opts.colocated else max(1, place.rollout), place.trainer)
    return min(w.samples_per_batch, sizes.fragment_groups * sizes.fragment_members)


def _reward_models(cfg: Config, where: str) -> list[RewardModelMemory]:
    """The weighted rewards' models of ``cfg`` (``sim/reward_models.py``) in ``reward.dtype``, with the
    activations of one scoring forward."""
    from digenrl.sim.reward_models import reward_models, score_batch

    r = cfg.reward
    # reward.dtype "" is bf16 on CUDA and fp32 elsewhere (rewards/_learned.py resolve_dtype)
    dtype_name = r.dtype or ("bfloat16" if (r.device or cfg.model.device).startswith("cuda") else "float32")
    nbytes = torch.finfo(_DTYPES[dtype_name]).bits // 8
    samples = _score_batch(cfg)
    out = []
    for m in reward_models(r):
        batch = min(samples, score_batch(r, m.reward))
        out.append(RewardModelMemory(m.reward, m.spec.arch, m.params, dtype_name, m.params * nbytes,
                                     m.spec.activation_bytes(batch, nbytes), batch, m.source, where))
    return out


def _reward_notes(cfg: Config) -> list[str]:
    """The weighted rewards that hold nothing on the devices, and where they run."""
    from digenrl.sim.reward_models import OFF_DEVICE

    return [f"reward {name}: {OFF_DEVICE[name]}, nothing on the devices"
            for name, w in cfg.reward.weights.items() if w and name in OFF_DEVICE]


def _place_rewards(cfg: Config, roles: dict[str, RoleMemory]) -> list[RewardModelMemory]:
    """Add the reward models to the roles that score (see the module docstring); returns the models."""
    place = cfg.placement
    on_host = cfg.reward.device.startswith("cpu") and cfg.model.device.startswith("cuda")
    if cfg.schedule.name == "colocated":
        scorers = ["colocated"]
    elif place.reward:
        # The generating actors build theirs only if every reward actor dies (FragmentEngine.reward): none here
        scorers = ["reward"]
    else:  # the holder of the finished latents scores them
        scorers = [n for n in ("rollout", "trainer") if n in roles and (n == "rollout" or cfg.trainers_generate)]
    models = _reward_models(cfg, "host" if on_host else " + ".join(scorers))
    for name in scorers:
        _add_rewards(roles[name], models, on_host, _reward_notes(cfg))
    return models


def _add_rewards(r: RoleMemory, models: list[RewardModelMemory], on_host: bool, notes: list[str]) -> None:
    """The reward models a scoring role ``r`` holds: their weights, and the larger of its activations and one
    scoring forward's (scoring never overlaps that role's other passes; the models score one after another)."""
    r.notes += [m.note() for m in models] + notes
    if not models:
        return
    weights = sum(m.weights for m in models)
    r.activations = max(r.activations, max(m.activations for m in models))
    if on_host:
        r.host_bytes += weights
        r.notes.append(f"reward models in host memory (reward.device = 'cpu'): {weights / GB:.2f} GB")
    else:
        r.reward_models += weights


def _conditioning_hw(m: Any) -> tuple[int, int] | None:
    """Qwen-Image-Edit's conditioning image size in pixels, as the adapter picks it (``None`` for other models)."""
    if m.name != "qwenimage_edit":
        return None
    from digenrl.models.qwenimage_edit import conditioning_area, image_size

    h, w = m.resolution
    return image_size(conditioning_area(m.preset, m.image_area, h, w), h, w)


def _conditioning_note(traces: Traces) -> str:
    """What the traced sequence holds beside the output's tokens (Qwen-Image-Edit's input images)."""
    hw, k = traces.cond_hw, traces.cond_images
    if hw is None:
        return ""
    return (f"; the sequence also holds {k} input image{'s' if k > 1 else ''} of {hw[0]}x{hw[1]} px "
            f"({(hw[0] // 16) * (hw[1] // 16)} tokens each)")


def _cfg_branches(cfg: Config) -> int:
    """Rows per forward row: true CFG runs both branches in one batch (Qwen-Image, Wan2.1, SD3.5)."""
    true_cfg = ("qwenimage", "qwenimage_edit", "wan21", "wan22", "sd3")
    return 2 if cfg.model.name in true_cfg and cfg.model.guidance_scale > 1.0 else 1


class Traces:
    """Activation peaks of one model setup, traced on demand and memoised.

    ``train(rows)`` / ``forward(rows)``: the peak of a training pass / a no-grad forward of that many
    forward rows; ``decode()``: decoding one sample. ``linear=True`` traces each curve at one and two
    CFG-row batches only and extends it linearly: on the meta device the peak is exactly affine in the
    batch (tests compare), so a plan search prices hundreds of candidates from five traces.
    """

    def __init__(self, cfg: Config, parts: Any, dtype: torch.dtype, *, linear: bool = False) -> None:
        m = cfg.model
        self.cfg, self.parts, self.dtype, self.linear = cfg, parts, dtype, linear
        self.branches = _cfg_branches(cfg)
        self.text_len = m.text_len or (_TEXT_LEN[m.name] if m.preset in ("pretrained", "full", "random") else 32)
        self.cond_hw = _conditioning_hw(m)
        # Qwen-Image-Edit-Plus: every input image's tokens join the sequence (read once: a plan search reuses this)
        self.cond_images = max(1, cfg.input_images) if self.cond_hw is not None else 1
        self._memo: dict[tuple[str, int], int] = {}

    def _trace(self, kind: str, rows: int) -> int:
        from digenrl.plan.trace import trace_decode, trace_extrapolated, transformer_inputs

        key = (kind, rows)
        if key not in self._memo:
            m, parts = self.cfg.model, self.parts
            h, w = m.resolution
            if kind == "decode":
                self._memo[key] = trace_decode(m.name, parts.vae, h, w, m.num_frames)
            else:
                def inputs(tr: torch.nn.Module) -> Any:
                    return transformer_inputs(m.name, tr, rows, h, w, m.num_frames, self.text_len, self.dtype,
                                              cond_hw=self.cond_hw, cond_images=self.cond_images)

                train = kind == "train"
                self._memo[key] = trace_extrapolated(m.name, parts.transformer, inputs, train=train,
                                                     checkpointing=train and self.cfg.train.grad_checkpointing)
        return self._memo[key]

    def _curve(self, kind: str, rows: int) -> int:
        if not self.linear or rows <= 2 * self.branches:
            return self._trace(kind, rows)
        one, two = self._trace(kind, self.branches), self._trace(kind, 2 * self.branches)
        return one + (two - one) * (rows - self.branches) // self.branches

    def train(self, rows: int) -> int:
        return self._curve("train", rows)

    def forward(self, rows: int) -> int:
        return self._curve("forward", rows)

    def decode(self) -> int:
        return self._trace("decode", 1)


def traces_for(cfg: Config, *, linear: bool = False) -> Traces:
    """A :class:`Traces` of ``cfg``'s model (the parts are built once per process and kept)."""
    dtype = _DTYPES[cfg.model.dtype]
    return Traces(cfg, _components(cfg, dtype), dtype, linear=linear)


def memory_plan(cfg: Config, traces: Traces | None = None) -> MemoryPlan:
    """The footprint of every role of ``cfg`` on its devices (see the module docstring).

    ``traces``: activation peaks to reuse (a plan search passes one linear :class:`Traces` for all its
    candidates); default: exact traces of this config.
    """
    m, tr, place = cfg.model, cfg.train, cfg.placement
    dtype = _DTYPES[m.dtype]
    nbytes = torch.finfo(dtype).bits // 8
    parts = _components(cfg, dtype)
    traces = traces or Traces(cfg, parts, dtype)
    n_transformer = _numel(parts.transformer)
    n_text = sum(_numel(t) for t in parts.text_encoders.values())
    n_vae = _numel(parts.vae)
    device, capacity = device_capacity(cfg)
    rollout_device, rollout_capacity = device_capacity(cfg, "rollout")
    colocated = cfg.schedule.name == "colocated"
    n_trainer = 1 if colocated else place.trainer
    shard = cfg.shard if not colocated else "none"

    act = _activations(cfg, traces)
    # an SP group's ranks each hold their share of a pass's sequence (plan/sequence.py); a decode runs whole
    share, share_r = activation_share(cfg, "colocated" if colocated else "trainer"), activation_share(cfg, "rollout")
    sp_t, sp_r = place.sp_of("trainer"), place.sp_of("rollout")
    rows, train_act, decode_act = act.rows, int(act.train * share), act.decode_sample
    rollout_act, tag_act = act.rollout_at(share_r), act.rollout_at(share)

    lora = m.finetune == "lora"
    n_train = lora_params(cfg, parts.transformer) if lora else n_transformer
    experts = _experts(cfg, parts, n_transformer, lora)
    n_train *= experts.trained
    master = 4 if tr.fp32_master and dtype != torch.float32 else 0
    grad_bytes = 4 if tr.fp32_master else nbytes
    div = n_trainer * sp_t if shard == "fsdp" else 1  # FSDP over the folded 2-D mesh: every rank of every group
    text_bytes = n_text * nbytes
    vae_bytes = n_vae * nbytes
    # the trained weights' own dtype (policy.prepare_for_training: fp32 LoRA, fp32 FSDP shards under fp32_master)
    trained_bytes = 4 if master and (lora or shard == "fsdp") else nbytes
    copy = slow_copies(cfg) * n_train * trained_bytes // div
    passes = _loss_passes(cfg, traces, parts.vae, rows, train_act, copy, share)

    def trainer(role: str, devices: int, generates: bool) -> RoleMemory:
        r = RoleMemory(role, devices, device, capacity=capacity, trainable_params=n_train)
        r.weights = experts.resident * nbytes // div
        r.host_bytes += experts.host * nbytes // div
        r.notes += experts.notes
        if shard == "fsdp":
            r.weights += 2 * _largest_block(parts.transformer) * nbytes  # the gathered block and the prefetched one
            r.notes.append(f"fsdp over {n_trainer} trainers")
        if not lora and kl_beta(cfg) > 0:
            r.reference = n_train * nbytes // div  # (every trained expert's)
            r.notes.append("frozen reference copy (full fine-tune, KL weight > 0)")
        if copy:
            r.slow_copy = copy
            r.notes.append(f"slow copy of the trained weights ({cfg.train.algorithm}'s {_COPY[cfg.train.algorithm]}, "
                           f"{'a second LoRA adapter' if lora else 'a second transformer'} in "
                           f"{'fp32' if trained_bytes == 4 else m.dtype}): {copy / GB:.2f} GB")
        r.trainable = (n_train * nbytes if lora else 0) + n_train * master // div
        r.grads = n_train * grad_bytes // div
        r.optimizer = n_train * 8 // div
        r.activations = passes.peak
        r.notes += passes.notes
        if generates:
            # (a sampling copy swaps in as for the loss: DiffusionNFT samples with its old policy)
            r.activations = max(passes.peak, tag_act + (copy if cfg.train.algorithm == "nft" else 0))
            _hold_vae_and_text_encoders(r, vae_bytes, text_bytes, m.offload_text_encoder)
            r.notes.append("also generates (TAG/colocated): VAE and rollout activations")
        return r

    def frozen(role: str, devices: int, dev: str, cap: int, activations: int) -> RoleMemory:
        """A role that holds the frozen policy and decodes: rollout actors, reward actors."""
        r = RoleMemory(role, devices, dev, capacity=cap)
        r.weights = experts.frozen_resident * nbytes
        r.host_bytes += experts.frozen_host * nbytes
        r.notes += experts.frozen_notes
        r.trainable_params = n_train if lora else 0
        r.trainable = n_train * nbytes if lora else 0
        r.activations = activations
        _hold_vae_and_text_encoders(r, vae_bytes, text_bytes, m.offload_text_encoder)
        return r

    roles: dict[str, RoleMemory] = {}
    if colocated:
        roles["colocated"] = trainer("colocated", sp_t, True)
    else:
        if place.rollout:
            roles["rollout"] = frozen("rollout", place.rollout * sp_r, rollout_device, rollout_capacity, rollout_act)
        roles["trainer"] = trainer("trainer", n_trainer * sp_t, cfg.trainers_generate)
        if place.reward:
            score = _score_batch(cfg)
            r = roles["reward"] = frozen("reward", place.reward, device, capacity,
                                         decode_act * min(score, cfg.rollout.decode_batch or score))
            r.notes.append("decodes and scores; also holds the frozen policy RewardActor builds for its VAE (the "
                           "transformer and text encoders are unused there)")
    for name, r in roles.items():
        if name != "reward":
            trains = name != "rollout"
            _note_sp(r, sp_t if trains else sp_r, share if trains else share_r,
                     div if trains and shard == "fsdp" else 0)
    models = _place_rewards(cfg, roles)
    crossing = boundary(cfg, parts.transformer, parts.vae, traces.text_len, traces.branches, nbytes,
                        _cond_tokens(traces))
    return MemoryPlan(m.name, getattr(parts, "variant", ""), m.preset, device, capacity, shard, n_transformer, n_text,
                      n_vae, rows, ACTIVATIONS_METHOD + _conditioning_note(traces), roles, shared=_shared_gpus(cfg, roles),
                      rewards=models,
                      train_row_bytes=(train_act - int(act.one_row * share)) // (rows - 1) if rows > 1
                      else int(act.one_row * share),
                      train_activations=train_act, train_peak=passes.peak, rollout_forward=int(act.forward * share_r),
                      decode_sample=decode_act,
                      decode_samples=act.decode_samples,
                      expert_params=experts.second, expert_offload=experts.offload, boundary=crossing, traces=traces)


def _note_sp(r: RoleMemory, degree: int, share: float, fsdp_ranks: int) -> None:
    """Say what a sequence-parallel group of ``degree`` devices divides on ``r``'s devices."""
    r.sp = degree
    if degree == 1:
        return
    states = (f"weights and optimizer states sharded over the folded mesh ({fsdp_ranks} ranks)" if fsdp_ranks
              else "weights, LoRA, gradients and optimizer states whole on every rank")
    r.notes.append(f"sequence parallel (Ulysses) over {degree} devices an actor: each rank holds {share:.3f} of a pass's "
                   f"activations (its share of the padded sequence); {states}; a VAE decode runs whole on one rank")


_COPY = {"nft": "old policy", "awm": "EMA policy"}


@dataclass(frozen=True)
class _LossPasses:
    """A training pass's peak with the loss's no-grad forwards: the traced forward + backward plus the fp32
    velocities those forwards hold through it, or a slow copy's no-grad forward beside the trained weights it
    swapped out, whichever is larger (bytes; ``notes`` say what was added)."""

    peak: int
    notes: list[str]


def _loss_passes(cfg: Config, traces: Traces, vae: Any, rows: int, train_act: int, copy: int,
                 share: float = 1.0) -> _LossPasses:
    forwards = nograd_forwards(cfg)
    if not forwards:
        return _LossPasses(train_act, [])
    held = int(forwards * rows * latent_bytes(cfg, vae) * share)  # (an SP rank holds its tokens' velocities)
    swapped = int(traces.forward(rows * traces.branches) * share) + copy if copy else 0
    note = (f"loss: {forwards} no-grad forward(s) a row; their velocities held through the training pass: "
            f"{held / GB:.3f} GB" + (f"; the slow copy's forward ({swapped / GB:.2f} GB with the trained weights it "
                                     "swaps out) is smaller" if copy and swapped <= train_act + held else
                                     f"; the slow copy's forward with the trained weights it swaps out is the peak: "
                                     f"{swapped / GB:.2f} GB" if copy else ""))
    return _LossPasses(max(train_act + held, swapped), [note])


def _cond_tokens(traces: Traces) -> int:
    """Qwen-Image-Edit's input-image tokens in one sample's conditioning (0 for other models)."""
    hw = traces.cond_hw
    return 0 if hw is None else traces.cond_images * (hw[0] // 16) * (hw[1] // 16)


@dataclass(frozen=True)
class _ActivationPeaks:
    """Traced activation peaks (bytes): a trainer's pass of ``rows`` rows and of one row, a rollout token's
    forward, one decoded sample, ``decode_samples`` decoded at once; ``rollout`` is the larger of forward and decode."""

    rows: int
    train: int
    one_row: int
    forward: int
    decode_sample: int
    decode_samples: int

    @property
    def rollout(self) -> int:
        return self.rollout_at(1.0)

    def rollout_at(self, share: float) -> int:
        """The rollout peak on one rank holding ``share`` of the forward's sequence (the decode runs whole)."""
        return max(int(self.forward * share), self.decode_sample * self.decode_samples)


def _activations(cfg: Config, traces: Traces) -> _ActivationPeaks:
    """The activation peaks of ``cfg``'s passes (both CFG branches of a row in one batch where they run)."""
    rows, roll_samples = _sizes(cfg)
    branches = _cfg_branches(cfg)
    return _ActivationPeaks(rows, traces.train(rows * branches), traces.train(branches),
                            traces.forward(roll_samples * branches), traces.decode(),
                            min(roll_samples, cfg.rollout.decode_batch or roll_samples))


def _hold_vae_and_text_encoders(r: RoleMemory, vae_bytes: int, text_bytes: int, offload: bool) -> None:
    """A generating role's VAE on its device, and its text encoders there or (``model.offload_text_encoder``) in
    host memory between uses."""
    r.vae = vae_bytes
    r.text_encoders = 0 if offload else text_bytes
    r.host_bytes += text_bytes if offload else 0


@dataclass
class _Experts:
    """Transformer parameters a role holds on its device and in host memory, one expert or two (Wan2.2 A14B).

    ``resident`` / ``host``: a trainer's (the trained experts' weights never move); ``frozen_*``: a role that
    only samples (rollout, reward), whose offloaded idle expert is all frozen. ``trained``: how many experts
    train (LoRA and optimizer state scale with it); ``second``: the second expert's parameters (0: none).
    """

    resident: int
    host: int = 0
    frozen_resident: int = 0
    frozen_host: int = 0
    trained: int = 1
    second: int = 0
    offload: bool = False
    notes: list[str] = field(default_factory=list)
    frozen_notes: list[str] = field(default_factory=list)


def _experts(cfg: Config, parts: Any, n_expert: int, lora: bool) -> _Experts:
    """Where the experts' weights sit (module docstring): both resident, or the idle one in host memory."""
    second = getattr(parts, "transformer_2", None)
    if second is None:
        return _Experts(n_expert, frozen_resident=n_expert)
    m = cfg.model
    n2 = _numel(second)
    names = {"both": ("transformer", "transformer_2"), "high": ("transformer",), "low": ("transformer_2",)}
    trained = names[m.train_experts]
    sizes = {"transformer": n_expert, "transformer_2": n2}
    both = (f"two experts: transformer (high noise) {n_expert / 1e9:.2f} B + transformer_2 (low noise) "
            f"{n2 / 1e9:.2f} B params; model.train_experts = {m.train_experts!r}")
    if not m.expert_offload:
        note = both + ", both resident (model.expert_offload = false)"
        return _Experts(n_expert + n2, 0, n_expert + n2, 0, len(trained), n2, False, [note], [note])
    # offload: one expert at a time; a trainer's fully fine-tuned experts stay (their optimizer is here)
    pinned = 0 if lora else sum(sizes[k] for k in trained)
    resident = max(max(sizes.values()), pinned)
    host = n_expert + n2 - resident
    note = (both + f", idle expert in host memory (model.expert_offload = true): {host / 1e9:.2f} B params there"
            + ("" if lora or host else "; full fine-tuning of both experts: nothing can move"))
    frozen_note = both + ", idle expert in host memory (model.expert_offload = true)"
    return _Experts(resident, host, max(sizes.values()), min(sizes.values()), len(trained), n2, True, [note],
                    [frozen_note])


def _shared_gpus(cfg: Config, roles: dict[str, RoleMemory]) -> list[SharedGpu]:
    """The GPUs where ``placement.actors_per_gpu`` puts several actors, as the run places them (``gpu_of``)."""
    place = cfg.placement
    if place.gpus == place.actors or cfg.schedule.name == "colocated" or not cfg.model.device.startswith("cuda"):
        return []
    out = []
    for gpu, on in enumerate(place.roles_by_gpu()):
        if len(on) > 1:
            first = roles.get(on[0]) or roles["trainer"]
            out.append(SharedGpu(gpu, on, sum(roles[r].bytes_per_device for r in on if r in roles), first.capacity,
                                 first.device))
    return out


def _decode_advice(plan: MemoryPlan, r: RoleMemory) -> str:
    """``rollout.decode_batch = K`` when decoding fewer samples at once would make a generating role fit."""
    if not r.vae or plan.decode_sample <= 0:
        return ""
    room = r.capacity - RESERVE_BYTES - (r.bytes_per_device - r.activations)
    others = max(plan.rollout_forward, plan.train_activations if r.role != "rollout" else 0)
    most = room // plan.decode_sample
    if others > room or most < 1 or most >= plan.decode_samples:
        return ""
    return f"rollout.decode_batch = {int(most)} or less (samples per VAE decode call)"


def _sp_advice(cfg: Config, plan: MemoryPlan, r: RoleMemory) -> str:
    """``placement.<role>_sp = K`` when splitting each pass's sequence over K devices an actor makes ``r`` fit."""
    found = fitting_sp(cfg, plan, r.role) if plan.traces is not None else None
    if found is None:
        return ""
    degree, nbytes = found
    key = "rollout_sp" if r.role == "rollout" else "trainer_sp"
    return (f"placement.{key} = {degree} (Ulysses sequence parallelism: each {'rollout actor' if key == 'rollout_sp' else 'trainer'} "
            f"a group of {degree} devices sharing its sequence) fits: {nbytes / GB:.1f} GB per device")


def _advice(cfg: Config, plan: MemoryPlan, r: RoleMemory) -> str:
    """The config key to change for a role that does not fit, and to what."""
    over = -r.headroom
    tr = cfg.train
    decode = _decode_advice(plan, r)
    if r.role in ("trainer", "colocated"):
        if r.role == "colocated" and cfg.model.device.startswith("cuda"):
            lead = ("schedule.name: the colocated loop keeps weights, optimizer state, VAE and the rollout "
                    "activations of the whole batch on one device; use an actor schedule (async1) that spreads them")
        else:
            lead = ""
        options = [sp] if (sp := _sp_advice(cfg, plan, r)) else []
        if not tr.grad_checkpointing and r.activations > over:
            options.append("train.grad_checkpointing = true (recompute blocks in backward)")
        if plan.rows_per_pass > 1 and r.activations <= max(plan.train_activations, plan.train_peak):
            fixed = r.bytes_per_device - r.activations
            room = r.capacity - RESERVE_BYTES - fixed
            most = room // max(1, plan.train_row_bytes)
            if most >= 1:
                options.append(f"train.rows_per_pass = {min(int(most), plan.rows_per_pass - 1)} or less")
        if r.role == "trainer":
            # FSDP divides weights, gradients and Adam states by the group; how many trainers make room
            n = cfg.placement.trainer
            split = r.weights + r.reference + r.trainable + r.grads + r.optimizer
            whole = split * n if plan.shard == "fsdp" else split
            room = r.capacity - RESERVE_BYTES - (r.bytes_per_device - split)
            need = math.ceil(whole / room) if room > 0 else 0
            if need and plan.shard != "fsdp" and need <= n:
                options.append("train.shard = 'fsdp' (weights, gradients and Adam states split over the trainers)")
            elif need > n:
                options.append(f"train.shard = 'fsdp' with placement.trainer = {need} or more (about: weights, "
                               "gradients and Adam states split over the trainers)")
        if cfg.model.finetune == "full":
            options.append("model.finetune = 'lora'")
        options += [decode] if decode else []
        hint = "; or ".join(options) or "a larger placement.gpu"
        return f"{lead}; or {hint}" if lead else f"change {hint}"
    if r.role == "rollout":
        options = []
        if r.bytes_per_device - r.activations - r.text_encoders > r.capacity - RESERVE_BYTES:
            key = "placement.rollout_gpu" if cfg.placement.rollout_gpu else "placement.gpu"
            return (f"the weights and VAE alone do not fit: change {key} to a larger device type"
                    + (" (model.device = 'cpu' plans this host's memory)" if r.device == "cpu" else ""))
        if sp := _sp_advice(cfg, plan, r):
            options.append(sp)
        if decode:
            options.append(decode)
        if r.text_encoders:
            options.append("model.offload_text_encoder = true")
        options.append("schedule.fragment_groups (fewer prompts per rollout token) or schedule.rollout_batch")
        return "change " + "; or ".join(options)
    return "change placement.gpu"


def planned_vs_measured(plan: MemoryPlan, peaks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each CUDA actor's measured peak (a run's ``summary.json`` ``peak_memory``) beside its role's plan.

    ``ratio`` = measured allocated / planned bytes per device (1: the plan was exact; the CUDA context is
    outside both). CPU processes report their resident set, which is not comparable: left out.
    """
    out = []
    for actor, peak in peaks.items():
        role = plan.roles.get(actor if actor in plan.roles else actor.rsplit("-", 1)[0])
        if role is None or "allocated" not in peak:
            continue
        planned = role.bytes_per_device
        out.append({"actor": actor, "role": role.role, "device": peak["device"], "planned": planned,
                    "allocated": peak["allocated"], "reserved": peak["reserved"],
                    "ratio": peak["allocated"] / planned if planned else None})
    return out


def check_memory(cfg: Config, plan: MemoryPlan | None = None) -> MemoryPlan:
    """The plan of ``cfg``, or a ConfigError for the first role that does not fit its device.

    Raises:
        ConfigError: naming the role, the bytes it needs and the key to change.
    """
    plan = plan or memory_plan(cfg)
    problems = memory_problems(cfg, plan)
    if problems:
        raise ConfigError(problems[0])
    return plan


def memory_problems(cfg: Config, plan: MemoryPlan) -> list[str]:
    """Every role of ``plan`` that does not fit its device, and every GPU its actors overfill, one line each."""
    out = []
    for r in plan.roles.values():
        if not r.fits:
            out.append(
                f"memory: the {r.role} role needs {r.bytes_per_device / GB:.1f} GB per device but a {r.device} "
                f"has {(r.capacity - RESERVE_BYTES) / GB:.1f} GB usable (weights {r.weights / GB:.1f}, trainable "
                f"{r.trainable / GB:.1f}, grads {r.grads / GB:.1f}, optimizer {r.optimizer / GB:.1f}, activations "
                f"{r.activations / GB:.1f}, VAE {r.vae / GB:.1f}, text encoders {r.text_encoders / GB:.1f}, reward "
                f"models {r.reward_models / GB:.1f}); "
                f"{_advice(cfg, plan, r)} (see `digenrl plan`)")
    for g in [g for g in plan.shared if not g.fits][:1]:  # (every GPU of a placement alike: the first names it)
        each = ", ".join(f"{role} {plan.roles[role].bytes_per_device / GB:.1f}" for role in g.roles
                         if role in plan.roles)
        out.append(
            f"memory: placement.actors_per_gpu = {cfg.placement.actors_per_gpu} puts {' + '.join(g.roles)} on "
            f"one {g.device} (GPU {g.gpu}): {g.bytes / GB:.1f} GB ({each}) and {len(g.roles)} x "
            f"{RESERVE_BYTES / GB:.1f} GB of CUDA context and slack, but it has {g.capacity / GB:.1f} GB; "
            f"change placement.actors_per_gpu = 1 (a GPU each), or shrink the roles as `digenrl plan` says")
    return out
