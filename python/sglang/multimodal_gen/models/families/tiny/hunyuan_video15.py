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


LAYOUTS = ("t2v", "i2v")
# the image-to-video DiT: SigLIP features of width 16, the MeanFlow timestep embedder (the
# step-distilled releases' ``use_meanflow``), a square 32-pixel size bucket
TINY_I2V: dict[str, Any] = dict(image_embed_dim=16, target_size=32, task_type="i2v",
                                use_meanflow=True)  # fmt: skip
TINY_SIGLIP: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=28, patch_size=14,
)  # fmt: skip


def build_hunyuan_video15_components(
    seed: int = DEFAULT_SEED, layout: str = "t2v"
) -> dict[str, Any]:
    """The components of a ``HunyuanVideo15Pipeline`` (``"t2v"``: eight) or a
    ``HunyuanVideo15ImageToVideoPipeline`` (``"i2v"``: plus a SigLIP ``image_encoder`` and its
    ``feature_extractor``); fp32, CPU, eval mode.

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
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
    dit_cfg = dict(TINY_TRANSFORMER, **(TINY_I2V if layout == "i2v" else {}))
    dit = HunyuanVideo15Transformer3DModel(**dit_cfg).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()  # fmt: skip
    extra: dict[str, Any] = {}
    if layout == "i2v":
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(seed + 4)
        side = TINY_SIGLIP["image_size"]
        extra = dict(
            image_encoder=SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP)).eval(),
            feature_extractor=SiglipImageProcessor(size={"height": side, "width": side}),
        )
    for m in (te, te_2, dit, vae, *(v for v in extra.values() if isinstance(v, torch.nn.Module))):
        redraw_constant_params(m, gen, 0.1)
    return dict(
        **extra,
        transformer=dit,
        text_encoder=te,
        tokenizer=tok,
        text_encoder_2=te_2,
        tokenizer_2=tok_2,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )


def build_hunyuan_video15_dir(
    path: str | os.PathLike, *, seed: int = DEFAULT_SEED, layout: str = "t2v"
) -> str:
    """Write a diffusers-format HunyuanVideo 1.5 directory at ``path``: text to video
    (``HunyuanVideo15Pipeline``) or, with ``layout="i2v"``, image to video
    (``HunyuanVideo15ImageToVideoPipeline``); see :func:`build_hunyuan_video15_components`.
    Returns ``str(path)``."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    path = os.fspath(path)
    cls = HunyuanVideo15ImageToVideoPipeline if layout == "i2v" else HunyuanVideo15Pipeline
    cls(**build_hunyuan_video15_components(seed, layout)).save_pretrained(
        path, safe_serialization=True
    )
    return path


build_hunyuan_video15_dir.version = TINY_VERSION  # cache key of an embedded default model
