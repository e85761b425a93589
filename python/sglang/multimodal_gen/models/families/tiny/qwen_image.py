"""A small, seeded, random-weight Qwen-Image in diffusers format (tests, demos, benchmarks).

Built with the reference libraries' classes (diffusers' ``QwenImageTransformer2DModel``,
``AutoencoderKLQwenImage``, ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's exponential
dynamic shift; transformers' ``Qwen2_5_VLForConditionalGeneration`` with a tiny vision tower and
the offline byte-level ``Qwen2Tokenizer`` of ``models/families/tiny/common.py``) and saved with
``QwenImagePipeline.save_pretrained``. Random weights: images are noise by construction.
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

# 4 heads x 16 (TP 1, 2, 4), text width 32.
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
# Qwen-Image's scheduler config (exponential time shift, terminal shift).
QWEN_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    time_shift_type="exponential",
)  # fmt: skip


def build_qwen_image_components(seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The five components of a ``QwenImagePipeline`` (fp32, CPU, eval mode)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = build_byte_level_chat_tokenizer()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    te_cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
    )  # fmt: skip
    te = Qwen2_5_VLForConditionalGeneration(te_cfg).eval()
    torch.manual_seed(seed + 1)
    dit = QwenImageTransformer2DModel(**TINY_TRANSFORMER).eval()
    torch.manual_seed(seed + 2)
    z = TINY_TRANSFORMER["in_channels"] // 4
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.05 * i for i in range(z)], latents_std=[1.0 + 0.1 * i for i in range(z)],
    ).eval()  # fmt: skip
    for m in (te, dit, vae):
        redraw_constant_params(m, gen, 0.1)
    sched = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    return dict(transformer=dit, text_encoder=te, tokenizer=tok, vae=vae, scheduler=sched)


def build_qwen_image_dir(path: str | os.PathLike, *, seed: int = DEFAULT_SEED) -> str:
    """Write a diffusers-format Qwen-Image directory at ``path``; returns ``str(path)``."""
    from diffusers import QwenImagePipeline

    path = os.fspath(path)
    QwenImagePipeline(**build_qwen_image_components(seed)).save_pretrained(
        path, safe_serialization=True
    )
    return path


build_qwen_image_dir.version = TINY_VERSION  # cache key of an embedded default model
