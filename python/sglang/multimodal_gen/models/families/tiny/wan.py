"""Small, seeded, random-weight Wan2.2 directories in diffusers format (tests, demos, benchmarks).

``layout="a14b"``: two experts (``transformer`` / ``transformer_2``) switched at
``boundary_ratio``, the Wan2.1 VAE (16 latent channels, spatial factor 8). ``layout="i2v"``: the
same as a Wan2.2 I2V-A14B ``WanImageToVideoPipeline`` (two experts whose input is the noise
concatenated with the image's condition: ``in_channels = 2 * 16 + 4 = 36``, ``out_channels``
16; no CLIP image encoder). ``layout="ti2v"``: one expert with per-token timesteps
(``expand_timesteps``) and the Wan2.2 VAE layout (residual blocks, 2x2 pixel patches, spatial
factor 16). Built with diffusers' ``WanTransformer3DModel``, ``AutoencoderKLWan``,
``UniPCMultistepScheduler`` (flow sigmas, as Wan ships) and transformers' ``UMT5EncoderModel``
with an offline character-level ``T5Tokenizer``; saved with ``WanPipeline.save_pretrained``
(``WanImageToVideoPipeline`` for ``"i2v"``). Random weights: the frames are noise by
construction.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_clip_t5_tokenizers,
    redraw_constant_params,
)

TINY_VERSION = "1"
DEFAULT_SEED = 1234

# 4 heads x 8 (TP 1, 2, 4), FFN 64.
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=8,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)
TINY_UMT5: dict[str, Any] = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=32,
    feed_forward_proj="gated-gelu",
)


def _vae(layout: str):
    from diffusers import AutoencoderKLWan

    common = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    if layout == "ti2v":
        z = 12
        return AutoencoderKLWan(
            z_dim=z, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
            scale_factor_spatial=16, latents_mean=[0.05 * i for i in range(z)],
            latents_std=[1.0 + 0.1 * i for i in range(z)], **common,
        )  # fmt: skip
    z = 16
    return AutoencoderKLWan(
        z_dim=z, latents_mean=[0.05 * i for i in range(z)],
        latents_std=[1.0 + 0.1 * i for i in range(z)], **common,
    )  # fmt: skip


LAYOUTS = ("a14b", "i2v", "ti2v")


def build_wan_components(layout: str = "a14b", seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The components of a ``WanPipeline`` (``WanImageToVideoPipeline`` for ``"i2v"``; fp32,
    CPU, eval mode) plus its config values (``boundary_ratio`` / ``expand_timesteps``).

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _, tok = build_clip_t5_tokenizers()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    te = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), **TINY_UMT5)).eval()
    vae = _vae(layout).eval()
    z = vae.config.z_dim
    # I2V: noise (z) + the frame mask (4, one per frame of the VAE's temporal group) + the image
    # condition's latents (z)
    t_cfg = dict(TINY_TRANSFORMER, in_channels=2 * z + 4 if layout == "i2v" else z, out_channels=z)
    experts = {}
    for i, name in enumerate(
        ("transformer",) if layout == "ti2v" else ("transformer", "transformer_2")
    ):
        torch.manual_seed(seed + 1 + i)
        experts[name] = WanTransformer3DModel(**t_cfg).eval()
    for m in (te, vae, *experts.values()):
        redraw_constant_params(m, gen, 0.1)
    sched = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        num_train_timesteps=1000,
    )  # fmt: skip
    comps = dict(tokenizer=tok, text_encoder=te, vae=vae, scheduler=sched, **experts)
    if layout == "a14b":
        comps.update(boundary_ratio=0.875)
    elif layout == "i2v":  # Wan2.2 I2V-A14B switches experts at 0.9; no CLIP image encoder
        comps.update(boundary_ratio=0.9, image_encoder=None, image_processor=None)
    else:
        comps.update(transformer_2=None, expand_timesteps=True)
    return comps


def build_wan_dir(
    path: str | os.PathLike, *, layout: str = "a14b", seed: int = DEFAULT_SEED
) -> str:
    """Write a diffusers-format Wan2.2 directory at ``path`` (see :func:`build_wan_components`);
    returns ``str(path)``."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    path = os.fspath(path)
    cls = WanImageToVideoPipeline if layout == "i2v" else WanPipeline
    cls(**build_wan_components(layout, seed)).save_pretrained(path, safe_serialization=True)
    return path


build_wan_dir.version = TINY_VERSION  # cache key of an embedded default model


def mark_wan_dmd_dir(path: str | os.PathLike) -> str:
    """Set the ``model_index.json`` ``_class_name`` of the Wan directory at ``path`` to
    ``WanDMDPipeline``, as FastVideo publishes its DMD-distilled directories (FastWan2.1,
    FastWan2.2-TI2V-5B; the other entries, the scheduler's included, stay the base model's: the
    DMD sampler does not read the scheduler). Returns ``str(path)``."""
    import json

    from sglang.multimodal_gen.models.families.wan import DMD_PIPELINE_CLASS

    path = os.fspath(path)
    index_file = os.path.join(path, "model_index.json")
    with open(index_file, encoding="utf-8") as f:
        index = json.load(f)
    index["_class_name"] = DMD_PIPELINE_CLASS
    with open(index_file, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return path


def build_wan_dmd_dir(path: str | os.PathLike, *, seed: int = DEFAULT_SEED) -> str:
    """Write a tiny FastWan2.2-TI2V-5B-like directory at ``path``: the ``"ti2v"`` layout
    (:func:`build_wan_dir`) marked ``WanDMDPipeline`` (:func:`mark_wan_dmd_dir`). Returns
    ``str(path)``."""
    return mark_wan_dmd_dir(build_wan_dir(path, layout="ti2v", seed=seed))
