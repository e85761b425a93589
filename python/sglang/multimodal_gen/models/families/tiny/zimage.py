"""A small, seeded, random-weight Z-Image in diffusers format (the embedded default model).

``sglang generate`` / ``sglang serve`` without ``--model-path`` use it (``models.default_model``)
so that the commands run on a fresh offline machine. Its weights are random, so **its images are
noise by construction**; real use passes ``--model-path`` to a real Z-Image-Turbo directory.

Everything is built locally with the reference libraries' own classes (diffusers'
``ZImageTransformer2DModel``, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``; transformers'
``Qwen3Model`` and a byte-level ``Qwen2Tokenizer`` made with ``tokenizers`` from the 256 byte
symbols plus the chat special tokens) and saved with ``ZImagePipeline.save_pretrained``, so the
directory is an ordinary diffusers model directory. The same builder, :func:`build_zimage_dir`,
makes the tiny test fixtures (test/fixtures).
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_byte_level_chat_tokenizer,
    redraw_constant_params,
)

# Bump when the recipe below changes, so old caches are not reused.
TINY_VERSION = "1"
DEFAULT_SEED = 1234

# Shapes of the embedded default model (TP 1, 2, 3 and 6 all divide its heads and FFN).
DEFAULT_TRANSFORMER: dict[str, Any] = dict(
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=16,
    dim=192,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=6,
    n_kv_heads=6,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=64,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[8, 12, 12],
    axes_lens=[1024, 512, 512],
)
DEFAULT_TEXT_ENCODER: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
DEFAULT_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 16, 16, 16],
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=8,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# Z-Image-Turbo's scheduler config.
DEFAULT_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
)


def build_zimage_components(
    transformer: dict | None = None,
    text_encoder: dict | None = None,
    vae: dict | None = None,
    scheduler: dict | None = None,
    seed: int = DEFAULT_SEED,
    redraw_std: float = 0.1,
):
    """Build the five components of a Z-Image pipeline with diffusers'/transformers' classes.

    Args:
        transformer: ``ZImageTransformer2DModel`` kwargs (default: :data:`DEFAULT_TRANSFORMER`).
            ``cap_feat_dim`` is forced to the text encoder's hidden size.
        text_encoder: ``Qwen3Config`` kwargs (vocab size comes from the tokenizer).
        vae: ``AutoencoderKL`` kwargs; ``latent_channels`` is forced to ``in_channels``.
        scheduler: ``FlowMatchEulerDiscreteScheduler`` kwargs.
        seed: seeds module init and the re-draw of constant-initialised parameters.
        redraw_std: std of the noise added to constant-initialised parameters.

    Returns:
        ``dict(transformer, text_encoder, tokenizer, vae, scheduler)``, all fp32 on the CPU, eval mode.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    t_cfg = dict(copy.deepcopy(transformer or DEFAULT_TRANSFORMER))
    te_cfg = dict(copy.deepcopy(text_encoder or DEFAULT_TEXT_ENCODER))
    vae_cfg = dict(copy.deepcopy(vae or DEFAULT_VAE))
    sch_cfg = dict(copy.deepcopy(scheduler or DEFAULT_SCHEDULER))

    tok = build_byte_level_chat_tokenizer()
    te_cfg.setdefault("vocab_size", len(tok))
    te_cfg.setdefault("tie_word_embeddings", False)
    te_cfg.setdefault("pad_token_id", tok.pad_token_id)
    t_cfg["cap_feat_dim"] = te_cfg["hidden_size"]
    vae_cfg["latent_channels"] = t_cfg.get("in_channels", 16)

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    te = Qwen3Model(Qwen3Config(**te_cfg)).eval()
    redraw_constant_params(te, gen, redraw_std)
    torch.manual_seed(seed + 1)
    dit = ZImageTransformer2DModel(**t_cfg).eval()
    redraw_constant_params(dit, gen, redraw_std)
    with torch.no_grad():  # learned pad tokens: give them the scale of real embeddings
        dit.x_pad_token.normal_(0.0, 1.0, generator=gen)
        dit.cap_pad_token.normal_(0.0, 1.0, generator=gen)
    torch.manual_seed(seed + 2)
    ae = AutoencoderKL(**vae_cfg).eval()
    redraw_constant_params(ae, gen, redraw_std)
    sch = FlowMatchEulerDiscreteScheduler(**sch_cfg)
    return dict(transformer=dit, text_encoder=te, tokenizer=tok, vae=ae, scheduler=sch)


def build_zimage_dir(
    path: str | os.PathLike,
    *,
    transformer: dict | None = None,
    text_encoder: dict | None = None,
    vae: dict | None = None,
    scheduler: dict | None = None,
    seed: int = DEFAULT_SEED,
    redraw_std: float = 0.1,
    transformer_shard_size: str | int | None = None,
) -> str:
    """Write a diffusers-format Z-Image directory at ``path`` (see :func:`build_zimage_components`).

    ``transformer_shard_size`` (e.g. ``"200KB"``) re-saves the transformer as sharded safetensors
    with a ``diffusion_pytorch_model.safetensors.index.json``. Returns ``str(path)``.
    """
    from diffusers import ZImagePipeline

    path = os.fspath(path)
    comps = build_zimage_components(
        transformer, text_encoder, vae, scheduler, seed=seed, redraw_std=redraw_std
    )
    pipe = ZImagePipeline(**comps)
    pipe.save_pretrained(path, safe_serialization=True)
    if transformer_shard_size is not None:
        tdir = os.path.join(path, "transformer")
        shutil.rmtree(tdir)
        comps["transformer"].save_pretrained(
            tdir, safe_serialization=True, max_shard_size=transformer_shard_size
        )
    return path


build_zimage_dir.version = TINY_VERSION  # cache key of the embedded default model
