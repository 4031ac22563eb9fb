"""Typed run configuration: frozen dataclasses mirroring the TOML tables, validated at load time.

A config file has one table per role, kept apart from placement::

    [model] [rollout] [train] [reward] [data] [schedule] [placement] [transport] [cluster] [log] [runtime]

:func:`load_config` reads it with ``tomllib``, applies ``--set table.key=value`` overrides, and
builds :class:`Config`. Every problem (unknown table or key, wrong type, a value outside its allowed
set or range) raises :class:`~digenrl.errors.ConfigError` naming the key and what is allowed, before
any model is built. Later issues extend a table by adding fields to its dataclass; unknown keys stay
errors, so a typo never silently falls back to a default.

``[schedule] name`` picks the recipe: ``colocated`` is the single-process loop, every other name
(:data:`ACTOR_SCHEDULES`) runs the disaggregated actors placed by ``[placement]`` and wired by
``[transport]`` (:attr:`Config.disaggregated`, :attr:`Config.schedule_options`).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from digenrl import usercode
from digenrl.errors import ConfigError
from digenrl.schedule.options import PRESETS, SCHEDULES, SIZE_KEYS
from digenrl.sim.compression import (SAMPLE_CHOICES, WEIGHT_CHOICES, choose_samples_compression,
                                     choose_weights_compression)
from digenrl.sim.window import SlidingWindow

__all__ = [
    "check_runnable",
    "ModelConfig",
    "RolloutConfig",
    "TrainConfig",
    "NftConfig",
    "AwmConfig",
    "GuardConfig",
    "MixGrpoConfig",
    "ALGORITHMS",
    "is_user_algorithm",
    "RewardConfig",
    "DataConfig",
    "ScheduleConfig",
    "PlacementConfig",
    "TransportConfig",
    "ClusterConfig",
    "LogConfig",
    "RuntimeConfig",
    "Config",
    "ACTOR_SCHEDULES",
    "SCHEDULE_NAMES",
    "OPTION_KEYS",
    "load_config",
    "config_from_dict",
    "parse_override",
    "apply_overrides",
    "SHARD_MODES",
    "resolve_shard",
]


def _choice(key: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")


def _check(key: str, ok: bool, what: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{key}: must be {what}, got {value!r}")


SHARD_MODES = ("auto", "none", "ddp", "fsdp")


def resolve_shard(shard: str, finetune: str, world: int) -> str:
    """The effective ``train.shard`` of a group of ``world`` trainers.

    ``auto``: one trainer needs none; LoRA (a small trainable set every trainer holds whole) is
    ``ddp``; full fine-tuning with several trainers is ``fsdp`` (weights + grads + Adam states of a
    12-20B transformer do not fit one GPU).

    Raises:
        ConfigError: an unknown mode, or ``none`` with several trainers.
    """
    _choice("train.shard", shard, SHARD_MODES)
    if shard == "auto":
        return "none" if world == 1 else ("fsdp" if finetune == "full" else "ddp")
    if shard == "none" and world > 1:
        raise ConfigError(f"train.shard: 'none' with placement.trainer = {world}: several trainers must share their "
                          "gradients; use 'auto', 'ddp' or 'fsdp'")
    return shard


COMPILE_MODES = ("", "default", "reduce-overhead", "max-autotune")  # model.compile: torch.compile's modes


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: which generator, how it is trained (LoRA or full), precision."""

    name: str = "qwenimage"  # the model family (digenrl/models/registry.py)
    # tiny / tiny4x / small: CPU-size presets; pretrained: model.path; full / random: the real architecture
    preset: str = "tiny"
    path: str = ""  # local diffusers directory for preset = "pretrained"
    resolution: list[int] = field(default_factory=lambda: [64, 64])  # [height, width] of the generated images (pixels)
    num_frames: int = 1  # video models: frames per sample (1 for images)
    guidance_scale: float = 1.0  # classifier-free guidance scale; 1 = no CFG pass
    text_len: int = 0  # prompt tokens kept in the conditioning; 0 = the model's default
    dtype: str = "float32"  # the generator's weights and activations
    device: str = "cpu"  # "cpu", "cuda" or "cuda:K": where each actor runs its model
    seed: int = 0  # seed of the random presets' weights
    finetune: str = "lora"  # "lora" (adapters on lora_targets) or "full" (every transformer weight)
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA scale alpha (the update is alpha / r x BA)
    lora_targets: list[str] = field(default_factory=list)  # module-name suffixes; empty = the model's default
    # "signal": re-draw a random preset's VAE decoder convs (He init) so pixels depend on the latent;
    # see digenrl/models/_toy.py. Never applies to pretrained weights.
    vae_init: str = "default"
    # A checkpoint of the random preset's pipeline to start from (bench/pretrain_tiny.py writes one;
    # relative paths resolve from the working directory, else the checkout); "" = the random preset.
    init: str = ""
    # The frozen text encoder runs once per prompt (embeddings are cached); true moves it to the CPU
    # between uses (its GPU memory goes to activations). Trainers never encode: they free it always.
    offload_text_encoder: bool = True
    # Size of a family with several (presets "full", "random" and the memory plan): Wan2.1 "1.3B" | "14B";
    # "" = the largest.
    variant: str = ""
    # Preset "random" (the published architecture at real size, random weights, built on model.device) and
    # "full": every block stack of the transformer cut to this many blocks at the real width (FLUX.1 and
    # HunyuanVideo: this many double- and this many single-stream blocks); 0 = the published depth.
    layers: int = 0
    # Preset "random": "model" = the real-size text encoders (random); "random-embeds" = none, seeded random
    # prompt features of their shape instead (models/_random.py), so a 7B encoder need not exist to time a run.
    text_encoder: str = "model"
    # torch.compile the transformer (after LoRA; per process, at its first call of each shape): "" = eager,
    # "default", "reduce-overhead" (CUDA graphs) or "max-autotune". Compiled kernels are cached in
    # TORCHINDUCTOR_CACHE_DIR (default ~/.cache/digenrl/torchinductor), so a later process or run reuses them.
    compile: str = ""
    # Wan2.2 A14B's two experts (models/wan22.py, README "Wan2.2's two experts"): the low-noise expert's CFG
    # scale (0 = guidance_scale), which experts train ("both" | "high" | "low"; the others stay frozen) and
    # whether the idle expert's frozen weights wait in host memory (one 14B expert on the GPU at a time).
    guidance_scale_2: float = 0.0
    train_experts: str = "both"  # Wan2.2 A14B: the experts that train; the others stay frozen
    expert_offload: bool = False  # Wan2.2 A14B: the idle expert's frozen weights wait in host memory
    # Qwen-Image-Edit: pixels of each conditioning image on the VAE side (models/qwenimage_edit.py); 0 = the
    # pipelines' 1024² whatever the output size (the tiny presets: the output's area).
    image_area: int = 0

    def experts(self) -> dict[str, object]:
        """The Wan2.2 expert arguments of ``load_model`` (``{}`` for every other model)."""
        if self.name != "wan22":
            return {}
        return {"guidance_scale_2": self.guidance_scale_2 or None, "train_experts": self.train_experts,
                "expert_offload": self.expert_offload}

    def __post_init__(self) -> None:
        from digenrl.models import MODEL_NAMES, PRESETS
        from digenrl.models.full import VARIANTS, published_depth
        from digenrl.models.registry import TEXT_ENCODERS

        _choice("model.vae_init", self.vae_init, ("default", "signal"))
        _check("model.vae_init", self.vae_init == "default" or self.preset != "pretrained",
               "'default' for pretrained weights", self.vae_init)
        _check("model.vae_init", self.vae_init == "default" or self.preset != "random",
               "'default' for preset 'random' (the toy init is for the tiny presets)", self.vae_init)

        _check("model.init", not self.init or self.preset != "pretrained", "'' for preset 'pretrained' (use model.path)",
               self.init)
        _check("model.init", not self.init or self.preset != "random",
               "'' for preset 'random' (its weights are random by design; a checkpoint of the published "
               "architecture loads with preset 'pretrained' and model.path)", self.init)
        _check("model.vae_init", not self.init or self.vae_init == "default",
               "'default' with model.init (the checkpoint has trained weights)", self.vae_init)
        _choice("model.name", self.name, MODEL_NAMES)
        _choice("model.preset", self.preset, PRESETS)
        _check("model.path", self.preset != "pretrained" or bool(self.path), "set for preset 'pretrained'", self.path)
        _check("model.resolution", len(self.resolution) == 2 and all(r > 0 for r in self.resolution),
               "[height, width] of positive ints", self.resolution)
        _check("model.num_frames", self.num_frames >= 1, ">= 1", self.num_frames)
        _check("model.text_len", self.text_len >= 0, ">= 0", self.text_len)
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice("model.finetune", self.finetune, ("lora", "full"))
        _check("model.lora_rank", self.lora_rank >= 1, ">= 1", self.lora_rank)
        if self.variant:
            _choice("model.variant", self.variant, VARIANTS[self.name])
        _choice("model.text_encoder", self.text_encoder, TEXT_ENCODERS)
        _choice("model.compile", self.compile, COMPILE_MODES)
        _choice("model.train_experts", self.train_experts, ("both", "high", "low"))
        _check("model.guidance_scale_2", self.guidance_scale_2 >= 0, ">= 0 (0 = guidance_scale)", self.guidance_scale_2)
        if self.name != "wan22":
            for key, value, default in (("train_experts", self.train_experts, "both"),
                                        ("expert_offload", self.expert_offload, False),
                                        ("guidance_scale_2", self.guidance_scale_2, 0.0)):
                _check(f"model.{key}", value == default, f"{default!r} (only wan22 has two experts)", value)
        _check("model.image_area", self.image_area >= 0, ">= 0 (0 = the pipelines' 1024²)", self.image_area)
        _check("model.image_area", self.image_area == 0 or self.name == "qwenimage_edit",
               "0 (only qwenimage_edit has conditioning images)", self.image_area)
        _check("model.text_encoder", self.text_encoder == "model" or self.preset == "random",
               "'model' unless model.preset = 'random'", self.text_encoder)
        _check("model.layers", self.layers == 0 or self.preset in ("random", "full"),
               "0 unless model.preset = 'random' (or 'full', for `digenrl plan`)", self.layers)
        if self.preset in ("random", "full"):
            depth = published_depth(self.name, self.variant)
            _check("model.layers", 0 <= self.layers <= depth, f"in 0..{depth} (0 = the published depth)", self.layers)


