"""Byte-level tokenizers and tiny text encoders of the real families, built without any download.

The hub tokenizers of the real models cannot be fetched here, so the tiny presets use tokenizers of
the *same transformers classes* built from a byte alphabet (every UTF-8 string tokenizes, no merges),
paired with randomly initialised text encoders of the real architectures:

* Qwen-Image: ``Qwen2Tokenizer`` + ``Qwen2_5_VLForConditionalGeneration`` (text path used); the edit models
  also its vision path, fed by :class:`QwenVLByteProcessor`.
* FLUX.1: ``CLIPTokenizer`` + ``CLIPTextModel`` (pooled) and ``T5Tokenizer`` + ``T5EncoderModel``.
* Wan2.1: ``T5Tokenizer`` + ``UMT5EncoderModel``.
* HunyuanVideo: ``LlamaTokenizer`` + ``LlamaModel`` and ``CLIPTokenizer`` + ``CLIPTextModel``.
* SD3.5: two ``CLIPTokenizer`` + ``CLIPTextModelWithProjection`` (CLIP-L, CLIP-G) and ``T5Tokenizer`` +
  ``T5EncoderModel``.

All of them save with ``save_pretrained`` and load back through the pipelines' ``from_pretrained``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "byte_qwen2_tokenizer",
    "tiny_qwen25vl_text_encoder",
    "byte_qwen2vl_tokenizer",
    "QwenVLByteProcessor",
    "byte_clip_tokenizer",
    "tiny_clip_text_model",
    "byte_t5_tokenizer",
    "tiny_t5_encoder",
    "tiny_umt5_encoder",
    "byte_llama_tokenizer",
    "tiny_llama_model",
]


def _byte_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def byte_qwen2_tokenizer() -> Any:
    """A ``Qwen2Tokenizer`` over the 256 byte symbols plus the chat special tokens (259 ids)."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def tiny_qwen25vl_text_encoder(hidden_size: int, vocab_size: int = 259, layers: int = 2, *,
                               vision: bool = False) -> Any:
    """A random ``Qwen2_5_VLForConditionalGeneration`` whose text path outputs ``hidden_size`` features.

    The vision tower is minimal (one block of width 16, the real patch 14 / merge 2 geometry). Without
    ``vision`` it is never used: its special token ids lie outside the vocabulary. With ``vision`` (the edit
    models) the vocabulary is :func:`byte_qwen2vl_tokenizer`'s and the vision ids are its tokens, so the
    encoder sees the images a :class:`QwenVLByteProcessor` puts in the prompt.
    """
    if vision:
        vocab_size = 262
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 2
    head_dim = hidden_size // heads
    # mrope_section splits head_dim/2 rotary frequencies over (t, h, w)
    half = head_dim // 2
    sec = [half // 4, half // 4, half - 2 * (half // 4)]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": sec, "rope_theta": 1e6},
            bos_token_id=None,
            eos_token_id=258 if vision else vocab_size - 1,
            pad_token_id=256 if vision else vocab_size - 3,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden_size),
        image_token_id=260 if vision else vocab_size + 10,
        video_token_id=vocab_size + 11,
        vision_start_token_id=259 if vision else vocab_size + 12,
        vision_end_token_id=261 if vision else vocab_size + 13,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def byte_clip_tokenizer() -> Any:
    """A ``CLIPTokenizer`` over the byte symbols (plus their end-of-word forms) and BOS/EOS."""
    from transformers import CLIPTokenizer

    alpha = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(alpha)}
    for c in alpha:
        vocab[c + "</w>"] = len(vocab)
    for s in ("<|startoftext|>", "<|endoftext|>"):
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def tiny_clip_text_model(hidden_size: int, vocab_size: int, max_len: int = 77, *, projection: bool = False,
                         layers: int = 1) -> Any:
    """A random ``CLIPTextModel`` (pooled output of size ``hidden_size``), or with ``projection`` a
    ``CLIPTextModelWithProjection`` (SD3's CLIP-L and CLIP-G: projected pooled output of size ``hidden_size``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=max_len,
        projection_dim=hidden_size,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def byte_t5_tokenizer() -> Any:
    """A Unigram ``T5Tokenizer`` over printable ASCII plus the ``▁`` word marker (T5 specials first)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(i), -2.0) for i in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def tiny_t5_encoder(d_model: int, vocab_size: int) -> Any:
    """A random ``T5EncoderModel`` with ``d_model`` features."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return T5EncoderModel(cfg).eval()


def tiny_umt5_encoder(d_model: int, vocab_size: int) -> Any:
    """A random ``UMT5EncoderModel`` (Wan's text encoder family) with ``d_model`` features."""
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    return UMT5EncoderModel(cfg).eval()


def byte_llama_tokenizer() -> Any:
    """A ``LlamaTokenizer`` over printable ASCII and ``▁``, with byte fallback for everything else."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3}
    for i in range(33, 127):
        vocab[chr(i)] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = LlamaTokenizer(vocab=vocab, merges=[], model_max_length=1024, padding_side="right")
    tok.pad_token = "</s>"
    return tok


def tiny_llama_model(hidden_size: int, vocab_size: int) -> Any:
    """A random 3-layer ``LlamaModel`` (HunyuanVideo reads the third-last hidden state)."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return LlamaModel(cfg).eval()


_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def byte_qwen2vl_tokenizer() -> Any:
    """:func:`byte_qwen2_tokenizer` plus the vision tokens of Qwen2.5-VL (``<|vision_start|>``, ``<|image_pad|>``,
    ``<|vision_end|>``: ids 259-261), so an edit prompt's image placeholders tokenize as in the real vocabulary."""
    from transformers import Qwen2Tokenizer

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_VISION_TOKENS)
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    return tok


class QwenVLByteProcessor:
    """What ``Qwen2VLProcessor.__call__`` does for images, without its video processor (which needs torchvision).

    The edit pipelines call ``processor(text=..., images=..., padding=True, return_tensors="pt")``: the image
    processor (``Qwen2VLImageProcessorPil``: smart resize to multiples of ``patch_size · merge_size`` within
    ``[min_pixels, max_pixels]``, flattened patches) gives ``pixel_values`` and ``image_grid_thw``, and each
    ``<|image_pad|>`` of the text, in order, becomes ``t·h·w / merge_size²`` of them, as in transformers'
    ``Qwen2VLProcessor.replace_image_token``. Not a registered pipeline component: the adapter attaches it.
    """

    def __init__(self, tokenizer: Any, *, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280) -> None:
        from transformers import Qwen2VLImageProcessorPil

        self.tokenizer = tokenizer
        self.image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)

    def __call__(self, text: list[str], images: Any = None, padding: bool = True, return_tensors: str = "pt") -> Any:
        from transformers import BatchFeature

        pad = _VISION_TOKENS[1]
        text, feats = list(text), {}
        if images is not None:
            images = images if isinstance(images, list) else [images]
            feats = dict(self.image_processor(images=images, return_tensors=return_tensors))
            counts = iter(int(g.prod()) // self.image_processor.merge_size ** 2 for g in feats["image_grid_thw"])
            text = [t.replace(pad, "\0").replace("\0", "{}").format(*[pad * next(counts) for _ in range(t.count(pad))])
                    if pad in t else t for t in text]
        enc = self.tokenizer(text, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**enc, **feats})
