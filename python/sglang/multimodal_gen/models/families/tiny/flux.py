"""A small, seeded, random-weight Flux.1 in diffusers format (tests, demos, benchmarks).

Built with the reference libraries' own classes (diffusers' ``FluxTransformer2DModel``,
``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``; transformers' ``CLIPTextModel`` and
``T5EncoderModel`` with a byte-level ``CLIPTokenizer`` and a character-level ``T5Tokenizer``
made without any download) and saved with ``FluxPipeline.save_pretrained``, so the directory is
an ordinary diffusers model directory. ``guidance_embeds=True`` gives a [dev]-like model (with
FLUX.1-dev's dynamic-shift scheduler config), ``False`` a [schnell]-like one. Random weights:
images are noise by construction.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_clip_t5_tokenizers,
    redraw_constant_params,
)

TINY_VERSION = "1"
DEFAULT_SEED = 1234

# 4 heads: TP 1, 2 and 4 divide it (and the MLP width 256).
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=[4, 6, 6],
)
TINY_CLIP: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    projection_dim=32,
)
TINY_T5: dict[str, Any] = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=32,
    feed_forward_proj="gated-gelu",
)
TINY_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 16, 16, 16],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# FLUX.1-dev's scheduler (dynamic shifting); FLUX.1-schnell's is static with shift 1.
DEV_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
SCHNELL_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False
)


def build_flux_components(
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = DEFAULT_SEED,
    redraw_std: float = 0.1,
) -> dict[str, Any]:
    """The seven components of a ``FluxPipeline``, fp32 on the CPU, eval mode.

    Args:
        guidance_embeds: [dev] (True) or [schnell] (False) layout and scheduler.
        transformer: ``FluxTransformer2DModel`` kwargs (default :data:`TINY_TRANSFORMER`);
            ``joint_attention_dim`` / ``pooled_projection_dim`` are forced to the text encoders'.
        seed: seeds module init and the re-draw of constant-initialised parameters (zero-init
            adaLN and output layers would otherwise hide bugs).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = build_clip_t5_tokenizers()
    t_cfg = dict(copy.deepcopy(transformer or TINY_TRANSFORMER), guidance_embeds=guidance_embeds)
    t_cfg["joint_attention_dim"] = TINY_T5["d_model"]
    t_cfg["pooled_projection_dim"] = TINY_CLIP["hidden_size"]
    vae_cfg = dict(TINY_VAE, latent_channels=t_cfg["in_channels"] // 4)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
            **TINY_CLIP,
        )
    ).eval()
    torch.manual_seed(seed + 1)
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), **TINY_T5)).eval()
    torch.manual_seed(seed + 2)
    dit = FluxTransformer2DModel(**t_cfg).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(**vae_cfg).eval()
    for m in (clip, t5, dit, vae):
        redraw_constant_params(m, gen, redraw_std)
    sched = FlowMatchEulerDiscreteScheduler(
        **(DEV_SCHEDULER if guidance_embeds else SCHNELL_SCHEDULER)
    )
    return dict(
        transformer=dit,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        vae=vae,
        scheduler=sched,
    )


def build_flux_dir(
    path: str | os.PathLike,
    *,
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = DEFAULT_SEED,
) -> str:
    """Write a diffusers-format Flux.1 directory at ``path`` (see :func:`build_flux_components`);
    returns ``str(path)``."""
    from diffusers import FluxPipeline

    path = os.fspath(path)
    comps = build_flux_components(guidance_embeds, transformer, seed=seed)
    FluxPipeline(**comps).save_pretrained(path, safe_serialization=True)
    return path


build_flux_dir.version = TINY_VERSION  # cache key of an embedded default model


def build_flux_kontext_dir(
    path: str | os.PathLike,
    *,
    transformer: dict | None = None,
    seed: int = DEFAULT_SEED,
) -> str:
    """Write a diffusers-format FLUX.1 Kontext directory at ``path``: the [dev] components of
    :func:`build_flux_components` saved by diffusers' ``FluxKontextPipeline`` (its
    ``model_index.json`` names that class), with a 64 x 64 default size in the transformer
    config (``_sglang_defaults``, which diffusers ignores) so that reference images are brought
    to Kontext's aspect ratios at 64 x 64 pixels of area rather than a megapixel; returns
    ``str(path)``."""
    import json

    from diffusers import FluxKontextPipeline

    path = os.fspath(path)
    comps = build_flux_components(True, transformer, seed=seed)
    FluxKontextPipeline(**comps).save_pretrained(path, safe_serialization=True)
    cfg_path = os.path.join(path, "transformer", "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["_sglang_defaults"] = {"height": 64, "width": 64}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


build_flux_kontext_dir.version = TINY_VERSION
