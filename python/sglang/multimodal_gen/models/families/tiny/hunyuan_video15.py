"""A small, seeded, random-weight HunyuanVideo 1.5 in diffusers format (tests, demos, benchmarks).

Built with the reference libraries' classes and saved with diffusers'
``HunyuanVideo15Pipeline.save_pretrained`` (diffusers 0.42.1,
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``): diffusers'
``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``,
``FlowMatchEulerDiscreteScheduler`` (HunyuanVideo 1.5's ``shift`` 5) and the
``ClassifierFreeGuidance`` guider; transformers' ``Qwen2_5_VLTextModel`` (three layers: the
pipeline reads the third hidden state from the end) with the offline byte-level
``Qwen2Tokenizer`` of ``models/families/tiny/common.py``, and a ``T5EncoderModel`` with
``ByT5Tokenizer`` (bytes, no vocabulary file) for the glyph texts. Random weights: the frames
are noise by construction.

The guider's ``guidance_scale`` is 4.0, the weight the family conformance suite sends (the
diffusers pipeline takes its weight from the guider, not from a call argument).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_byte_level_chat_tokenizer,
    redraw_constant_params,
)

TINY_VERSION = "1"
DEFAULT_SEED = 1234
LATENT_CHANNELS = 4
GUIDANCE_SCALE = 4.0

# 4 heads x 16 (TP 1, 2, 4); RoPE (t, h, w) channels 4 + 6 + 6 = the head width.
TINY_TRANSFORMER: dict[str, Any] = dict(
    in_channels=2 * LATENT_CHANNELS + 1,  # noise, condition latents, frame mask
    out_channels=LATENT_CHANNELS,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=32,
    text_embed_2_dim=16,
    image_embed_dim=16,
    rope_axes_dim=(4, 6, 6),
    target_size=64,
    task_type="t2v",
)
TINY_T5: dict[str, Any] = dict(
    d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
    relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
)  # fmt: skip
SCHEDULER: dict[str, Any] = dict(num_train_timesteps=1000, shift=5.0)


def build_hunyuan_video15_components(seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The eight components of a ``HunyuanVideo15Pipeline`` (fp32, CPU, eval mode)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    tok = build_byte_level_chat_tokenizer()
    tok_2 = ByT5Tokenizer()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    te = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        )
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 1)
    te_2 = T5EncoderModel(T5Config(vocab_size=len(tok_2), **TINY_T5)).eval()
    torch.manual_seed(seed + 2)
    dit = HunyuanVideo15Transformer3DModel(**TINY_TRANSFORMER).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()  # fmt: skip
    for m in (te, te_2, dit, vae):
        redraw_constant_params(m, gen, 0.1)
    return dict(
        transformer=dit,
        text_encoder=te,
        tokenizer=tok,
        text_encoder_2=te_2,
        tokenizer_2=tok_2,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )


def build_hunyuan_video15_dir(path: str | os.PathLike, *, seed: int = DEFAULT_SEED) -> str:
    """Write a diffusers-format HunyuanVideo 1.5 text-to-video directory at ``path`` (see
    :func:`build_hunyuan_video15_components`); returns ``str(path)``."""
    from diffusers import HunyuanVideo15Pipeline

    path = os.fspath(path)
    HunyuanVideo15Pipeline(**build_hunyuan_video15_components(seed)).save_pretrained(
        path, safe_serialization=True
    )
    return path


build_hunyuan_video15_dir.version = TINY_VERSION  # cache key of an embedded default model
