"""Pieces shared by the families' tiny random-weight model builders
(``models/families/tiny/<family>.py``): offline tokenizers built from byte or character
vocabularies (no download) and the re-draw of constant-initialised parameters. Each builder
keeps its own shapes and components; what several families' builders use lives here.
"""

from __future__ import annotations

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "build_byte_level_chat_tokenizer",
    "build_clip_t5_tokenizers",
    "redraw_constant_params",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_level_chat_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` with no merges (every UTF-8 byte is a token): the
    tokenizer class of the Qwen LLM text encoders (Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL).

    Vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode map (ids 0..255), then
    ``<|endoftext|>`` (pad/eos, id 256), ``<|im_start|>`` (257), ``<|im_end|>`` (258). Chat template:
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message plus the assistant header when
    ``add_generation_prompt``. Deterministic, built without any download.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {sym: i for i, sym in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "right"
    return tok


def build_clip_t5_tokenizers():
    """``(clip_tokenizer, t5_tokenizer)`` built offline (Flux.1's CLIP and T5; Wan's UMT5 uses
    the T5 one).

    CLIP: byte-level BPE without merges (each byte symbol, also with the end-of-word marker
    ``</w>``, is a token), ``<|startoftext|>``/``<|endoftext|>``, ``model_max_length`` 77.
    T5: a unigram vocabulary of ``<pad>``, ``</s>``, ``<unk>``, the word marker and printable ASCII.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer, T5Tokenizer

    syms = sorted(ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(syms)}
    for s in syms:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    clip = CLIPTokenizer(vocab=vocab, merges=[])
    clip.model_max_length = 77
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0)
    return clip, t5


def redraw_constant_params(module: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    """Add seeded noise to every parameter whose entries are all equal (zeros/ones init: pad
    tokens, norm weights, biases) so every parameter influences the output."""
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
