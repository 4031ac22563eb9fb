"""The four paper models as the cost model sees them: FLOPs per forward, CFG passes, bytes to move.

Every number here is either counted (transformer FLOPs from ``flops.py``; VAE decode FLOPs counted once
with ``FlopCounterMode`` on the meta device and cached in ``_VAE_DECODE_FLOPS``) or a published model
size (text encoders, reward models, LoRA targets), each with its source in a comment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from digenrl.errors import ConfigError
from digenrl.sim.flops import DEFAULT_CONFIGS, SampleShape, forward_flops, param_count

__all__ = ["ModelProfile", "PROFILES", "profile", "vae_decode_flops", "count_vae_decode_flops", "lora_params"]

BF16 = 2
FP32 = 4


def lora_params(arch: str, rank: int, targets: str) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the named target set of ``arch``.

    ``targets``: ``"attn"`` (q, k, v, out of every attention, both streams) or ``"attn+mlp"`` (also the
    feed-forward in/out projections), matching flow_grpo's Qwen-Image / FLUX / Wan configs.
    """
    c = DEFAULT_CONFIGS[arch]
    d = c["num_attention_heads"] * c["attention_head_dim"]
    per_linear = lambda i, o: rank * (i + o)  # noqa: E731 - A is (r x in), B is (out x r)
    if arch == "qwen-image":
        attn, mlp, layers = 8 * per_linear(d, d), 2 * (per_linear(d, 4 * d) + per_linear(4 * d, d)), c["num_layers"]
        return layers * (attn + (mlp if targets == "attn+mlp" else 0))
    if arch == "wan":
        attn, mlp = 8 * per_linear(d, d), per_linear(d, c["ffn_dim"]) + per_linear(c["ffn_dim"], d)
        return c["num_layers"] * (attn + (mlp if targets == "attn+mlp" else 0))
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
        elif arch == "flux":  # FLUX.1-dev's VAE (black-forest-labs/FLUX.1-dev vae/config.json)
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
    key = (arch, shape.latent_frames, shape.latent_height, shape.latent_width)
    if key in _VAE_DECODE_FLOPS:
        return _VAE_DECODE_FLOPS[key]
    return count_vae_decode_flops(arch, shape)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What one training recipe of one model costs, per sample.

    Attributes:
        name: display name.
        arch: ``flops.ARCHITECTURES`` key.
        shape: latent grid and text length of one sample.
        cfg_rollout: transformer passes per denoising step while sampling (2 = true CFG).
        cfg_train: passes per trained transition (the loss recomputes the same guided velocity).
        trainable_params: LoRA parameters, or the full model when fine-tuning everything.
        text_encoder_params: parameters of the prompt encoder (run once per prompt).
        reward_flops: FLOPs to score one decoded sample (on the accelerator).
    """

    name: str
    arch: str
    shape: SampleShape
    cfg_rollout: int
    cfg_train: int
    trainable_params: int
    text_encoder_params: float
    reward_flops: float

    @property
    def full_finetune(self) -> bool:
        return self.trainable_params >= param_count(self.arch)

    @property
    def forward_flops(self) -> int:
        """One transformer pass of one sample (one CFG branch)."""
        return forward_flops(self.arch, self.shape)

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
        return BF16 * param_count(self.arch)

    @property
    def publish_bytes(self) -> int:
        """bf16 bytes a weight publish moves: the adapter for LoRA, everything for full fine-tuning."""
        return BF16 * self.trainable_params

    @property
    def latent_bytes(self) -> int:
        """fp32 bytes of one stored latent (16 channels), the unit of trajectory transfer."""
        s = self.shape
        return FP32 * 16 * s.latent_frames * s.latent_height * s.latent_width


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
        lora_params("qwen-image", 64, "attn+mlp"), 7.6e9, _reward_vlm(8.8e9, 352)),
    # DanceGRPO FLUX (16 GPUs): 720^2, guidance-distilled (one pass), full fine-tune, T5 embeddings
    # precomputed at 512 tokens (so no text-encoder cost). Reward HPS-v2.1 (OpenCLIP ViT-H/14, ~0.99 B
    # params; 257 image + 77 text tokens).
    "flux": ModelProfile(
        "FLUX.1-12B", "flux", SampleShape.from_pixels(1, 720, 720, 512), 1, 1,
        param_count("flux"), 0.0, _reward_vlm(0.99e9, 334)),
    # flow_grpo general_ocr_wan2_1 recipe on the 14 B model (the GenRL baseline trains Wan2.1-14B):
    # 240x416, 33 frames, CFG 4.5 = two passes in rollout and training, LoRA r32 on attention.
    # UMT5-XXL encoder (5.7 B) at 512 tokens. Reward video_ocr runs PaddleOCR on the CPU: no GPU FLOPs.
    "wan": ModelProfile(
        "Wan2.1-14B", "wan", SampleShape.from_pixels(33, 240, 416, 512), 2, 2,
        lora_params("wan", 32, "attn"), 5.7e9, 0.0),
    # DanceGRPO HunyuanVideo T2V: 480x480, 53 frames, guidance-distilled, full fine-tune, embeddings
    # precomputed (LLaVA-Llama-3-8B, 256 tokens). Reward VideoAlign (Qwen2-VL-2B) on sampled frames:
    # ~2.2 B params x ~2048 visual+text tokens.
    "hunyuan-video": ModelProfile(
        "HunyuanVideo-13B", "hunyuan-video", SampleShape.from_pixels(53, 480, 480, 256), 1, 1,
        param_count("hunyuan-video"), 0.0, _reward_vlm(2.2e9, 2048)),
}


def profile(name: str) -> ModelProfile:
    """Profile by key.

    Raises:
        ConfigError: unknown key; lists the known ones.
    """
    if name not in PROFILES:
        raise ConfigError(f"unknown model profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
