"""Preset ``random``: the published architectures at their real size with random weights, on ``model.device``.

What `digenrl plan` counts on the meta device (``models/full.py``), built for real so that speed and
memory can be measured without the checkpoints (DESIGN §9: speed does not depend on the weights'
values). The result is the pipeline object ``pretrained`` loads (the real diffusers pipeline class, the
real-size VAE and, by default, the real-size text encoders), so every adapter, LoRA, FSDP, CFG and
schedule path runs unchanged.

How it is built, per component:

* **on the device, in the precision**: constructed under ``torch.device(model.device)`` with the
  default dtype set to ``model.dtype`` (as ``from_pretrained`` does), so a 20 B transformer never
  exists in fp32 or on the host; the modules ``from_pretrained`` keeps in fp32 (Wan2.1's norms and
  time embedder) are upcast afterwards, as it would load them. Rotary tables are what the
  constructors compute on that device: Qwen-Image's ``QwenEmbedRope`` tables (plain attributes, no
  buffers) and Wan2.1's ``freqs_cos``/``freqs_sin`` buffers in fp32 at construction; FLUX.1's and
  HunyuanVideo's in every forward. The default dtype is process-wide while a model is constructed (as
  in ``from_pretrained``): ``policy.build_model`` builds one model at a time.
* **the same weights on every device**: every random fill of the construction (the libraries' own
  initialisers: ``uniform_``, ``normal_``, ``randn``, ``rand``) is drawn on the host by
  :class:`HostDraws` and copied, so a rollout actor on one GPU model and a trainer on another start
  from identical weights (a CUDA generator's stream depends on the GPU's SM count), and a CPU build
  shows the values a GPU holds. Deterministic in ``model.seed``.
* **text**: ``model.text_encoder = "model"`` builds the real-size text encoders with the byte-level
  tokenizers of the tiny presets (``_text.py``; their ids lie inside every real vocabulary);
  ``"random-embeds"`` builds none and replaces the pipeline's text-encoder step (its
  ``_get_*_prompt_embeds``) by seeded random features of the encoder's shape (:class:`RandomEmbeds`),
  so the pipeline's own ``encode_prompt`` still pads, masks and repeats them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from digenrl.models._common import seeded
from digenrl.models.full import component_specs, construct
from digenrl.models.registry import TEXT_ENCODERS

__all__ = ["HostDraws", "RandomEmbeds", "build_random_pipeline", "SECOND_EXPERT_SEED"]

log = logging.getLogger(__name__)

# The seed offset of a second expert transformer (Wan2.2 A14B's low-noise one, random and tiny presets): seed is
# the transformer's, +1 the VAE's, +2 and +3 the text encoders', +4 the toy VAE init (policy.py); so the experts
# differ, and cutting or dropping components leaves the others' weights alone.
SECOND_EXPERT_SEED = 5

_CHUNK = 1 << 22  # elements of one host draw (16 MB in fp32), each from its own generator
_aten = torch.ops.aten
_RANDOM_NAMES = ("rand", "normal", "uniform", "bernoulli", "exponential", "cauchy", "geometric", "multinomial")


class HostDraws(TorchDispatchMode):
    """Draw every random fill of a construction on the host in fp32, then cast and copy it to its tensor.

    Each filled tensor takes one seed from the host generator (seed it around the construction), in
    construction order, and is filled in fixed chunks of ``_CHUNK`` elements, chunk ``i`` from a
    generator seeded ``seed + i``, on ``pool``'s threads. The values depend on neither the device, the
    dtype (drawn in fp32, rounded once) nor the thread count; at most one chunk per thread sits on the
    host. Nothing is drawn on ``meta``. A random op this mode does not know runs as it would
    (``unknown`` lists it, and the build warns; the tests require no such warning for any family).
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self.pool = pool
        self.unknown: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fills = {_aten.uniform_.default: ("uniform", "from", "to"), _aten.normal_.default: ("normal", "mean", "std")}
        if func in fills and kwargs.get("generator") is None:
            kind, lo, hi = fills[func]  # uniform_(self, from=0, to=1) / normal_(self, mean=0, std=1)
            a = args[1] if len(args) > 1 else kwargs.get(lo, 0.0)
            b = args[2] if len(args) > 2 else kwargs.get(hi, 1.0)
            self._fill(args[0], kind, a, b)
            return args[0]
        if func in (_aten.randn.default, _aten.rand.default):
            out = torch.empty(args[0], dtype=kwargs.get("dtype") or torch.get_default_dtype(),
                              device=kwargs.get("device") or "cpu")
            self._fill(out, "normal" if func is _aten.randn.default else "uniform", 0.0, 1.0)
            return out
        if any(n in func.overloadpacket.__name__ for n in _RANDOM_NAMES):
            self.unknown.append(str(func))
        return func(*args, **kwargs)

    def _fill(self, t: torch.Tensor, kind: str, a: float, b: float) -> None:
        if t.device.type == "meta":
            return
        seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        n = t.numel()
        flat = t.view(-1) if t.is_contiguous() else torch.empty(n, dtype=t.dtype, device=t.device)

        def chunk(i: int) -> None:
            lo = i * _CHUNK
            host = torch.empty(min(_CHUNK, n - lo), dtype=torch.float32, device="cpu")
            g = torch.Generator().manual_seed(seed + i)
            if kind == "uniform":
                host.uniform_(a, b, generator=g)
            else:
                host.normal_(a, b, generator=g)
            flat[lo:lo + host.numel()].copy_(host.to(t.dtype))

        list(self.pool.map(chunk, range(-(-n // _CHUNK))))
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))


@contextlib.contextmanager
def _building(device: str | torch.device, dtype: torch.dtype) -> Iterator[ThreadPoolExecutor]:
    """Construct on ``device`` with ``dtype`` as the default float dtype (restored after, also on error)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool:
            yield pool
    finally:
        torch.set_default_dtype(previous)


def _keep_fp32(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Upcast the parameters ``from_pretrained`` would load in fp32 at ``dtype`` (its own rule per library).

    diffusers: ``_keep_in_fp32_modules`` at any lower precision; transformers: ``_keep_in_fp32_modules``
    at fp16 only, ``_keep_in_fp32_modules_strict`` at fp16 and bf16.
    """
    if dtype == torch.float32:
        return
    if hasattr(module, "_keep_in_fp32_modules_strict"):  # a transformers model
        keep = set(module._keep_in_fp32_modules_strict or ())
        if dtype == torch.float16:
            keep |= set(module._keep_in_fp32_modules or ())
    else:
        keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, p in module.named_parameters():
        if keep & set(name.split(".")):
            p.data = p.data.float()


def _component(cls_name: str, kwargs: dict[str, Any], dtype: torch.dtype, seed: int, pool: ThreadPoolExecutor,
               device: str | torch.device) -> torch.nn.Module:
    mode = HostDraws(pool)
    with seeded(seed), mode:
        module = construct(cls_name, kwargs, dtype)
    if mode.unknown:
        log.warning("preset random: %s drew %s from the %s generator; those weights may differ between device "
                    "models", cls_name, sorted(set(mode.unknown)), torch.device(device).type)
    _keep_fp32(module, dtype)
    return module.eval()


def _family(name: str, variant: str = "") -> tuple[Any, dict[str, Any]]:
    """(pipeline class, tokenizers) of a family: its diffusers pipeline, byte tokenizers of its encoders' shapes."""
    import diffusers

    from digenrl.models import _text

    if name == "qwenimage_edit":  # processor None: the adapter attaches its own (models/_text.py QwenVLByteProcessor)
        cls = diffusers.QwenImageEditPlusPipeline if variant == "edit-plus" else diffusers.QwenImageEditPipeline
        return cls, {"tokenizer": _text.byte_qwen2vl_tokenizer(), "processor": None}
    if name == "qwenimage":
        return diffusers.QwenImagePipeline, {"tokenizer": _text.byte_qwen2_tokenizer()}
    if name == "flux":
        return diffusers.FluxPipeline, {"tokenizer": _text.byte_clip_tokenizer(), "tokenizer_2": _text.byte_t5_tokenizer()}
    if name in ("wan21", "wan22"):
        return diffusers.WanPipeline, {"tokenizer": _text.byte_t5_tokenizer()}
    if name == "sd3":
        return diffusers.StableDiffusion3Pipeline, {"tokenizer": _text.byte_clip_tokenizer(),
                                                    "tokenizer_2": _text.byte_clip_tokenizer(),
                                                    "tokenizer_3": _text.byte_t5_tokenizer()}
    if name == "hunyuanvideo":
        return diffusers.HunyuanVideoPipeline, {"tokenizer": _text.byte_llama_tokenizer(),
                                                "tokenizer_2": _text.byte_clip_tokenizer()}
    raise ValueError(f"no random preset for model {name!r}")


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The special ids of a byte tokenizer, for its real-size text encoder's config (CLIP pools at its EOS)."""
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
           "bos_token_id": tokenizer.bos_token_id}
    if "<|image_pad|>" in tokenizer.get_vocab():  # the edit models' Qwen2.5-VL reads images at these tokens
        start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
        ids.update(vision_start_token_id=start, image_token_id=pad, vision_end_token_id=end)
    return ids


def build_random_pipeline(name: str, scheduler: Any, *, pipeline_kwargs: dict[str, Any] | None = None,
                          variant: str = "", layers: int = 0, text_encoder: str = "model",
                          device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """``name``'s published pipeline at real size (``layers``: see ``full.component_specs``), random weights.

    ``scheduler`` (the adapter's stock scheduler) and ``pipeline_kwargs`` (init arguments beyond the
    components, e.g. Wan2.2's ``boundary_ratio``) come from the adapter, which knows its checkpoint's.

    Seeds: ``seed`` the transformer, ``seed + 1`` the VAE, ``seed + 2`` (and ``+ 3``) the text encoders,
    so cutting the depth or dropping the text encoders leaves the other components' weights as they were.

    Raises:
        ConfigError: unknown model name or variant.
        ValueError: ``text_encoder`` is not one of :data:`TEXT_ENCODERS`.
    """
    if text_encoder not in TEXT_ENCODERS:
        raise ValueError(f"text_encoder must be one of {TEXT_ENCODERS}, got {text_encoder!r}")
    specs = component_specs(name, variant, layers)
    pipeline_cls, tokenizers = _family(name, variant)
    texts = sorted(k for k in specs if k.startswith("text_encoder"))
    parts: dict[str, Any] = dict.fromkeys(texts)
    with _building(device, dtype) as pool:
        parts["transformer"] = _component(*specs["transformer"], dtype, seed, pool, device)
        parts["vae"] = _component(*specs["vae"], dtype, seed + 1, pool, device)
        if "transformer_2" in specs:  # Wan2.2 A14B's low-noise expert
            parts["transformer_2"] = _component(*specs["transformer_2"], dtype, seed + SECOND_EXPERT_SEED, pool,
                                                device)
        if text_encoder == "model":
            for i, key in enumerate(texts):
                cls_name, kwargs = specs[key]
                tok = tokenizers[key.replace("text_encoder", "tokenizer")]
                parts[key] = _component(cls_name, {**kwargs, **_token_ids(tok)}, dtype, seed + 2 + i, pool, device)
    pipe = pipeline_cls(scheduler=scheduler, **parts, **tokenizers, **(pipeline_kwargs or {}))
    if text_encoder == "random-embeds":
        RandomEmbeds(name, pipe, seed).install()
    return pipe


class RandomEmbeds:
    """Seeded random text features in place of a pipeline's text encoders (``model.text_encoder = "random-embeds"``).

    :meth:`install` replaces the pipeline's per-encoder steps (``_get_qwen_prompt_embeds``,
    ``_get_t5_prompt_embeds``, ``_get_llama_prompt_embeds``, ``_get_clip_prompt_embeds``) on the instance,
    so ``pipe.encode_prompt`` (and the adapters around it) run as with real encoders and return the
    same shapes and keys: Qwen-Image ``[B, n, 3584]`` + mask, FLUX.1 T5 ``[B, L, 4096]`` + pooled CLIP
    ``[B, 768]``, Wan2.1 ``[B, L, 4096]`` zero past the prompt, HunyuanVideo ``[B, L, 4096]`` + mask +
    pooled ``[B, 768]``, SD3.5 ``[B, 77 + L, 4096]`` (CLIP-L and CLIP-G zero-padded, then T5) + pooled
    ``[B, 2048]``. A prompt's features are ``N(0, 1)`` from a generator seeded by a hash of ``(seed, prompt)``:
    the same prompt always gets the same features, in any batch, process or device; its valid length ``n``
    is its token count under the pipeline's byte tokenizer (at most ``L``).
    """

    def __init__(self, name: str, pipe: Any, seed: int) -> None:
        c = pipe.transformer.config
        self.name, self.seed, self.tokenizer = name, seed, pipe.tokenizer
        key = {"wan21": "text_dim", "wan22": "text_dim", "hunyuanvideo": "text_embed_dim"}.get(name, "joint_attention_dim")
        self.dim = c.get(key)  # the text features' width the transformer takes
        self.pooled_dim = c.get("pooled_projection_dim")
        self._pipe = pipe

    def install(self) -> None:
        """Put the random steps on the pipeline instance (its class and every other pipeline keep theirs)."""
        hooks = {"qwenimage": {"_get_qwen_prompt_embeds": self.qwen},
                 "qwenimage_edit": {"_get_qwen_prompt_embeds": self.qwen_edit},
                 "flux": {"_get_t5_prompt_embeds": self.t5, "_get_clip_prompt_embeds": self.pooled},
                 "wan21": {"_get_t5_prompt_embeds": self.t5}, "wan22": {"_get_t5_prompt_embeds": self.t5},
                 "hunyuanvideo": {"_get_llama_prompt_embeds": self.llama, "_get_clip_prompt_embeds": self.pooled},
                 "sd3": {"_get_t5_prompt_embeds": self.t5, "_get_clip_prompt_embeds": self.clip}}
        for attr, fn in hooks[self.name].items():
            object.__setattr__(self._pipe, attr, fn)

    # -- features -------------------------------------------------------------------------------

    def features(self, prompt: str, kind: str, rows: int, dim: int) -> torch.Tensor:
        """``[rows, dim]`` fp32 features of ``prompt`` (on the host)."""
        digest = hashlib.sha256(f"{self.seed}\0{kind}\0{prompt}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return torch.randn(rows, dim, generator=g, device="cpu")

    def length(self, prompt: str, most: int) -> int:
        return max(1, min(most, len(self.tokenizer(prompt).input_ids)))

    def _sequence(self, prompts: list[str], width: int, *, zero_pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, width, D]`` features and ``[B, width]`` mask (ones for each prompt's ``n`` tokens)."""
        emb = torch.zeros(len(prompts), width, self.dim, dtype=torch.float32, device="cpu")
        mask = torch.zeros(len(prompts), width, dtype=torch.long, device="cpu")
        for i, p in enumerate(prompts):
            n = self.length(p, width)
            rows = n if zero_pad else width  # zero padding: the features do not depend on the batch's width
            emb[i, :rows] = self.features(p, "sequence", rows, self.dim)
            mask[i, :n] = 1
        return emb, mask

    @staticmethod
    def _list(prompt: str | list[str]) -> list[str]:
        return [prompt] if isinstance(prompt, str) else list(prompt)

    def _dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return dtype or self._pipe.transformer.dtype

    # -- the pipelines' text-encoder steps ------------------------------------------------------

    def qwen(self, prompt: str | list[str], device: Any = None, dtype: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = self._list(prompt)
        width = max(self.length(p, self._pipe.tokenizer_max_length) for p in prompts)
        emb, mask = self._sequence(prompts, width, zero_pad=True)  # padded to the batch's longest, as the pipeline
        return emb.to(device=device, dtype=self._dtype(dtype)), mask.to(device=device)

    def qwen_edit(self, prompt: str | list[str], image: Any = None, device: Any = None,
                  dtype: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The edit pipelines' step: as :meth:`qwen`, each prompt's length also counting the image tokens Qwen2.5-VL
        would read (the pipeline's processor's grid; the features do not depend on the images, their count does)."""
        extra = 0
        if image is not None:
            proc = self._pipe.processor.image_processor
            grid = proc(images=image if isinstance(image, list) else [image], return_tensors="pt")["image_grid_thw"]
            extra = int(grid.prod(-1).sum()) // proc.merge_size ** 2
        prompts = self._list(prompt)
        rows = [self.length(p, self._pipe.tokenizer_max_length) + extra for p in prompts]
        emb = torch.zeros(len(prompts), max(rows), self.dim, dtype=torch.float32, device="cpu")
        mask = torch.zeros(len(prompts), max(rows), dtype=torch.long, device="cpu")
        for i, (p, n) in enumerate(zip(prompts, rows, strict=True)):
            emb[i, :n], mask[i, :n] = self.features(p, "sequence", n, self.dim), 1
        return emb.to(device=device, dtype=self._dtype(dtype)), mask.to(device=device)

    def t5(self, prompt: str | list[str], num_images_per_prompt: int = 1, max_sequence_length: int = 512,
           device: Any = None, dtype: Any = None, num_videos_per_prompt: int | None = None) -> torch.Tensor:
        repeat = num_videos_per_prompt or num_images_per_prompt
        # FLUX.1 keeps T5's outputs at its padding; Wan2.1 zeroes them
        emb, _ = self._sequence(self._list(prompt), max_sequence_length, zero_pad=self.name in ("wan21", "wan22"))
        return emb.repeat_interleave(repeat, 0).to(device=device, dtype=self._dtype(dtype))

    def llama(self, prompt: str | list[str], prompt_template: Any = None, num_videos_per_prompt: int = 1,
              device: Any = None, dtype: Any = None, max_sequence_length: int = 256,
              num_hidden_layers_to_skip: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        emb, mask = self._sequence(self._list(prompt), max_sequence_length, zero_pad=False)
        emb, mask = emb.repeat_interleave(num_videos_per_prompt, 0), mask.repeat_interleave(num_videos_per_prompt, 0)
        return emb.to(device=device, dtype=self._dtype(dtype)), mask.to(device=device)

    def clip(self, prompt: str | list[str], num_images_per_prompt: int = 1, device: Any = None,
             clip_skip: int | None = None, clip_model_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """SD3's per-CLIP step: ``[B, 77, width]`` hidden states and ``[B, projection]`` pooled features of encoder
        ``clip_model_index`` (0: CLIP-L, 1: CLIP-G), as wide as the pipeline's encoders, else the published ones."""
        encoder = (self._pipe.text_encoder, self._pipe.text_encoder_2)[clip_model_index]
        width, proj = ((encoder.config.hidden_size, encoder.config.projection_dim) if encoder is not None else
                       ((768, 768), (1280, 1280))[clip_model_index])
        prompts = self._list(prompt)
        seq = torch.stack([self.features(p, f"clip{clip_model_index}", self._pipe.tokenizer_max_length, width)
                           for p in prompts])
        pooled = torch.stack([self.features(p, f"clip{clip_model_index}-pooled", 1, proj)[0] for p in prompts])
        dt = self._dtype(None)
        return (seq.repeat_interleave(num_images_per_prompt, 0).to(device=device, dtype=dt),
                pooled.repeat_interleave(num_images_per_prompt, 0).to(device=device, dtype=dt))

    def pooled(self, prompt: str | list[str], num_images_per_prompt: int = 1, device: Any = None, dtype: Any = None,
               max_sequence_length: int = 77, num_videos_per_prompt: int | None = None) -> torch.Tensor:
        repeat = num_videos_per_prompt or num_images_per_prompt
        emb = torch.stack([self.features(p, "pooled", 1, self.pooled_dim)[0] for p in self._list(prompt)])
        return emb.repeat_interleave(repeat, 0).to(device=device, dtype=self._dtype(dtype))