@dataclass(frozen=True)
class RolloutConfig:
    """``[rollout]``: the SDE sampler and which steps are stochastic / trained."""

    num_steps: int = 8  # denoising steps per sample
    noise_level: float = 0.7  # Flow-GRPO's SDE noise scale a (the stochastic steps' std)
    sde: str = "sde"  # "sde" (Flow-GRPO), "wan", "dance" (DanceGRPO), "cps" (coefficients-preserving): rl/sde.py
    # which steps are stochastic and trained: all but the last, a "window" of steps, or a random "fraction"
    steps: str = "all_but_last"
    window: int = 2  # rollout.steps = "window": SDE steps per sample (Flow-GRPO-Fast), ODE elsewhere
    # ``[lo, hi]``: the window starts at a step drawn from lo..hi (per group); empty = 0..N-1-window.
    # ``[0, 0]`` always trains the first, noisiest steps, where an image's layout and colours are decided.
    window_range: list[int] = field(default_factory=list)
    fraction: float = 0.6  # rollout.steps = "fraction": the share of steps trained (DanceGRPO timestep_fraction)
    group_size: int = 4  # samples per prompt (G); advantages are relative within a group
    prompts_per_batch: int = 8  # prompts per batch; a batch is prompts_per_batch x group_size samples
    # Members of a group share x_0 (DanceGRPO's init_same_noise; ALGORITHM (e).13): reward differences
    # inside a group then come only from the transition noise the policy gradient credits.
    same_init_noise: bool = False
    # Samples per VAE decode call when a fragment is decoded (0 = all of them at once). A video VAE
    # keeps every frame's activations: 24 samples of 33 frames at once are ~155 GB (`digenrl plan`).
    decode_batch: int = 0
    # Wan2.2 A14B: where the SDE window lies relative to the expert boundary (rollout.steps = "window"):
    # "any" (ignore it), "high" / "low" (only that expert's steps), "span" (at least one step of each).
    window_expert: str = "any"
    # Forward-process algorithms (train.algorithm = nft | awm): the deterministic ODE sampler of the rollout,
    # "dpm2" (DiffusionNFT's default: multistep DPM-Solver, 2nd order) or "euler". Flow-GRPO samples the SDE.
    solver: str = "dpm2"

    def window_bounds(self) -> tuple[int, int] | None:
        """``window_range`` as the ``plan_steps`` argument (None: the default range)."""
        return (self.window_range[0], self.window_range[1]) if self.window_range else None

    def __post_init__(self) -> None:
        from digenrl.rl.sde import SDE_KINDS
        from digenrl.rl.steps import STEP_MODES

        _check("rollout.num_steps", self.num_steps >= 2, ">= 2", self.num_steps)
        _check("rollout.noise_level", self.noise_level > 0, "> 0 (trained steps need noise)", self.noise_level)
        _choice("rollout.sde", self.sde, SDE_KINDS)
        _choice("rollout.steps", self.steps, STEP_MODES)
        if self.steps == "window":  # (the window keys mean nothing to the other modes: fewer steps need no new window)
            _check("rollout.window", 1 <= self.window <= self.num_steps - 1,
                   f"in 1..{self.num_steps - 1} (rollout.num_steps - 1: the last step is never trained)", self.window)
            lo_hi = self.window_range
            _check("rollout.window_range", not lo_hi or (len(lo_hi) == 2 and 0 <= lo_hi[0] <= lo_hi[1]
                   and lo_hi[1] + self.window <= self.num_steps - 1),
                   f"[] or [lo, hi] with 0 <= lo <= hi <= {self.num_steps - 1 - self.window} (num_steps - 1 - window)",
                   lo_hi)
        _check("rollout.fraction", 0 < self.fraction <= 1, "in (0, 1]", self.fraction)
        _check("rollout.group_size", self.group_size >= 2, ">= 2 (advantages compare within a group)", self.group_size)
        _check("rollout.prompts_per_batch", self.prompts_per_batch >= 1, ">= 1", self.prompts_per_batch)
        _choice("rollout.window_expert", self.window_expert, ("any", "high", "low", "span"))
        _check("rollout.window_expert", self.window_expert == "any" or self.steps == "window",
               "'any' unless rollout.steps = 'window'", self.window_expert)
        _check("rollout.decode_batch", self.decode_batch >= 0, ">= 0 (0: a fragment's samples at once)",
               self.decode_batch)


