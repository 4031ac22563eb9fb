"""Byte-level tokenizers and tiny text encoders of the real families, built without any download.

The hub tokenizers of the real models cannot be fetched here, so the tiny presets use tokenizers of
the *same transformers classes* built from a byte alphabet (every UTF-8 string tokenizes, no merges),
paired with randomly initialised text encoders of the real architectures:

* Qwen-Image: ``Qwen2Tokenizer`` + ``Qwen2_5_VLForConditionalGeneration`` (text path used).
* FLUX.1: ``CLIPTokenizer`` + ``CLIPTextModel`` (pooled) and ``T5Tokenizer`` + ``T5EncoderModel``.
* Wan2.1: ``T5Tokenizer`` + ``UMT5EncoderModel``.
* HunyuanVideo: ``LlamaTokenizer`` + ``LlamaModel`` and ``CLIPTokenizer`` + ``CLIPTextModel``.

All of them save with ``save_pretrained`` and load back through the pipelines' ``from_pretrained``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "byte_qwen2_tokenizer",
    "tiny_qwen25vl_text_encoder",
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


def tiny_qwen25vl_text_encoder(hidden_size: int, vocab_size: int = 259, layers: int = 2) -> Any:
    """A random ``Qwen2_5_VLForConditionalGeneration`` whose text path outputs ``hidden_size`` features.

    The vision tower is minimal and never used; its special token ids lie outside the vocabulary.
    """
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
            eos_token_id=vocab_size - 1,
            pad_token_id=vocab_size - 3,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden_size),
        image_token_id=vocab_size + 10,
        video_token_id=vocab_size + 11,
        vision_start_token_id=vocab_size + 12,
        vision_end_token_id=vocab_size + 13,
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


def tiny_clip_text_model(hidden_size: int, vocab_size: int, max_len: int = 77) -> Any:
    """A random ``CLIPTextModel`` (pooled output of size ``hidden_size``)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=max_len,
        projection_dim=hidden_size,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    return CLIPTextModel(cfg).eval()


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
