"""A small, seeded, random-weight HunyuanVideo (1.0) in diffusers format (tests, demos, benchmarks).

Built with the reference libraries' classes and saved with diffusers'
``HunyuanVideoPipeline.save_pretrained``, so the directory is an ordinary diffusers
``HunyuanVideoPipeline`` directory:

* ``transformer``: diffusers' ``HunyuanVideoTransformer3DModel`` (4 heads x 16, two dual-stream
  and two single-stream blocks, one token-refiner block, guidance embedding: a guidance-distilled
  layout like HunyuanVideo's);
* ``text_encoder`` / ``tokenizer``: transformers' ``LlamaModel`` (3 layers, so the
  ``hidden_states[-3]`` the pipeline reads is an inner layer) with an offline byte-level BPE
  tokenizer (:func:`build_llama_tokenizer`) whose merges are learned from the HunyuanVideo prompt
  template itself, so that the template's system part and user header take exactly the 95 tokens
  the template's ``crop_start`` removes, as with the real Llama-3 tokenizer;
* ``text_encoder_2`` / ``tokenizer_2``: transformers' ``CLIPTextModel`` (its ``pooler_output``)
  with the offline byte-level ``CLIPTokenizer`` of ``models/families/tiny/common.py``;
* ``vae``: diffusers' ``AutoencoderKLHunyuanVideo`` (4 latent channels, spatial factor 8, temporal
  factor 4);
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with HunyuanVideo's ``shift`` 7 (``shift``
  17: a FastHunyuan-like directory).

Random weights: the frames are noise by construction.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_clip_t5_tokenizers,
    redraw_constant_params,
)

__all__ = [
    "TINY_TRANSFORMER",
    "build_hunyuan_video_components",
    "build_hunyuan_video_dir",
    "build_llama_tokenizer",
]

TINY_VERSION = "1"
DEFAULT_SEED = 1234

# 4 heads x 16 (TP 1, 2, 4); rope axes 4 + 6 + 6 = 16; MLP 2 x 64 = 128.
TINY_TRANSFORMER: dict[str, Any] = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    rope_axes_dim=(4, 6, 6),
)
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5,
)  # fmt: skip
TINY_CLIP: dict[str, Any] = dict(
    hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=77, projection_dim=24,
)  # fmt: skip
TINY_VAE: dict[str, Any] = dict(
    latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
    spatial_compression_ratio=8, temporal_compression_ratio=4,
)  # fmt: skip
# The DiT's matrices x 1.5: with PyTorch's default init the gated residual branches are small, so
# the text (and the guidance embedding) moved 2-step frames by about 2 / 255 only; x 1.5 makes
# the hidden-state layer, the guidance multiplier and the prompt each move them by far more.
DIT_WEIGHT_GAIN = 1.5
#: HunyuanVideo's scheduler (``hunyuanvideo-community/HunyuanVideo``: shift 7, no dynamic shift).
SCHEDULER_SHIFT = 7.0
LLAMA_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",
)  # fmt: skip


def build_llama_tokenizer():
    """A byte-level BPE tokenizer in the Llama-3 layout, built offline.

    Byte-level pre-tokenization (GPT-2's byte alphabet), the Llama-3 special tokens
    (``<|begin_of_text|>`` prepended to every text, ``<|end_of_text|>`` as pad and eos,
    ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``), padding on the right, and the
    merges that ``tokenizers``' BPE trainer learns from diffusers' HunyuanVideo prompt template
    (``DEFAULT_PROMPT_TEMPLATE``): its words become single tokens, any other text falls back to
    bytes and the template's merges. The template's part before the prompt is then 95 tokens,
    the template's ``crop_start``. Deterministic (the trainer's merges do not depend on the run).

    Returns:
        a ``transformers.PreTrainedTokenizerFast`` (saved as ``TokenizersBackend``).
    """
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,  # more than the template has merges: every merge is learned
        special_tokens=list(LLAMA_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([DEFAULT_PROMPT_TEMPLATE["template"].replace("{}", " ")], trainer)
    bos = LLAMA_SPECIAL_TOKENS[0]
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
    )  # fmt: skip
    tok.padding_side = "right"
    return tok


def build_hunyuan_video_components(
    seed: int = DEFAULT_SEED, shift: float = SCHEDULER_SHIFT
) -> dict[str, Any]:
    """The seven components of a ``HunyuanVideoPipeline`` (fp32, CPU, eval mode).

    Args:
        seed: seeds every weight (constant-initialised ones are re-drawn).
        shift: the scheduler's ``shift`` (7: HunyuanVideo; 17: FastHunyuan's).
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tok = build_llama_tokenizer()
    clip_tok, _ = build_clip_t5_tokenizers()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    te = LlamaModel(
        LlamaConfig(
            vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, **TINY_LLAMA,
        )
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 1)
    te_2 = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok), bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id, **TINY_CLIP,
        )
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 2)
    dit = HunyuanVideoTransformer3DModel(
        text_embed_dim=TINY_LLAMA["hidden_size"],
        pooled_projection_dim=TINY_CLIP["hidden_size"],
        **TINY_TRANSFORMER,
    ).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLHunyuanVideo(**TINY_VAE).eval()
    for m in (te, te_2, dit, vae):
        redraw_constant_params(m, gen, 0.1)
    with torch.no_grad():  # the default init leaves the frames nearly blind to the text
        for w in dit.parameters():
            if w.dim() >= 2:
                w.mul_(DIT_WEIGHT_GAIN)
    return dict(
        transformer=dit,
        text_encoder=te,
        tokenizer=tok,
        text_encoder_2=te_2,
        tokenizer_2=clip_tok,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift)),
    )


def build_hunyuan_video_dir(
    path: str | os.PathLike, *, seed: int = DEFAULT_SEED, shift: float = SCHEDULER_SHIFT
) -> str:
    """Write a diffusers-format HunyuanVideo directory at ``path`` (see
    :func:`build_hunyuan_video_components`); returns ``str(path)``."""
    from diffusers import HunyuanVideoPipeline

    path = os.fspath(path)
    HunyuanVideoPipeline(**build_hunyuan_video_components(seed, shift)).save_pretrained(
        path, safe_serialization=True
    )
    return path


build_hunyuan_video_dir.version = TINY_VERSION  # cache key of an embedded default model
