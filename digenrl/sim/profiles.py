"""The four paper models as the cost model sees them: FLOPs per forward, CFG passes, bytes to move.

Every number here is either counted (transformer FLOPs from ``flops.py``; VAE decode FLOPs counted once
with ``FlopCounterMode`` on the meta device and cached in ``_VAE_DECODE_FLOPS``) or a published model
size (text encoders, reward models, LoRA targets), each with its source in a comment.

Which profile prices what:

- a scenario (``bench bubbles --scenario``): ``profile(scenario.model, scenario.variant)``, the paper
  recipe of that model (``PROFILES``: resolution, CFG, LoRA or full fine-tuning, text encoder, reward)
  at the requested size (``""``: the recipe's own, the largest);
- a config (``digenrl plan --fleet``): ``model_profile(cfg.model)``, the config's model at ``model.variant``
  with its resolution, frames, text length, CFG passes (``guidance_scale``) and trainable set
  (``finetune``, ``lora_rank``); the text encoder stays the paper recipe's, and so does the reward model
  unless the ``[reward]`` table is passed too: then a REWARD token is priced with the FLOPs of the config's
  weighted reward models (``reward_models.py``: CLIP-L / CLIP-H at 224 px, read from the model
  directory's ``config.json`` where there is one; rewards scored on the host or on a server cost the
  devices nothing). ``ModelProfile.describe`` says which. It reads the ``[model]`` and
  ``[reward]`` tables through :class:`ModelSpec` and :class:`RewardSpec` (the simulator sits below the
  config layer).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from digenrl.errors import ConfigError
from digenrl.sim.flops import (EDIT_VAE_IMAGE_AREA, SPATIAL_FACTOR, SampleShape, default_variant, edit_image_tokens,
                               forward_flops, param_count, variant_config)
from digenrl.sim.reward_models import OFF_DEVICE, PUBLISHED, reward_models
from digenrl.sim.window import SlidingWindow

__all__ = ["ModelProfile", "ModelSpec", "RewardSpec", "RowCost", "TRAJECTORY_ROWS", "PROFILES", "ARCH_OF_MODEL", "profile",
           "model_profile", "vae_decode_flops", "count_vae_decode_flops", "lora_params", "clean_sample_rows",
           "conditioning_bytes", "sample_bytes"]

BF16 = 2
FP32 = 4

# digenrl model names (``model.name``) -> the simulator's architecture / profile names
ARCH_OF_MODEL = {"qwenimage": "qwen-image", "qwenimage_edit": "qwen-image-edit", "flux": "flux", "wan21": "wan",
                 "wan22": "wan2.2", "hunyuanvideo": "hunyuan-video", "sd3": "sd3"}
_FAMILY = {"qwen-image": "Qwen-Image", "qwen-image-edit": "Qwen-Image-Edit", "flux": "FLUX.1", "wan": "Wan2.1",
           "wan2.2": "Wan2.2", "hunyuan-video": "HunyuanVideo", "sd3": "SD3.5"}
# The pretrained adapters' prompt length when ``model.text_len`` is 0 (models/*.py ``text_len or N``; the
# memory plan's ``_TEXT_LEN``).
_TEXT_TOKENS = {"qwen-image": 512, "qwen-image-edit": 1536, "flux": 512, "wan": 512, "wan2.2": 512, "hunyuan-video": 256,
                "sd3": 128}
# Tokens the transformer sees before the ``text_len`` ones: SD3.5's 77 CLIP tokens ahead of T5's.
_FIXED_TEXT_TOKENS = {"sd3": 77}
# Models whose guidance is true CFG (two passes per step when ``guidance_scale > 1``); FLUX.1-dev and
# HunyuanVideo are guidance-distilled (one pass with a guidance embedding). As the memory plan's ``_cfg_branches``.
_TRUE_CFG = ("qwen-image", "qwen-image-edit", "wan", "sd3", "wan2.2")
# ``models/lora.py`` DEFAULT_LORA_TARGETS as ``lora_params`` names them (Wan2.1: attention only; the MMDiTs:
# attention and MLPs). The planner passes the memory plan's exact count instead (``plan.fleet.config_profile``).
_LORA_TARGETS = {"qwen-image": "attn+mlp", "qwen-image-edit": "attn+mlp", "flux": "attn+mlp", "wan": "attn",
                 "wan2.2": "attn", "hunyuan-video": "attn+mlp", "sd3": "attn"}
# Experts that train per variant by default (Wan2.2 A14B: LoRA on both; ``model.train_experts`` otherwise).
_EXPERTS = {("wan2.2", "A14B"): 2}
# Presets that build the published architecture (models/full.py): "random" with random weights, "full" meta only.
_PUBLISHED_PRESETS = ("pretrained", "random", "full")
# The prompt embeddings' width (the text encoder's hidden size the transformer projects) and the pooled
# embedding's, as the transformer configs name them; models whose conditioning also carries an int64 token mask.
_TEXT_DIM_KEYS = ("joint_attention_dim", "text_dim", "text_embed_dim")
_MASKED = ("qwen-image", "qwen-image-edit", "hunyuan-video")
INT64 = 8


@dataclass(frozen=True, slots=True)
class RowCost:
    """What the training algorithm adds to a sample's cost, as numbers: the simulator and the schedules never
    read an algorithm's name (the planner derives these from ``train.algorithm``, ``plan/rows.py``).

    Attributes:
        nograd_forwards: velocity forwards without gradient per trained row, each of the row's CFG passes, beside
            its forward + backward: a KL term's reference, an old or EMA policy's velocity.
        row_latents: fp32 latents per trained row that cross from the rollout to the trainer (a trajectory's
            transition x_i, x_{i+1}: 2).
        sample_latents: fp32 latents per sample that cross (a clean sample the trainer re-noises itself: 1).
        row_scalar_bytes: bytes of each row's scalars (a transition's sample and step index in int64, its sigma,
            next sigma, behaviour log-prob and noise level in fp32: 32).
        sample_scalar_bytes: bytes per sample besides (its fp32 reward; a clean sample also its int64 index).
        logprob_rows: the rows carry behaviour log-probs, which a trainer that recomputes them pays for
            (``CostParams.old_logprob_passes``); a clean sample has none (an old policy's velocity is counted in
            ``nograd_forwards``).
    """

    nograd_forwards: float = 0.0
    row_latents: int = 2
    sample_latents: int = 0
    row_scalar_bytes: int = 2 * INT64 + 4 * FP32
    sample_scalar_bytes: int = FP32
    logprob_rows: bool = True

    def describe(self) -> str:
        """E.g. ``the clean latent a sample across the boundary, 2 no-grad forwards a row``."""
        ship = (f"{self.row_latents} latents a trained row" if self.row_latents else
                f"{self.sample_latents} latent a sample" if self.sample_latents else "no latents")
        extra = f", {self.nograd_forwards:g} no-grad forward(s) a row" if self.nograd_forwards else ""
        return f"{ship} across the boundary{extra}"


# What the paper recipes ship (Flow-GRPO's trajectory transitions, no reference forward counted: the calibration
# run trains without a KL term).
TRAJECTORY_ROWS = RowCost()


def clean_sample_rows(nograd_forwards: float) -> RowCost:
    """A forward-process method's numbers: the clean latent once per sample, no log-probs, ``nograd_forwards``
    per row (DiffusionNFT: the old policy's velocity, + the reference's with a KL term)."""
    return RowCost(nograd_forwards, row_latents=0, sample_latents=1, row_scalar_bytes=0,
                   sample_scalar_bytes=FP32 + INT64, logprob_rows=False)


def sample_bytes(rows: RowCost, rows_per_sample: int, latent_bytes: int, cond_bytes: int) -> int:
    """Bytes one sample moves from the rollout to the trainer: its trained rows' latents and scalars, its own
    latents and scalars, its conditioning once."""
    per_row = rows.row_latents * latent_bytes + rows.row_scalar_bytes
    return rows_per_sample * per_row + rows.sample_latents * latent_bytes + rows.sample_scalar_bytes + cond_bytes


def conditioning_bytes(config: dict[str, object], arch: str, text_tokens: int, passes: int, dtype_bytes: int = BF16,
                       cond_tokens: int = 0) -> int:
    """Bytes of one sample's conditioning as the rollout ships it (``models/*.py`` ``encode_prompts``): the prompt
    embeddings ``[text_tokens, D]`` (and a pooled ``[P]``, an int64 mask where the model has one) in the model's
    dtype, once per CFG pass (the negative prompt's travel with each sample), plus Qwen-Image-Edit's input-image
    latents (``cond_tokens`` x the transformer's input channels).

    ``config``: the transformer's config (``flops.variant_config`` or a built model's ``.config``).
    """
    width = next((int(config[k]) for k in _TEXT_DIM_KEYS if config.get(k)), 0)  # type: ignore[call-overload]
    pooled = int(config.get("pooled_projection_dim") or 0)  # type: ignore[call-overload]
    mask = text_tokens * INT64 if arch in _MASKED else 0
    image = cond_tokens * int(config.get("in_channels") or 0) * dtype_bytes  # type: ignore[call-overload]
    return passes * ((text_tokens * width + pooled) * dtype_bytes + mask) + image


class ModelSpec(Protocol):
    """What :func:`model_profile` reads of a config's ``[model]`` table (``digenrl.config.ModelConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def preset(self) -> str: ...
    @property
    def variant(self) -> str: ...
    @property
    def resolution(self) -> Sequence[int]: ...
    @property
    def num_frames(self) -> int: ...
    @property
    def text_len(self) -> int: ...
    @property
    def guidance_scale(self) -> float: ...
    @property
    def finetune(self) -> str: ...
    @property
    def lora_rank(self) -> int: ...


def lora_params(arch: str, rank: int, targets: str, variant: str = "", layers: int = 0) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the named target set of ``arch`` (at size ``variant``, its
    block stacks cut to ``layers``).

    ``targets``: ``"attn"`` (q, k, v, out of every attention, both streams) or ``"attn+mlp"`` (also the
    feed-forward in/out projections), matching flow_grpo's Qwen-Image / FLUX / Wan configs.
    """
    c = variant_config(arch, variant, layers)  # raises naming the known architectures and sizes
    d = c["num_attention_heads"] * c["attention_head_dim"]
    per_linear = lambda i, o: rank * (i + o)  # noqa: E731 - A is (r x in), B is (out x r)
    if arch in ("qwen-image", "qwen-image-edit"):
        attn, mlp, layers = 8 * per_linear(d, d), 2 * (per_linear(d, 4 * d) + per_linear(4 * d, d)), c["num_layers"]
        return layers * (attn + (mlp if targets == "attn+mlp" else 0))
    if arch in ("wan", "wan2.2"):  # (one expert's: a Wan2.2 A14B recipe trains one adapter per expert)
        attn, mlp = 8 * per_linear(d, d), per_linear(d, c["ffn_dim"]) + per_linear(c["ffn_dim"], d)
        return c["num_layers"] * (attn + (mlp if targets == "attn+mlp" else 0))
    if arch == "sd3":  # the joint attention of both streams; the last block has no context output projection
        return c["num_layers"] * 8 * per_linear(d, d) - per_linear(d, d)
    if arch in ("flux", "hunyuan-video"):
        double = 8 * per_linear(d, d) + (2 * (per_linear(d, 4 * d) + per_linear(4 * d, d)) if targets == "attn+mlp" else 0)
        single = 3 * per_linear(d, d) + (per_linear(d, 4 * d) + per_linear(5 * d, d) if targets == "attn+mlp" else 0)
        return c["num_layers"] * double + c["num_single_layers"] * single
    raise ConfigError(f"unknown architecture {arch!r}")


# VAE decode FLOPs of one sample, counted with FlopCounterMode on the meta device for the real default
# VAE configs (see count_vae_decode_flops), keyed by (arch, latent frames, latent height, latent width).
_VAE_DECODE_FLOPS: dict[tuple[str, int, int, int], int] = {
    ("qwen-image", 1, 64, 64): 2_843_337_555_968,
    ("flux", 1, 90, 90): 5_039_876_505_600,
    ("wan", 9, 30, 52): 28_087_123_783_680,
    ("hunyuan-video", 14, 60, 60): 298_739_467_468_800,
    # the shipped configs' resolutions (configs/*.toml; qwenimage's 512^2 is the paper's, above)
    ("flux", 1, 64, 64): 2_514_971_787_264,
    ("sd3", 1, 64, 64): 2_514_971_787_264,  # SD3.5's VAE is FLUX.1's architecture (other scaling factors)
    ("wan", 9, 60, 104): 112_752_200_171_520,
    ("hunyuan-video", 9, 40, 64): 124_870_570_803_200,
    # long video (configs/wan_long.toml, the long-video scenarios): Wan2.1 480x832 x 81 frames, HunyuanVideo 720p x 129
    ("wan", 21, 60, 104): 275_352_205_639_680,
    ("hunyuan-video", 33, 90, 160): 2_999_972_184_883_200,
}


def count_vae_decode_flops(arch: str, shape: SampleShape) -> int:
    """Count one decode of the real VAE on the meta device (imports diffusers; a few seconds)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import diffusers

    z = (1, 16, shape.latent_frames, shape.latent_height, shape.latent_width)
    with torch.device("meta"):
        if arch == "qwen-image":
            vae = diffusers.AutoencoderKLQwenImage()
        elif arch == "wan":
            vae = diffusers.AutoencoderKLWan()
        elif arch == "hunyuan-video":
            vae = diffusers.AutoencoderKLHunyuanVideo()
            vae.use_tiling = False  # tiling changes memory, not the FLOPs that matter here
        elif arch in ("flux", "sd3"):  # FLUX.1-dev's VAE (black-forest-labs/FLUX.1-dev vae/config.json), SD3.5's too
            vae = diffusers.AutoencoderKL(
                latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)
            z = (1, 16, shape.latent_height, shape.latent_width)
        else:
            raise ConfigError(f"unknown architecture {arch!r}")
        latents = torch.empty(z)
    with FlopCounterMode(display=False) as counter:
        vae.decode(latents)
    return int(counter.get_total_flops())


@functools.lru_cache(maxsize=64)
def vae_decode_flops(arch: str, shape: SampleShape) -> int:
    """Cached VAE decode FLOPs of one sample; counts on the meta device for shapes not in the table."""
    # A14B decodes with Wan2.1's VAE (TI2V-5B's 48-channel VAE: priced as Wan2.1's, not counted yet)
    arch = {"wan2.2": "wan", "qwen-image-edit": "qwen-image"}.get(arch, arch)
    key = (arch, shape.latent_frames, shape.latent_height, shape.latent_width)
    if key in _VAE_DECODE_FLOPS:
        return _VAE_DECODE_FLOPS[key]
    return count_vae_decode_flops(arch, shape)


class RewardSpec(Protocol):
    """What :func:`model_profile` reads of a config's ``[reward]`` table (``digenrl.config.RewardConfig``):
    ``weights`` and, where set, the ``models.<name>`` tables (``reward_models.model_path``)."""

    @property
    def weights(self) -> dict[str, float]: ...


def _reward_terms(reward: RewardSpec) -> tuple[float, str]:
    """FLOPs per scored sample of the config's weighted rewards, and what they are."""
    models = reward_models(reward)
    parts = [f"{m.reward}: {m.spec.arch}, {m.flops_per_image / 1e9:.1f} GFLOP per image" for m in models]
    off = [f"{name}: {OFF_DEVICE[name]}" for name, w in reward.weights.items() if w and name in OFF_DEVICE]
    what = "; ".join(parts + [f"{x}, no device FLOPs" for x in off]) or "no weighted reward"
    return float(sum(m.flops_per_image for m in models)), f"reward from the config ({what})"


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What one training recipe of one model costs, per sample.

    Attributes:
        name: display name (family and size, e.g. ``Wan2.1-1.3B``).
        arch: ``flops.ARCHITECTURES`` key.
        shape: latent grid and text length of one sample.
        cfg_rollout: transformer passes per denoising step while sampling (2 = true CFG).
        cfg_train: passes per trained transition (the loss recomputes the same guided velocity).
        trainable_params: LoRA parameters, or the full model when fine-tuning everything.
        text_encoder_params: parameters of the prompt encoder (run once per prompt).
        reward_flops: FLOPs to score one decoded sample (on the accelerator).
        variant: the transformer's size (``flops.VARIANTS``; ``""`` = the largest).
        recipe: where the shape and training recipe come from (``describe``).
        layers: every block stack cut to this many blocks (``model.layers``; 0 = the published depth).
        params: transformer parameters when they are not the published count (a cut model: the memory
            plan's count); 0 = ``param_count(arch, variant)``.
        rows: what the training algorithm adds per row and ships per sample (:class:`RowCost`).
        window: a sliding SDE window whose rollout runs fewer forwards than steps, changing with the version
            (MixGRPO-Flash: :class:`~digenrl.sim.window.SlidingWindow`); None: every step runs a forward.
    """

    name: str
    arch: str
    shape: SampleShape
    cfg_rollout: int
    cfg_train: int
    trainable_params: int
    text_encoder_params: float
    reward_flops: float
    variant: str = ""
    recipe: str = "the paper recipe"
    layers: int = 0
    params: int = 0
    rows: RowCost = TRAJECTORY_ROWS
    window: SlidingWindow | None = None

    @property
    def size(self) -> str:
        """The variant, ``""`` resolved to the family's largest."""
        return self.variant or default_variant(self.arch)

    @property
    def transformer_params(self) -> int:
        return self.params or param_count(self.arch, self.variant)

    @property
    def full_finetune(self) -> bool:
        return self.trainable_params >= self.transformer_params

    @property
    def forward_flops(self) -> int:
        """One transformer pass of one sample (one CFG branch)."""
        return forward_flops(self.arch, self.shape, variant=self.variant, layers=self.layers)

    @property
    def decode_flops(self) -> int:
        return vae_decode_flops(self.arch, self.shape)

    @property
    def text_flops(self) -> float:
        """Encoding one prompt: 2 x params x tokens (dense decoder/encoder forward)."""
        return 2.0 * self.text_encoder_params * self.shape.text_tokens

    @property
    def weight_bytes(self) -> int:
        """bf16 bytes of the full transformer (what a rollout engine holds)."""
        return BF16 * self.transformer_params

    @property
    def publish_bytes(self) -> int:
        """bf16 bytes a weight publish moves: the adapter for LoRA, everything for full fine-tuning."""
        return BF16 * self.trainable_params

    @property
    def latent_bytes(self) -> int:
        """fp32 bytes of one stored latent (16 channels), the unit of trajectory transfer."""
        s = self.shape
        return FP32 * 16 * s.latent_frames * s.latent_height * s.latent_width

    @property
    def cond_bytes(self) -> int:
        """bf16 bytes of one sample's conditioning as the rollout ships it (:func:`conditioning_bytes`)."""
        s = self.shape
        return conditioning_bytes(variant_config(self.arch, self.variant, self.layers), self.arch, s.text_tokens,
                                  self.cfg_rollout, BF16, s.cond_tokens)

    def boundary_bytes(self, rows_per_sample: int, rows: RowCost | None = None) -> int:
        """Bytes one sample moves from the rollout to the trainer: its trained rows' latents and scalars, its own
        latents and scalars, its conditioning once (``rows``: another algorithm's numbers, default this profile's)."""
        return sample_bytes(rows or self.rows, rows_per_sample, self.latent_bytes, self.cond_bytes)

    def describe(self) -> str:
        """E.g. ``Wan2.1-1.3B profile (33 frames at 480x832, 512 text tokens, 2 passes per step, LoRA 23.6 M
        params, 72.9 TFLOP per forward; from the config, ...)``."""
        s = self.shape
        pixels = f"{s.latent_height * 8}x{s.latent_width * 8}"
        frames = f"{(s.latent_frames - 1) * 4 + 1} frames at {pixels}" if s.latent_frames > 1 else pixels
        trained = "full fine-tune" if self.full_finetune else f"LoRA {self.trainable_params / 1e6:.1f} M params"
        if self.layers:
            frames = f"{self.layers} blocks per stack, {frames}"
        rows = "" if self.rows == TRAJECTORY_ROWS else f", {self.rows.describe()}"
        return (f"{self.name} profile ({frames}, {s.text_tokens} text tokens, {self.cfg_rollout} "
                f"pass{'es' if self.cfg_rollout > 1 else ''} per step, {trained}{rows}, {self.forward_flops / 1e12:.1f} "
                f"TFLOP per forward; {self.recipe})")


def _reward_vlm(params: float, tokens: int) -> float:
    return 2.0 * params * tokens


PROFILES: dict[str, ModelProfile] = {
    # veRL-Omni run_qwen_image_ocr_lora.sh / flow_grpo pickscore_qwenimage: 512^2, true CFG 4 in rollout
    # and training, LoRA r64 on attention + img/txt MLP. Prompt embeddings: OCR prompts padded to the
    # batch's longest, about 64 tokens after the 34 template tokens are dropped (max_sequence_length 256).
    # Text encoder Qwen2.5-VL-7B (7.6 B). Reward: Qwen3-VL-8B (8.8 B) reads 256 visual tokens (512^2,
    # patch 16, 2x2 merge) + ~64 prompt tokens and writes ~32 tokens: ~352 tokens of forward.
    "qwen-image": ModelProfile(
        "Qwen-Image-20B", "qwen-image", SampleShape.from_pixels(1, 512, 512, 64), 2, 2,
        lora_params("qwen-image", 64, "attn+mlp"), 7.6e9, _reward_vlm(8.8e9, 352), "20B"),
    # DanceGRPO FLUX (16 GPUs): 720^2, guidance-distilled (one pass), full fine-tune, T5 embeddings
    # precomputed at 512 tokens (so no text-encoder cost). Reward HPS-v2.1 (OpenCLIP ViT-H/14, 0.99 B
    # params): its image tower on 257 tokens and text tower on 77, counted (reward_models.py: 381.7 GFLOP).
    "flux": ModelProfile(
        "FLUX.1-12B", "flux", SampleShape.from_pixels(1, 720, 720, 512), 1, 1,
        param_count("flux"), 0.0, float(PUBLISHED["hpsv2"].flops_per_image), "12B"),
    # flow_grpo general_ocr_wan2_1 recipe on the 14 B model (the GenRL baseline trains Wan2.1-14B):
    # 240x416, 33 frames, CFG 4.5 = two passes in rollout and training, LoRA r32 on attention.
    # UMT5-XXL encoder (5.7 B) at 512 tokens. Reward video_ocr runs PaddleOCR on the CPU: no GPU FLOPs.
    "wan": ModelProfile(
        "Wan2.1-14B", "wan", SampleShape.from_pixels(33, 240, 416, 512), 2, 2,
        lora_params("wan", 32, "attn", "14B"), 5.7e9, 0.0, "14B"),
    # DanceGRPO HunyuanVideo T2V: 480x480, 53 frames, guidance-distilled, full fine-tune, embeddings
    # precomputed (LLaVA-Llama-3-8B, 256 tokens). Reward VideoAlign (Qwen2-VL-2B) on sampled frames:
    # ~2.2 B params x ~2048 visual+text tokens.
    "hunyuan-video": ModelProfile(
        "HunyuanVideo-13B", "hunyuan-video", SampleShape.from_pixels(53, 480, 480, 256), 1, 1,
        param_count("hunyuan-video"), 0.0, _reward_vlm(2.2e9, 2048), "13B"),
    # flow_grpo pickscore_sd3 / general_ocr_sd3 (config/grpo.py) on SD3.5-Medium: 512^2, true CFG 4.5 in
    # rollout and training, LoRA r32 on the joint attention (scripts/train_sd3.py), T5 at 128 tokens after 77
    # CLIP tokens. Text encoders CLIP-L (124 M) + CLIP-G (695 M) + T5-XXL (4.76 B). Reward PickScore (CLIP-H),
    # counted (reward_models.py).
    "sd3": ModelProfile(
        "SD3.5-medium", "sd3", SampleShape.from_pixels(1, 512, 512, 77 + 128), 2, 2,
        lora_params("sd3", 32, "attn", "medium"), 5.58e9, float(PUBLISHED["pickscore"].flops_per_image), "medium"),
    # veRL-Omni's Wan2.2 recipe (examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_v1.sh, TI2V-5B) at
    # A14B as configs/wan22.toml trains it: 480x832, 9 frames, CFG (4 / 3) = two passes, LoRA r32 on the
    # attention of both experts (each step runs one 14 B expert), UMT5-XXL (5.7 B) at 512 tokens. Reward
    # HPSv3 (a Qwen2-VL-7B reward model, ~8.3 B) on one frame: ~1024 tokens, approximated as a VLM forward.
    "wan2.2": ModelProfile(
        "Wan2.2-A14B", "wan2.2", SampleShape.from_pixels(9, 480, 832, 512), 2, 2,
        2 * lora_params("wan2.2", 32, "attn", "A14B"), 5.7e9, _reward_vlm(8.3e9, 1024), "A14B"),
    # flow_grpo config/grpo.py counting_qwenimage_edit (Qwen/Qwen-Image-Edit): 512^2, 10 steps, true CFG 4, LoRA
    # (r64 on attention + MLPs, as its Qwen-Image recipe), noise level 1.0. The transformer's sequence holds the
    # 1024 noise tokens and the input image's 4096 (VAE-encoded at 1024², as the pipelines and flow_grpo's
    # VAE_IMAGE_SIZE); the text stream holds the instruction and the input image as Qwen2.5-VL-7B saw it (1369
    # image tokens at 1024²), padded to 1536. Reward GenEval (0.8, an object detector on a server) + image
    # similarity (0.2, CLIP-L image features: 2 images per sample).
    "qwen-image-edit": ModelProfile(
        "Qwen-Image-Edit-20B", "qwen-image-edit",
        replace(SampleShape.from_pixels(1, 512, 512, 1536), cond_tokens=edit_image_tokens(EDIT_VAE_IMAGE_AREA, 512, 512)),
        2, 2,
        lora_params("qwen-image-edit", 64, "attn+mlp", "edit"), 7.6e9, 2.0 * float(PUBLISHED["clipscore"].flops_per_image),
        "edit"),
}
# Each paper recipe's trainable set, to re-derive it at another size: (LoRA rank, targets); rank 0 = full.
_RECIPE_TRAINING = {"qwen-image": (64, "attn+mlp"), "qwen-image-edit": (64, "attn+mlp"), "flux": (0, ""),
                    "wan": (32, "attn"), "wan2.2": (32, "attn"), "hunyuan-video": (0, ""), "sd3": (32, "attn")}


def profile(name: str, variant: str = "") -> ModelProfile:
    """The paper recipe of model ``name`` (a ``PROFILES`` key) at size ``variant`` (``""``: the recipe's own).

    Raises:
        ConfigError: unknown key or size; lists the known ones.
    """
    if name not in PROFILES:
        raise ConfigError(f"unknown model profile {name!r}; known: {', '.join(PROFILES)}")
    prof = PROFILES[name]
    if not variant or variant == prof.variant:
        return prof
    rank, targets = _RECIPE_TRAINING[name]
    experts = _EXPERTS.get((prof.arch, variant), 1)
    trainable = experts * lora_params(prof.arch, rank, targets, variant) if rank else param_count(prof.arch, variant)
    return replace(prof, name=f"{_FAMILY[prof.arch]}-{variant}", variant=variant,
                   recipe=f"the {prof.name} paper recipe", trainable_params=trainable)


def model_profile(m: ModelSpec, trainable_params: int | None = None,
                  transformer_params: int | None = None, reward: RewardSpec | None = None,
                  input_images: int = 1, rows: RowCost = TRAJECTORY_ROWS) -> ModelProfile:
    """What one sample of a config costs (``m``: its ``[model]`` table): the model at ``model.variant`` (its
    block stacks cut to ``model.layers`` when set), its resolution, frames, text length, CFG passes and
    trainable set; text encoder as the model's paper recipe; reward models as ``reward`` (the config's
    ``[reward]`` table) weights them, or as the paper recipe without it.

    ``trainable_params`` / ``transformer_params``: the exact counts (the memory plan's, on the meta model,
    as ``plan.fleet.config_profile`` passes them); defaults: the ``lora_params`` formula on the model's
    default targets (the whole transformer for ``full``) and the published transformer's count.
    ``input_images``: Qwen-Image-Edit(-Plus)'s input images a prompt (``Config.input_images``), each
    adding its tokens to the sequence. ``rows``: what the config's training algorithm adds per row and ships per
    sample (``plan.rows.row_cost``); default: Flow-GRPO's transitions without a reference forward.

    Raises:
        ConfigError: a preset whose FLOPs are not the published architecture's (a tiny model: price it with
            measured costs), or a resolution/frame count the VAE cannot take.
    """
    if m.preset not in _PUBLISHED_PRESETS:
        raise ConfigError(f"model.preset = {m.preset!r}: the simulator's FLOP profiles are the published "
                          f"architectures (preset {' / '.join(map(repr, _PUBLISHED_PRESETS))}); price a tiny preset "
                          "with the costs `digenrl bench bubbles --real` measured (--costs FILE)")
    arch = ARCH_OF_MODEL[m.name]
    variant = m.variant or default_variant(arch)
    layers = int(getattr(m, "layers", 0))  # model.layers: a 'random'/'full' model cut to fewer blocks
    try:
        height, width = m.resolution[0], m.resolution[1]
        text = (m.text_len or _TEXT_TOKENS[arch]) + _FIXED_TEXT_TOKENS.get(arch, 0)
        shape = SampleShape.from_pixels(m.num_frames, height, width, text, SPATIAL_FACTOR.get((arch, variant), 8))
        if arch == "qwen-image-edit":  # the input image's tokens (model.image_area; 0 = the pipelines' 1024²)
            area = int(getattr(m, "image_area", 0)) or EDIT_VAE_IMAGE_AREA
            shape = replace(shape, cond_tokens=max(1, input_images) * edit_image_tokens(area, height, width))
    except ConfigError as exc:
        raise ConfigError(f"model.resolution / model.num_frames: {exc}") from exc
    passes = 2 if arch in _TRUE_CFG and m.guidance_scale > 1.0 else 1
    params = transformer_params or param_count(arch, variant)
    if trainable_params is None:
        lora = m.finetune == "lora"
        trained = {"both": _EXPERTS.get((arch, variant), 1)}.get(getattr(m, "train_experts", "both"), 1)
        trainable_params = (trained * lora_params(arch, m.lora_rank, _LORA_TARGETS[arch], variant, layers) if lora
                            else params)
    paper = PROFILES[arch]
    if reward is None:
        reward_flops, recipe = paper.reward_flops, f"from the config, text encoder and reward model as the {paper.name} paper recipe"
    else:
        reward_flops, terms = _reward_terms(reward)
        recipe = f"from the config, {terms}, text encoder as the {paper.name} paper recipe"
    return ModelProfile(f"{_FAMILY[arch]}-{variant}", arch, shape, passes, passes, trainable_params,
                        paper.text_encoder_params, reward_flops, variant, recipe, layers, transformer_params or 0, rows)