@dataclass(frozen=True)
class TrainConfig:
    """``[train]``: loss, advantages and optimizer."""

    # What the run trains with (digenrl/algorithms, docs/algorithms.md): on the rollout's SDE transitions
    # "flow_grpo", "mixgrpo" (a moving SDE window, [mixgrpo]) or "grpo_guard" ([guard]); on clean samples
    # "nft" (DiffusionNFT, [nft]) or "awm" (Advantage Weighted Matching, [awm]); or your own class,
    # "path/to/file.py:ClassName" (examples/algorithms/reward_weighted.py).
    algorithm: str = "flow_grpo"
    iterations: int = 30  # optimizer steps of the run (one batch each)
    lr: float = 3e-4  # AdamW learning rate
    lr_warmup: int = 0  # optimizer steps over which the rate rises linearly to lr (rl/lr.py); 0 = none
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    weight_decay: float = 1e-4  # AdamW weight decay
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping by global norm
    clip_range: float = 1e-4  # PPO clip of the ratio exp(l - l_old) (Flow-GRPO)
    kl_beta: float = 0.0  # weight of the KL to the reference (the model without adapters); 0 = none
    kl: str = "exact"  # "exact" (KL of the two Gaussian transitions) or "g2" (Flow-GRPO's SD3/FLUX form): rl/loss.py
    adv_std: str = "global"  # advantages divided by the batch's reward std (global, Flow-GRPO) or each group's
    adv_clip: float = 5.0  # advantages clipped to [-adv_clip, adv_clip]
    rows_per_pass: int = 0  # 0 = all trained transitions of the batch in one TSP pass
    control: str = "none"  # "shuffled": advantages permuted across samples (negative control)
    # Rollout/trainer parity (metrics parity_*): warn when max |ratio - 1| or max |dlog-prob| exceeds it.
    parity_tolerance: float = 1e-3
    # Also measure parity of stale rows (async1): recompute a sample under the weights that sampled them.
    check_parity: bool = False
    # Several trainers: "auto" (LoRA -> ddp, full fine-tune -> fsdp, one trainer -> none), "ddp"
    # (bucketed all-reduce of the gradients at the step), "fsdp" (FSDP2 per transformer block).
    shard: str = "auto"
    fp32_master: bool = True  # bf16/fp16 models: trainable weights (and the gradient reduction) in fp32
    grad_checkpointing: bool = False  # recompute transformer blocks in backward (diffusers' own switch)
    group_timeout: float = 600.0  # seconds a trainer-group collective (or the rendezvous) waits for a peer

    def __post_init__(self) -> None:
        if not is_user_algorithm(self.algorithm):
            _choice("train.algorithm", self.algorithm, ALGORITHMS)
        elif not _USER_ALGORITHM.fullmatch(self.algorithm):
            raise ConfigError(f"train.algorithm: {self.algorithm!r} must be one of {', '.join(map(repr, ALGORITHMS))} "
                              "or your own, 'path/to/file.py:ClassName' (docs/algorithms.md)")
        _check("train.iterations", self.iterations >= 1, ">= 1", self.iterations)
        _check("train.lr", self.lr > 0, "> 0", self.lr)
        _check("train.lr_warmup", self.lr_warmup >= 0, ">= 0", self.lr_warmup)
        _check("train.betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "two values in [0, 1)", self.betas)
        _check("train.weight_decay", self.weight_decay >= 0, ">= 0", self.weight_decay)
        _check("train.max_grad_norm", self.max_grad_norm > 0, "> 0", self.max_grad_norm)
        _check("train.clip_range", self.clip_range > 0, "> 0", self.clip_range)
        _check("train.kl_beta", self.kl_beta >= 0, ">= 0", self.kl_beta)
        _choice("train.kl", self.kl, ("exact", "g2"))
        _choice("train.adv_std", self.adv_std, ("global", "group"))
        _check("train.adv_clip", self.adv_clip > 0, "> 0", self.adv_clip)
        _check("train.rows_per_pass", self.rows_per_pass >= 0, ">= 0", self.rows_per_pass)
        _choice("train.control", self.control, ("none", "shuffled", "negated"))
        _check("train.parity_tolerance", self.parity_tolerance > 0, "> 0", self.parity_tolerance)
        _choice("train.shard", self.shard, SHARD_MODES)
        _check("train.group_timeout", self.group_timeout > 0, "> 0", self.group_timeout)


ALGORITHMS = ("flow_grpo", "nft", "awm", "grpo_guard", "mixgrpo")
# A user's algorithm (digenrl/algorithms/user.py): a Python file and the Algorithm subclass in it.
_USER_ALGORITHM = re.compile(r".+\.py:[A-Za-z_][A-Za-z0-9_]*")


def is_user_algorithm(name: str) -> bool:
    """``train.algorithm`` names a user's file (``path/to/file.py:ClassName``) rather than a built-in."""
    return ":" in name


@dataclass(frozen=True)
class GuardConfig:
    """``[guard]``: GRPO-Guard (train.algorithm = "grpo_guard"; ALGORITHMS-FORWARD §8, digenrl/rl/guard.py).

    Flow-GRPO's SDE, transitions, KL keys and advantages; the ratio normalised by each step's std, the policy
    loss divided by ``dt``, and this clip of the normalised ratio in place of ``train.clip_range``.
    """

    clip_range: float = 2e-6  # clip of the normalised ratio (the reference's)

    def __post_init__(self) -> None:
        _check("guard.clip_range", self.clip_range > 0, "> 0", self.clip_range)


@dataclass(frozen=True)
class NftConfig:
    """``[nft]``: DiffusionNFT (train.algorithm = "nft"; ALGORITHMS-FORWARD §3, NVlabs/DiffusionNFT).

    Per sample, ``levels`` noise levels of the rollout's own sigma grid (a random permutation's first ones;
    0 = floor(0.99 num_steps), the reference's timestep_fraction), fresh noise at each, and the loss on the
    implicit positive / negative velocities ``beta v + (1 - beta) v_old`` / ``(1 + beta) v_old - beta v``.
    The rollout samples with the old policy, moved after each optimizer step by
    ``theta_old <- d theta_old + (1 - d) theta`` with the reference's schedule ``decay`` (0: copy, 1: min(0.001
    step, 0.5), 2: 0 until step 75, then min(0.0075 (step - 75), 0.999)).
    """

    beta: float = 1.0  # the implicit velocities' mixing beta
    kl_beta: float = 1e-4  # weight of the KL to the reference
    levels: int = 0  # noise levels trained per sample; 0 = floor(0.99 rollout.num_steps)
    decay: int = 1  # the old policy's schedule: 0 copy, 1 min(0.001 step, 0.5), 2 delayed (see above)

    def __post_init__(self) -> None:
        _check("nft.beta", self.beta > 0, "> 0", self.beta)
        _check("nft.kl_beta", self.kl_beta >= 0, ">= 0", self.kl_beta)
        _check("nft.levels", self.levels >= 0, ">= 0 (0: floor(0.99 rollout.num_steps))", self.levels)
        _choice("nft.decay", self.decay, (0, 1, 2))


@dataclass(frozen=True)
class AwmConfig:
    """``[awm]``: Advantage Weighted Matching (train.algorithm = "awm"; ALGORITHMS-FORWARD §4).

    Per sample, ``levels`` noise levels drawn stratified from grid indices ``[1, floor(level_fraction N)]``,
    fresh noise at each; the "log-prob" ``-sigma ((m + 1e-10)^p - 1e-10^p) / p`` of the flow-matching error m
    (``power`` p), a PPO ratio clipped at ``clip_range`` (on-policy against its own detached value, a
    one-step-stale sample against the EMA policy), advantages ``clip(A) / train.adv_clip * adv_max``, and
    two KL terms: to the reference (``kl_beta``) and to the EMA policy (``ema_beta``), which moves after each
    optimizer step by ``d = min(ema_decay, 0.001 step)`` (``ema_decay_type = "linear"``) or ``ema_decay``.
    """

    levels: int = 6  # noise levels trained per sample, one per stratum
    level_fraction: float = 0.9  # the strata cover grid indices 1..floor(level_fraction num_steps)
    power: float = 0.25  # p of the log-prob surrogate
    clip_range: float = 1.0  # PPO clip of the ratio
    adv_max: float = 1.0  # advantages scaled to [-adv_max, adv_max]
    kl_beta: float = 1e-3  # weight of the KL to the reference
    ema_beta: float = 1.0  # weight of the KL to the EMA policy
    ema_decay: float = 0.3  # the EMA policy's decay cap
    ema_decay_type: str = "linear"  # "linear": min(ema_decay, 0.001 step); "constant": ema_decay

    def __post_init__(self) -> None:
        _check("awm.levels", self.levels >= 1, ">= 1", self.levels)
        _check("awm.level_fraction", 0 < self.level_fraction <= 1, "in (0, 1]", self.level_fraction)
        _check("awm.power", self.power > 0, "> 0", self.power)
        _check("awm.clip_range", self.clip_range > 0, "> 0", self.clip_range)
        _check("awm.adv_max", self.adv_max > 0, "> 0", self.adv_max)
        _check("awm.kl_beta", self.kl_beta >= 0, ">= 0", self.kl_beta)
        _check("awm.ema_beta", self.ema_beta >= 0, ">= 0", self.ema_beta)
        _check("awm.ema_decay", 0 <= self.ema_decay < 1, "in [0, 1)", self.ema_decay)
        _choice("awm.ema_decay_type", self.ema_decay_type, ("linear", "constant"))


@dataclass(frozen=True)
class MixGrpoConfig:
    """``[mixgrpo]``: MixGRPO's sliding SDE window (train.algorithm = "mixgrpo"; ALGORITHMS-FORWARD §2).

    The SDE (``rollout.sde``, ``rollout.noise_level``) runs in a window of ``window`` steps, Euler ODE elsewhere, and
    only the window's transitions are trained (Flow-GRPO's clipped loss). The window starts at step 0 and moves one
    step every ``shift_every`` optimizer steps up to ``num_steps - 2 - window``, then back to 0 (0: it stays at 0,
    MixGRPO-Flash*); the version that samples a fragment decides its window (``digenrl/sim/window.py``).
    ``flash``: the ODE steps after the window run DPM-Solver++ (2nd order) on ``flash_ratio`` as many steps
    (``digenrl/rl/flash.py``), which the trainer never sees.
    """

    window: int = 0  # W: SDE (and trained) steps per sample; 0 = the reference's 4, at most rollout.num_steps - 2
    shift_every: int = 25  # optimizer steps between moves of the window (the reference's iters_per_group; 0: fixed at 0)
    flash: bool = False  # MixGRPO-Flash: a compressed second-order ODE after the window
    flash_ratio: float = 0.4  # the share of the post-window steps Flash keeps (0.4 Flash, 0.2 Flash*)

    def __post_init__(self) -> None:
        _check("mixgrpo.window", self.window >= 0, ">= 0 (0: min(4, rollout.num_steps - 2))", self.window)
        _check("mixgrpo.shift_every", self.shift_every >= 0, ">= 0 (0: the window stays at step 0)", self.shift_every)
        _check("mixgrpo.flash_ratio", 0 < self.flash_ratio <= 1, "in (0, 1]", self.flash_ratio)

    def sliding(self, num_steps: int) -> SlidingWindow:
        """The window's arithmetic on a grid of ``num_steps`` steps."""
        window = self.window or max(1, min(4, num_steps - 2))
        return SlidingWindow(num_steps, window, self.shift_every, self.flash_ratio if self.flash else None)


@dataclass(frozen=True)
class RewardConfig:
    """``[reward]``: weighted rewards, the learned rewards' model files, device and dtype, and the failure policy.

    ``[reward.models.<name>]`` is one reward's own table (e.g. ``[reward.models.clipscore] path =
    "/models/clip-vit-large-patch14"``), handed to its factory as a plain dict; its keys are checked here,
    its files by ``digenrl validate`` (``recipes/preflight.py``). ``device`` is where the rewards run (``""``:
    the actor's ``model.device``; ``"cpu"``; ``"cuda"`` / ``"cuda:K"``), ``dtype`` their torch dtype (``""``:
    bf16 on CUDA, fp32 on the CPU).
    """

    # reward name = weight; several are summed (see normalize)
    weights: dict[str, float] = field(default_factory=lambda: {"color": 1.0})
    # [reward.models.<name>]: a reward's own table (its weight files: path, ...)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = ""  # "" = the actor's model.device
    dtype: str = ""  # "" = bf16 on CUDA, fp32 on the CPU
    url: str = ""  # the 'remote' reward's HTTP endpoint (python -m digenrl.rewards.server)
    timeout: float = 30.0  # seconds per remote call
    retries: int = 2  # remote calls retried this many times before a failure
    image_format: str = "png"  # remote: images sent as PNG or as exact raw uint8 arrays
    # The 'remote' reward also sends each sample's input images: for a served edit reward (uses_sources),
    # whose server refuses requests without them.
    remote_sources: bool = False
    on_error: str = "raise"  # "raise" stops the run at a failed reward; "penalty" scores its samples with penalty
    penalty: float = -1.0  # the score of a failed sample (on_error = "penalty")
    # on_error = "penalty" stops the run once more than this share of the samples of the last
    # failure_window batches were penalised (rewards/failures.py): penalties are for the occasional failure.
    max_failure_fraction: float = 0.5
    failure_window: int = 4  # batches over which max_failure_fraction is measured
    # Several rewards: "sum" normalises the weighted sum per group; "per_reward" normalises each reward per
    # group, then weights and sums the advantages (rl/advantages.py; a failed sample scores the penalty in each).
    normalize: str = "sum"

    def __post_init__(self) -> None:
        import re

        from digenrl.rewards.registry import REWARD_NAMES, check_models
        from digenrl.rewards.user import is_user_table

        _check("reward.weights", bool(self.weights), "a non-empty table of name = weight", self.weights)
        for name, w in self.weights.items():
            if name not in REWARD_NAMES and not is_user_table(self.models.get(name)):  # a user's own: its table says
                raise ConfigError(f"reward.weights.{name}: {name!r} is not allowed; allowed: "
                                  f"{', '.join(map(repr, REWARD_NAMES))}, or a reward of your own in Python: "
                                  f"[reward.models.{name}] python = \"path/to/file.py:ClassName\" (docs/rewards.md)")
            _check(f"reward.weights.{name}", isinstance(w, int | float), "a number", w)
        check_models(self.weights, self.models)
        _check("reward.device", re.fullmatch(r"(cpu|cuda(:\d+)?)?", self.device) is not None,
               "'' (the actor's model.device), 'cpu', 'cuda' or 'cuda:K'", self.device)
        _choice("reward.dtype", self.dtype, ("", "float32", "bfloat16", "float16"))
        _check("reward.url", "remote" not in self.weights or bool(self.url), "set when 'remote' is weighted", self.url)
        _choice("reward.image_format", self.image_format, ("png", "raw"))
        _check("reward.remote_sources", isinstance(self.remote_sources, bool), "true or false", self.remote_sources)
        _choice("reward.on_error", self.on_error, ("raise", "penalty"))
        _check("reward.timeout", self.timeout > 0, "> 0", self.timeout)
        f = self.max_failure_fraction
        _check("reward.max_failure_fraction", isinstance(f, int | float) and not isinstance(f, bool) and 0 <= f <= 1,
               "a fraction in [0, 1] (1 never stops the run)", f)
        w = self.failure_window
        _check("reward.failure_window", isinstance(w, int) and not isinstance(w, bool) and w >= 1,
               "an integer >= 1 (batches)", w)
        _choice("reward.normalize", self.normalize, ("sum", "per_reward"))
        _check("reward.normalize", self.normalize == "sum" or any(self.weights.values()),
               "'sum' when no reward has a non-zero weight", self.normalize)

    def build_options(self, model_device: str) -> dict[str, Any]:
        """The keyword arguments of ``digenrl.rewards.build_reward`` for this table (plain values; the rewards
        layer imports no config), ``device`` resolved against the building actor's ``model_device``."""
        return {"models": self.models, "device": self.device or model_device, "dtype": self.dtype,
                "url": self.url or None, "timeout": self.timeout, "retries": self.retries,
                "image_format": self.image_format, "remote_sources": self.remote_sources,
                "on_error": self.on_error, "penalty": self.penalty}


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the prompts. A built-in set (``prompt_set``) or an explicit list (``prompts``)."""

    prompt_set: str = "color"  # a built-in prompt set (digenrl/data/prompts.py)
    prompts: list[str] = field(default_factory=list)  # an explicit list, used instead of prompt_set
    prompt_file: str = ""  # one prompt per line; a .jsonl: {"prompt": ..., "images": [...]} per line (edit models)

    def __post_init__(self) -> None:
        from digenrl.data.prompts import PROMPT_SETS

        if not self.prompts and not self.prompt_file:
            _choice("data.prompt_set", self.prompt_set, tuple(PROMPT_SETS))


# The schedule package's own names (torch-free to import): colocated is the single-process loop.
SCHEDULE_NAMES = SCHEDULES
ACTOR_SCHEDULES = tuple(name for name in SCHEDULES if name != "colocated")
OPTION_KEYS = SIZE_KEYS  # ScheduleOptions token sizes a config may override (0 = the schedule's default)


@dataclass(frozen=True)
class ScheduleConfig:
    """``[schedule]``: how rollout and training interleave (``colocated``: the single-process loop).

    The token sizes override the schedule's ``ScheduleOptions``; 0 (or absent) keeps its default.
    """

    name: str = "colocated"  # colocated: the single-process loop; the others: actor schedules (docs/schedules.md)
    staleness: int = 0  # 1: batch k is generated with weights k - 1 (async1 sets it)
    fragment_groups: int = 0  # prompts (whole groups) per rollout fragment
    fragment_members: int = 0  # members of each prompt's group per fragment (splits along G)
    step_chunk: int = 0  # denoising steps per ROLLOUT token (TSP)
    rollout_batch: int = 0  # most samples per ROLLOUT token (step-level batching, TSP)
    train_pack: int = 0  # rows per TRAIN token
    tag_steps: int = 0  # denoising steps per trainer-assisted-generation token

    def __post_init__(self) -> None:
        _choice("schedule.name", self.name, SCHEDULE_NAMES)
        _choice("schedule.staleness", self.staleness, (0, 1))
        for key in OPTION_KEYS:
            value = getattr(self, key)
            _check(f"schedule.{key}", value >= 0, "a positive integer (0 = the schedule's default)", value)

    def options(self) -> dict[str, int]:
        """The set token sizes as ``ScheduleOptions`` overrides (unset ones left out)."""
        return {key: getattr(self, key) for key in OPTION_KEYS if getattr(self, key)}


@dataclass(frozen=True)
class PlacementConfig:
    """``[placement]``: threads of the colocated process; actors per role and their threads.

    ``workers > 0`` waits for that many ``digenrl worker --join`` processes (one per GPU, any host),
    at most ``join_timeout`` seconds. ``max_rollout > rollout`` lets a running run grow: each worker
    that joins while it runs becomes one more rollout actor, up to ``max_rollout`` live ones (it
    receives the current weights before its first token); other late joins are refused. For them the
    lead trainer keeps the two newest published versions in host memory (zmq lane; the gloo / nccl
    lane keeps them anyway).
    """

    threads: int = 2  # colocated only
    rollout: int = 1  # rollout actors (processes)
    trainer: int = 1  # trainer actors; several form one torch.distributed group (train.shard)
    reward: int = 0  # reward actors; 0 = the rollout actors score
    actor_threads: int = 1  # torch threads per actor process
    workers: int = 0  # wait for this many `digenrl worker --join` processes (one per GPU, any host)
    join_timeout: float = 600.0  # seconds to wait for the workers to join
    max_rollout: int = 0  # live rollout actors a running run may grow to by late joins (0: placement.rollout, none)
    gpu: str = "H100"  # the accelerator type each actor gets (the memory plan's headroom; `digenrl plan`)
    # Actor processes sharing one GPU (model.device = "cuda", the local or the Ray launcher): 2 puts a rollout
    # actor and a trainer on one GPU; the memory plan then checks that what the sharers hold fits it together.
    # Joined workers (placement.workers) are a GPU each, whatever this says.
    actors_per_gpu: int = 1
    rollout_gpu: str = ""  # a heterogeneous fleet: the rollout actors' type ("" = gpu)
    # What a Ray placement-group bundle of each role asks for beyond its CPUs/GPU (cluster.launcher = "ray"),
    # e.g. { accelerator_type = "L40S" } or a custom resource { l40s_pool = 1 }.
    rollout_resources: dict[str, str | float] = field(default_factory=dict)
    trainer_resources: dict[str, str | float] = field(default_factory=dict)  # the same for a trainer's bundle
    # Sequence parallelism (Ulysses): each rollout actor / trainer is a group of this many processes, one per
    # device, that acts as one actor. rollout_sp / trainer_sp override sp for one role (0: sp).
    sp: int = 1
    rollout_sp: int = 0
    trainer_sp: int = 0

    def __post_init__(self) -> None:
        from digenrl.sim.devices import CATALOG

        _choice("placement.gpu", self.gpu, tuple(CATALOG))
        if self.rollout_gpu:
            _choice("placement.rollout_gpu", self.rollout_gpu, tuple(CATALOG))
        _check("placement.threads", self.threads >= 1, ">= 1", self.threads)
        _check("placement.rollout", self.rollout >= 0, ">= 0 (0: trainers generate, needs TAG)", self.rollout)
        _check("placement.trainer", self.trainer >= 1, ">= 1", self.trainer)
        _check("placement.reward", self.reward >= 0, ">= 0", self.reward)
        _check("placement.actor_threads", self.actor_threads >= 1, ">= 1", self.actor_threads)
        _check("placement.workers", self.workers >= 0, ">= 0", self.workers)
        _check("placement.join_timeout", self.join_timeout > 0, "> 0 seconds", self.join_timeout)
        _check("placement.actors_per_gpu", self.actors_per_gpu >= 1, ">= 1", self.actors_per_gpu)
        _check("placement.max_rollout", self.max_rollout == 0 or self.max_rollout >= self.rollout,
               f"0 (no late joins) or >= placement.rollout = {self.rollout}", self.max_rollout)
        check_resources("placement.rollout_resources", self.rollout_resources)
        check_resources("placement.trainer_resources", self.trainer_resources)
        _check("placement.sp", self.sp >= 1, ">= 1 (1: no sequence parallelism)", self.sp)
        _check("placement.rollout_sp", self.rollout_sp >= 0, ">= 0 (0: placement.sp)", self.rollout_sp)
        _check("placement.trainer_sp", self.trainer_sp >= 0, ">= 0 (0: placement.sp)", self.trainer_sp)
        actors = self.actors
        if self.workers and self.workers < actors:
            raise ConfigError(f"placement.workers = {self.workers}: one actor process per joined worker needs at least "
                              f"{actors} (rollout x rollout_sp + trainer x trainer_sp + reward)")

    @property
    def actors(self) -> int:
        """Actor processes the run starts: each rollout actor and trainer is ``sp_of(role)`` of them, a reward
        actor one."""
        return self.rollout * self.sp_of("rollout") + self.trainer * self.sp_of("trainer") + self.reward

    def sp_of(self, role: str) -> int:
        """The sequence-parallel degree of ``role``'s actors ("rollout" or "trainer"; reward actors: 1)."""
        own = {"rollout": self.rollout_sp, "trainer": self.trainer_sp}.get(role)
        return 1 if own is None else own or self.sp

    @property
    def gpus(self) -> int:
        """GPUs the actors need at ``actors_per_gpu`` of them each (joined workers: one each)."""
        return self.actors if self.workers else -(-self.actors // self.actors_per_gpu)

    def check_gpus(self, have: int) -> None:
        """Refuse a local launch on a host with fewer GPUs than :attr:`gpus`, naming the key that shares them.

        Raises:
            ConfigError: too few GPUs for ``actors_per_gpu``.
        """
        if self.workers or have >= self.gpus:
            return
        share = -(-self.actors // max(have, 1))
        raise ConfigError(f"placement: {self.actors} actor processes at placement.actors_per_gpu = {self.actors_per_gpu} "
                          f"need {self.gpus} GPUs; this host has {have}: set placement.actors_per_gpu = {share} to "
                          "share them (the memory plan checks that they fit)")

    def gpu_of(self, k: int) -> int:
        """The GPU (of :attr:`gpus`) of the ``k``-th actor spawned: round robin, so the trainers (spawned first)
        get GPUs of their own while there are enough (NCCL refuses two ranks on one device)."""
        return k % self.gpus

    def roles_by_gpu(self) -> list[list[str]]:
        """The roles of the actors on each GPU, in spawn order (trainers, rollout, reward actors)."""
        order = (["trainer"] * self.trainer * self.sp_of("trainer") + ["rollout"] * self.rollout * self.sp_of("rollout")
                 + ["reward"] * self.reward)
        out: list[list[str]] = [[] for _ in range(self.gpus)]
        for k, role in enumerate(order):
            out[self.gpu_of(k)].append(role)
        return out

    @property
    def late_rollout(self) -> int:
        """How many rollout actors beyond ``rollout`` may join a running run (``max_rollout`` - ``rollout``)."""
        return max(0, self.max_rollout - self.rollout)


def check_resources(key: str, table: dict[str, Any]) -> None:
    """A role's Ray resource request: ``accelerator_type`` (a name such as ``"L40S"``), ``num_cpus`` /
    ``num_gpus`` (numbers, replacing the bundle's defaults) or custom resources (positive numbers).

    Raises:
        ConfigError: naming the bad entry.
    """
    for name, value in table.items():
        entry = f"{key}.{name}"
        if name == "accelerator_type":
            ok = isinstance(value, str) and bool(value) and value.replace("-", "").replace("_", "").isalnum()
            _check(entry, ok, "an accelerator type name such as 'H100' or 'L40S' (Ray's accelerator_type)", value)
            continue
        _check(entry, not isinstance(value, str), "a number (a resource amount); only accelerator_type takes a name",
               value)
        _check(entry, bool(name) and name not in ("CPU", "GPU", "memory") and ":" not in name,
               "num_cpus, num_gpus, accelerator_type or a custom resource name", name)
        _check(entry, value >= 0 if name in ("num_cpus", "num_gpus") else value > 0,
               ">= 0" if name in ("num_cpus", "num_gpus") else "> 0", value)


WEIGHT_LANES = ("zmq", "gloo", "nccl", "cuda_ipc")


@dataclass(frozen=True)
class TransportConfig:
    """``[transport]``: how actors talk and how weights move.

    ``actors``: ``zmq`` (one process per actor) or ``inproc`` (all in this process); ``weights``:
    ``zmq`` (the buckets as actor messages), ``gloo`` / ``nccl`` (a broadcast over a communicator
    group of the lead trainer and the live rollout actors, re-formed when they change; ``nccl`` needs
    CUDA and cupy) or ``cuda_ipc`` (actor messages carry device handles); ``address``: the driver's bind
    address (empty: a private ipc path; ``tcp://<this host>:<port>`` for joining workers); ``keys``:
    the CURVE keys directory (``digenrl keys create PATH``), required for an address off loopback and
    then used by every process of the run.
    """

    actors: str = "zmq"  # zmq: one process per actor; inproc: all in this process
    weights: str = "zmq"  # how weights reach the rollout actors (see above)
    bucket_mb: float = 64.0  # weight buckets
    address: str = ""  # the driver's bind address; empty = a private ipc path
    keys: str = ""  # the CURVE keys directory; required off loopback
    # A far rollout pool (docs/machines.md, "Rollout over a slow link"): the link's rate in Gbit/s (0: the
    # trainers' own fabric), which the two `auto` compressions below read (digenrl.sim.compression).
    rollout_link_gbit: float = 0.0
    # Publications as deltas against the version the rollout actors hold (zmq lane), with error feedback: int8
    # (per-block scaled) or topk (as int8 where top-k would pass weights_max_error); the first publication, a
    # newcomer's and one int8 cannot keep within weights_max_error go in full.
    weights_compression: str = "auto"
    topk_fraction: float = 0.01  # topk: the share of each bucket's entries one delta sends
    weights_max_error: float = 1e-3  # the bound: receivers' weights within this relative L2 error of the trainer's
    # Fragments sent to the trainers: lossless (byte-shuffled zlib, bit for bit) or bf16 (clean latents of
    # forward-process algorithms rounded to bf16, everything else lossless).
    samples_compression: str = "auto"

    def __post_init__(self) -> None:
        _choice("transport.actors", self.actors, ("zmq", "inproc"))
        _check("transport.rollout_link_gbit", self.rollout_link_gbit >= 0, ">= 0 (0: no slow link)",
               self.rollout_link_gbit)
        _choice("transport.weights_compression", self.weights_compression, WEIGHT_CHOICES)
        _choice("transport.samples_compression", self.samples_compression, SAMPLE_CHOICES)
        _check("transport.topk_fraction", 0 < self.topk_fraction <= 1, "in (0, 1]", self.topk_fraction)
        _check("transport.weights_max_error", self.weights_max_error > 0, "> 0", self.weights_max_error)
        if self.weights == "torchdist":
            raise ConfigError("transport.weights: 'torchdist' was replaced by 'gloo' (the same bucketed broadcast, over "
                              "a communicator group that rollout actors can join and leave; 'nccl' on CUDA)")
        _choice("transport.weights", self.weights, WEIGHT_LANES)
        if self.actors == "inproc" and self.weights != "zmq":
            raise ConfigError(f"transport.weights: must be 'zmq' (actor messages) when transport.actors = 'inproc', "
                              f"got {self.weights!r}")
        _check("transport.bucket_mb", self.bucket_mb > 0, "> 0", self.bucket_mb)
        if self.address:
            _check_address("transport.address", self.address, self.actors)
        if self.weights_compression not in ("none", "auto") and self.weights != "zmq":
            raise ConfigError(f"transport.weights_compression = {self.weights_compression!r} needs transport.weights = "
                              f"'zmq' (deltas travel as actor messages), got {self.weights!r}")

    @property
    def weights_codec(self) -> str:
        """``weights_compression`` resolved: ``auto`` by ``rollout_link_gbit`` (zmq lane only, else ``none``)."""
        if self.weights_compression != "auto":
            return self.weights_compression
        return choose_weights_compression(self.rollout_link_gbit * 1e9) if self.weights == "zmq" else "none"

    @property
    def samples_codec(self) -> str:
        """``samples_compression`` resolved: ``auto`` by ``rollout_link_gbit``."""
        if self.samples_compression != "auto":
            return self.samples_compression
        return choose_samples_compression(self.rollout_link_gbit * 1e9)


def _check_address(key: str, address: str, actors: str) -> None:
    """The form of a bind address (whether this host has the interface is checked at launch)."""
    schemes = ("inproc://",) if actors == "inproc" else ("tcp://", "ipc://")
    _check(key, address.startswith(schemes), f"an address starting with {' or '.join(schemes)} "
           f"(transport.actors = {actors!r})", address)
    if not address.startswith("tcp://"):
        _check(key, len(address.split("://", 1)[1]) > 0, "a non-empty path or name after the scheme", address)
        return
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    _check(key, bool(host) and port.isdigit() and int(port) <= 65535, "tcp://HOST:PORT with a port in 0..65535",
           address)
    # Peers send their replies to this address, so it must name one interface, never all of them.
    _check(key, host.strip("[]") not in ("0.0.0.0", "::", "*"),
           "one interface of this host (peers reply to it), not a wildcard", address)


LAUNCHERS = ("local", "ray")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: who starts the actor processes.

    ``launcher``: ``local`` (this host's processes, or ``digenrl worker --join`` ones with
    ``placement.workers``) or ``ray`` (a Ray placement group, one bundle per actor:
    :mod:`digenrl.recipes.ray_launcher`); ``address``: the Ray cluster (``auto``: the one this host
    belongs to, else a new local one; ``local``: always a new local one; or ``HOST:PORT``);
    ``strategy``: the placement group's strategy.
    """

    launcher: str = "local"  # local processes or a Ray placement group
    address: str = "auto"  # the Ray cluster: auto, local, HOST:PORT or ray://HOST:PORT
    strategy: str = "PACK"  # the Ray placement group's strategy

    def __post_init__(self) -> None:
        _choice("cluster.launcher", self.launcher, LAUNCHERS)
        _choice("cluster.strategy", self.strategy, STRATEGIES)
        _check("cluster.address", bool(self.address) and " " not in self.address,
               "'auto', 'local', HOST:PORT or ray://HOST:PORT", self.address)


SAMPLE_GRIDS = ("fixed", "rollout")  # log.samples
WANDB_MODES = ("auto", "online", "offline")  # log.wandb_mode


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: outputs."""

    out: str = ""  # default runs/<timestamp>
    image_every: int = 10  # 0 disables image grids
    images_per_grid: int = 16  # samples in each image grid
    seed: int = 0  # run seed: prompts, noise, step windows
    checkpoint_every: int = 1  # optimizer steps between checkpoints (every schedule); 0 disables them
    keep_checkpoints: int = 2  # the newest ones; the one checkpoints/latest names is never removed
    # SIGTERM (scancel, a preemption, Kubernetes): seconds the run may take to finish the step under way and write
    # its checkpoint before it stops; 0 stops at once. SIGINT (Ctrl-C) always stops at once. Either way it writes
    # summary.json, trace.json and gantt.png and says how to resume. Keep it below the SIGKILL that follows
    # (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds).
    term_grace: float = 25.0  # below Slurm's default KillWait (30 s)
    trace: bool = True  # trace.json (Chrome/Perfetto spans of every actor)
    gantt: bool = True  # gantt.png
    tensorboard: bool = False  # also write TensorBoard event files under DIR/tb (scalars and the sample grids)
    live: bool = False  # a live metrics table on the terminal
    # What the grids under DIR/samples show (docs/logging.md): "fixed" = a fixed evaluation set, log.images_per_grid
    # prompts and initial noises drawn once from log.seed, sampled by the deterministic ODE with the trained weights
    # at versions 0, log.image_every, 2 x log.image_every ... and the last, so step k's tiles compare with step k+n's
    # (a train.shard = "fsdp" actor run shows "rollout" instead); "rollout" = the step's own training samples.
    samples: str = "fixed"
    eval_steps: int = 0  # ODE steps of the fixed evaluation; 0 = rollout.num_steps
    tile_px: int = 256  # longer side of a grid tile: small images are enlarged (nearest), large ones reduced
    # Weights & Biases (the optional extra: pip install 'digenrl[wandb]'): metrics, grids and the config, in a run
    # under DIR/wandb. Offline (sync later with `wandb sync DIR/wandb/offline-run-*`) unless a W&B server is
    # reachable and this host is logged in (WANDB_API_KEY or `wandb login`); WANDB_MODE, when set, decides.
    wandb: bool = False
    wandb_project: str = "digenrl"  # the W&B project the run is logged to
    wandb_entity: str = ""  # the W&B team or user ("": the login's default)
    wandb_mode: str = "auto"  # auto | online | offline

    def __post_init__(self) -> None:
        _check("log.image_every", self.image_every >= 0, ">= 0", self.image_every)
        _check("log.images_per_grid", self.images_per_grid >= 1, ">= 1", self.images_per_grid)
        _check("log.checkpoint_every", self.checkpoint_every >= 0, ">= 0", self.checkpoint_every)
        _check("log.keep_checkpoints", self.keep_checkpoints >= 1, ">= 1", self.keep_checkpoints)
        _check("log.term_grace", self.term_grace >= 0, ">= 0 (seconds)", self.term_grace)
        _choice("log.samples", self.samples, SAMPLE_GRIDS)
        _check("log.eval_steps", self.eval_steps >= 0, ">= 0", self.eval_steps)
        _check("log.tile_px", self.tile_px >= 16, ">= 16 (pixels)", self.tile_px)
        _choice("log.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check("log.wandb_project", bool(self.wandb_project.strip()), "a W&B project name", self.wandb_project)


@dataclass(frozen=True)
class RuntimeConfig:
    """``[runtime]``: how the processes of a run execute.

    ``event_loop``: ``uvloop`` (default; asyncio's loop with an info line where uvloop is not
    installed) or ``asyncio``, for the driver and every actor process.
    """

    event_loop: str = "uvloop"  # the actor processes' event loop (uvloop where installed)

    def __post_init__(self) -> None:
        _choice("runtime.event_loop", self.event_loop, ("uvloop", "asyncio"))


@dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    nft: NftConfig = field(default_factory=NftConfig)
    awm: AwmConfig = field(default_factory=AwmConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    mixgrpo: MixGrpoConfig = field(default_factory=MixGrpoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        # Checks across tables (each table checks its own keys first).
        name, place, transport = self.schedule.name, self.placement, self.transport
        if place.rollout == 0 and name not in ("tag", "async1", "colocated", "colocated-tsp"):
            raise ConfigError(f"placement.rollout = 0 needs a schedule with TAG (tag, async1), not {name!r} "
                              f"(schedule.name)")
        if name == "colocated-tsp" and place.rollout:
            # every actor of this schedule samples and trains (a hybrid); a rollout actor could do only half
            raise ConfigError(f"schedule.name = 'colocated-tsp' runs placement.trainer actors that each sample and "
                              f"train; set placement.rollout = 0 (got {place.rollout})")
        if place.workers and (transport.actors != "zmq" or not transport.address.startswith("tcp://")):
            raise ConfigError("placement.workers > 0 needs transport.actors = 'zmq' and transport.address = "
                              "'tcp://<this host>:<port>' for the workers to join")
        if place.late_rollout and (name == "colocated" or transport.actors != "zmq"):
            raise ConfigError(f"placement.max_rollout = {place.max_rollout}: rollout actors join a running run as "
                              "worker processes; it needs an actor schedule (not colocated) and transport.actors = 'zmq'")
        self._check_launcher()
        self._check_algorithm()
        self._check_sequence_parallel()
        if transport.weights == "nccl" and not self.model.device.startswith("cuda"):
            raise ConfigError(f"transport.weights = 'nccl' moves CUDA buffers, but model.device = {self.model.device!r}; "
                              "use 'gloo' (the same lane on the CPU) or 'zmq'")
        shard = resolve_shard(self.train.shard, self.model.finetune, place.trainer)
        if name != "colocated" and place.trainer > 1:
            if transport.actors != "zmq":
                raise ConfigError(f"placement.trainer = {place.trainer} needs transport.actors = 'zmq': the trainers "
                                  "form a torch.distributed group, one process each")
        if shard == "fsdp" and self.model.compile:
            raise ConfigError(f"model.compile = {self.model.compile!r} with train.shard = 'fsdp': compiling sharded "
                              "blocks is not supported yet; use model.compile = '' or train.shard = 'ddp'")
        if shard == "fsdp" and place.rollout == 0:
            raise ConfigError(f"placement.rollout = 0 needs trainers that generate ({'hybrid actors' if name == 'colocated-tsp' else 'TAG'}), "
                              "which train.shard = 'fsdp' turns off; add a rollout actor or use train.shard = 'ddp'")
        if self.model.name == "qwenimage_edit" and not self.data.prompts and not self.data.prompt_file.endswith(".jsonl"):
            raise ConfigError("data.prompt_file: model qwenimage_edit edits input images; it needs a .jsonl prompt file, "
                              'one {"prompt": ..., "images": [...]} a line (e.g. examples/edit/prompts.jsonl)')

    def _check_algorithm(self) -> None:
        algo, n = self.train.algorithm, self.rollout.num_steps
        if algo == "nft":
            _check("nft.levels", self.nft.levels <= n, f"<= rollout.num_steps = {n} (levels come from its grid)",
                   self.nft.levels)
        if algo == "grpo_guard":
            _check("rollout.sde", self.rollout.sde != "cps", "'sde', 'wan' or 'dance' under train.algorithm = "
                   "'grpo_guard' (its ratio is normalised by a Gaussian step's std; cps has no normalised log-prob)",
                   self.rollout.sde)
        if algo == "mixgrpo":
            _check("rollout.num_steps", n >= 3, ">= 3 under train.algorithm = 'mixgrpo' (its window ends before step "
                   "N - 2, as the reference's)", n)
            _check("mixgrpo.window", self.mixgrpo.window <= n - 2, f"<= rollout.num_steps - 2 = {n - 2} (the "
                   "window's steps end before step N - 2, as the reference's; 0: min(4, that))", self.mixgrpo.window)
        if algo == "awm":
            top = int(n * self.awm.level_fraction)
            _check("awm.level_fraction", top >= 2, f"such that floor(level_fraction x rollout.num_steps = {n}) >= 2 "
                   "(the levels are drawn from grid indices 1..that)", self.awm.level_fraction)

    def _check_sequence_parallel(self) -> None:
        place = self.placement
        sp = {role: place.sp_of(role) for role, n in (("rollout", place.rollout), ("trainer", place.trainer)) if n}
        big = {role: n for role, n in sp.items() if n > 1}
        if not big:
            return
        key = "placement.sp" if not (place.rollout_sp or place.trainer_sp) else \
            " / ".join(f"placement.{role}_sp" for role in big)
        what = f"{key} = {max(big.values())}"
        if self.schedule.name == "colocated":
            raise ConfigError(f"{what}: sequence parallelism spreads an actor over several processes; schedule.name = "
                              "'colocated' runs one process (use an actor schedule, e.g. colocated-tsp or async1)")
        if self.transport.actors != "zmq":
            raise ConfigError(f"{what} needs transport.actors = 'zmq': each member of a sequence-parallel group is a "
                              "process with its own torch.distributed group")
        if place.late_rollout and "rollout" in big:
            raise ConfigError(f"placement.max_rollout = {place.max_rollout} with rollout actors of sp = {big['rollout']}: "
                              "a late joiner is one worker, not a sequence-parallel group; set placement.max_rollout = 0 "
                              "or placement.rollout_sp = 1")
        if "trainer" in big and self.shard == "fsdp":
            raise ConfigError(f"train.shard = 'fsdp' with trainers of sp = {big['trainer']}: FSDP over the data-parallel "
                              "ranks of a 2-D mesh is not supported yet; use train.shard = 'ddp' (LoRA) or "
                              "placement.trainer_sp = 1")
        if self.model.device.startswith("cuda") and not place.workers and place.gpus < max(big.values()):
            raise ConfigError(f"{what}: the members of a sequence-parallel group need a GPU each, but the run has "
                              f"{place.gpus} (placement.actors_per_gpu = {place.actors_per_gpu} over {place.actors} "
                              "processes); lower placement.actors_per_gpu")

    def _check_launcher(self) -> None:
        place, ray = self.placement, self.cluster.launcher == "ray"
        for key in ("rollout_resources", "trainer_resources"):
            if getattr(place, key) and not ray:
                raise ConfigError(f"placement.{key} asks Ray for resources; it needs cluster.launcher = 'ray' "
                                  "(or digenrl run --launcher ray)")
        if not ray:
            return
        if self.schedule.name == "colocated":
            raise ConfigError("cluster.launcher = 'ray' places actor processes; schedule.name = 'colocated' runs one "
                              "process (pick an actor schedule, e.g. async1)")
        if self.transport.actors != "zmq":
            raise ConfigError("cluster.launcher = 'ray' starts one process per actor: it needs transport.actors = 'zmq'")
        if place.workers:
            raise ConfigError(f"placement.workers = {place.workers}: the Ray launcher starts one worker per actor "
                              "itself; set placement.workers = 0 (or use cluster.launcher = 'local')")
        if self.transport.address and not self.transport.address.startswith("tcp://"):
            raise ConfigError(f"transport.address = {self.transport.address!r}: Ray workers join over tcp; "
                              "use tcp://<this host>:<port> or leave it empty (loopback, a one-host Ray)")

    @property
    def input_images(self) -> int:
        """Input images each prompt carries (Qwen-Image-Edit: one, Edit-Plus: one or more; 0 for a text-to-image
        model): the first prompt's, as every prompt of a run carries the same number.

        Raises:
            ConfigError: as ``load_prompts`` (a missing prompt file or image, a malformed line).
        """
        if self.model.name != "qwenimage_edit":
            return 0
        from digenrl.data.prompts import load_prompts, split_prompt

        d = self.data
        return len(split_prompt(load_prompts(d.prompt_set, d.prompts, d.prompt_file)[0])[1])

    @property
    def trainers_generate(self) -> bool:
        """Whether trainer actors also generate (TAG: ROLLOUT/REWARD tokens), so need the VAE and text encoder."""
        preset = PRESETS[self.schedule.name]  # (colocated-tsp: every actor is a hybrid)
        return self.disaggregated and (preset.tag or preset.colocated) and self.shard != "fsdp"

    @property
    def shard(self) -> str:
        """The effective trainer sharding (``train.shard`` resolved for ``placement.trainer`` trainers)."""
        return resolve_shard(self.train.shard, self.model.finetune, self.placement.trainer)

    @property
    def disaggregated(self) -> bool:
        """True when the run uses actors (every ``schedule.name`` except ``colocated``)."""
        return self.schedule.name != "colocated"

    @property
    def schedule_options(self) -> dict[str, int]:
        """The ``ScheduleOptions`` overrides of ``[schedule]`` (only the token sizes that are set)."""
        return self.schedule.options()

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (TOML/JSON friendly)."""
        return dataclasses.asdict(self)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints widen to floats); raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {tp}, got {value!r}")
    if tp is float:
        _check(key, isinstance(value, int | float) and not isinstance(value, bool), "a number", value)
        return float(value)
    if tp is int or tp is bool or tp is str:
        ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
        _check(key, ok, f"of type {tp.__name__}", value)
        return value
    if origin is list:
        _check(key, isinstance(value, list), "a list", value)
        (arm,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, arm) for i, v in enumerate(value)]
    if origin is dict:
        _check(key, isinstance(value, dict), "a table", value)
        _, arm = typing.get_args(tp)
        return {k: _coerce(f"{key}.{k}", v, arm) for k, v in value.items()}
    return value


_RETIRED = {  # keys of older configs: a clearer error than "unknown key"
    "schedule.mode": "renamed to schedule.name (colocated | disaggregated | gap | tsp | tag | async1)",
    "placement.processes": "removed (unused); placement.rollout, trainer and reward set the actor processes",
    "transport.kind": "removed (unused); transport.actors and transport.weights choose the transports",
}


def _build(cls: type, table: Any, prefix: str) -> Any:
    _check(prefix, isinstance(table, dict), "a table", table)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(table) - set(names))
    for key in unknown:
        if f"{prefix}.{key}" in _RETIRED:
            raise ConfigError(f"{prefix}.{key}: {_RETIRED[f'{prefix}.{key}']}")
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key; allowed in [{prefix}]: {', '.join(names)}")
    kwargs = {k: _coerce(f"{prefix}.{k}", v, hints[k]) for k, v in table.items()}
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested tables.

    Raises:
        ConfigError: an unknown table or key, a wrong type, or a disallowed value (each table's first one,
            all of them in its ``problems``).
    """
    tables = {f.name: f for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ConfigError(f"[{unknown[0]}]: unknown table; allowed: {', '.join(tables)}")
    hints = typing.get_type_hints(Config)
    built, problems = {}, []
    for name in data:  # every table's first problem, not only the first table's
        try:
            built[name] = _build(hints[name], data[name], name)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        error = ConfigError(problems[0] if len(problems) == 1 else
                            f"{len(problems)} problems: " + "; ".join(problems))
        error.problems = problems  # type: ignore[attr-defined]  # digenrl validate lists them one a line
        raise error
    return Config(**built)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-3"`` -> ``(["train", "lr"], 0.001)``. Values are TOML literals; bare words are strings.

    Raises:
        ConfigError: no ``=`` or no ``table.key``.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected table.key=value")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: the key must be table.key (e.g. train.lr=1e-3)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Nested copy of ``data`` with each ``table.key=value`` applied.

    Raises:
        ConfigError: a malformed override.
    """
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a table")
        node[path[-1]] = value
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML config, apply overrides, validate.

    Raises:
        ConfigError: the file is missing or not valid TOML, or any key/value is invalid.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
    cfg = config_from_dict(apply_overrides(data, overrides or []))
    _check_algorithm_keys(cfg.train.algorithm, data, apply_overrides({}, overrides or []), p)
    # This process's own config: it may import the Python files that config names (digenrl/usercode.py).
    if is_user_algorithm(cfg.train.algorithm):
        usercode.allow(cfg.train.algorithm, "train.algorithm", "Algorithm subclass")
    for name, table in cfg.reward.models.items():
        if isinstance(table, dict) and "python" in table:
            usercode.allow(table["python"], f"reward.models.{name}.python", "reward class")
    return cfg


# Keys that mean something to one family only: the SDE sampler and the clipped log-prob ratio of Flow-GRPO;
# the ODE sampler of the forward-process methods; each method's own table.
_SDE_KEYS = ("rollout.noise_level", "rollout.sde", "rollout.steps", "rollout.window", "rollout.window_range",
             "rollout.fraction", "rollout.window_expert", "rollout.same_init_noise", "train.clip_range",
             "train.kl_beta", "train.kl")
_MEANINGLESS = {
    "flow_grpo": ("rollout.solver", "nft", "awm", "guard", "mixgrpo"),
    "nft": (*_SDE_KEYS, "awm", "guard", "mixgrpo"),
    "awm": (*_SDE_KEYS, "nft", "guard", "mixgrpo"),
    "grpo_guard": ("rollout.solver", "train.clip_range", "nft", "awm", "mixgrpo"),
    # its window is [mixgrpo]'s, moved by the trainer, and Flash's tail solver is fixed
    "mixgrpo": ("rollout.solver", "rollout.steps", "rollout.window", "rollout.window_range", "rollout.fraction",
                "rollout.window_expert", "nft", "awm", "guard"),
}


def _set_keys(data: dict[str, Any]) -> set[str]:
    """``table.key`` of every key present in ``data`` (and each table's own name)."""
    return {name for table, keys in data.items() if isinstance(keys, dict)
            for name in (table, *(f"{table}.{k}" for k in keys))}


def _check_algorithm_keys(algorithm: str, file_data: dict[str, Any], overrides: dict[str, Any], path: Path) -> None:
    """Refuse keys that mean nothing to ``train.algorithm``, by name.

    A file that chooses its algorithm (or leaves the default) may not carry another algorithm's keys, nor may
    ``--set``; a file written for one algorithm and switched by ``--set train.algorithm=...`` keeps its other
    keys, which the run ignores (one warning names them), so a shipped Flow-GRPO config runs NFT as it is.

    Raises:
        ConfigError: naming the first such key and the algorithm.
    """
    known = _MEANINGLESS.get(algorithm, ())  # a user's algorithm reads what it reads
    meaningless = [k for k in known if "." in k]
    tables = [k for k in known if "." not in k]

    def offending(keys: set[str]) -> list[str]:
        return sorted(k for k in keys if k in meaningless or k in tables)

    switched = "train.algorithm" in _set_keys(overrides)
    bad = offending(_set_keys(overrides)) + ([] if switched else offending(_set_keys(file_data)))
    if bad:
        what = f"[{bad[0]}]" if bad[0] in tables else bad[0]
        raise ConfigError(f"{what}: means nothing to train.algorithm = {algorithm!r}; remove it "
                          f"({_family(algorithm)})")
    ignored = [k for k in offending(_set_keys(file_data)) if "." in k or k in tables]
    if switched and ignored:
        import logging

        logging.getLogger(__name__).warning("%s: train.algorithm = %r (--set) ignores the file's %s", path, algorithm,
                                            ", ".join(ignored))


def _family(algorithm: str) -> str:
    if algorithm == "flow_grpo":
        return "Flow-GRPO samples the SDE of [rollout] and has no [nft] / [awm] / [guard] table"
    if algorithm == "mixgrpo":
        return ("MixGRPO samples the SDE in [mixgrpo]'s sliding window, Euler (or Flash's DPM-Solver) elsewhere, and "
                "has no other window, step share or ODE solver")
    if algorithm == "grpo_guard":
        return "GRPO-Guard samples Flow-GRPO's SDE and clips its normalised ratio at guard.clip_range"
    return (f"{algorithm} samples a deterministic ODE (rollout.solver) and trains on clean samples: the SDE, its "
            "log-prob ratio and the other method's table do not apply")


_TINY_HINT = "on a CPU-only machine run the embedded tiny default instead: digenrl run configs/tiny-qwenimage.toml"


def check_runnable(cfg: Config) -> None:
    """Fail before any process starts when this machine cannot run ``cfg`` (no GPU, no weights).

    Raises:
        ConfigError: naming what is missing and pointing to the tiny config.
    """
    import torch

    # Ray places every actor on its nodes' GPUs: the driver (the coordinator) may be a CPU-only head node.
    placed = cfg.cluster.launcher == "ray"
    if cfg.model.device.startswith("cuda") and not placed and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {cfg.model.device!r}, but this machine has no CUDA device; {_TINY_HINT}")
    if cfg.model.device == "cuda" and cfg.disaggregated and not placed:
        cfg.placement.check_gpus(torch.cuda.device_count())
    if cfg.model.preset == "pretrained":
        root = Path(cfg.model.path)
        if not cfg.model.path or not root.is_dir():
            raise ConfigError(f"model.path: weights directory {cfg.model.path!r} does not exist "
                              f"(set it with --set model.path=/local/diffusers/dir); {_TINY_HINT}")
        if not (root / "model_index.json").is_file():
            raise ConfigError(f"model.path: {str(root)!r} has no model_index.json (a diffusers save_pretrained "
                              f"directory is expected); {_TINY_HINT}")
