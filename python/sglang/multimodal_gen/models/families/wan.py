"""Wan2.x (Alibaba): ``WanPipeline`` and ``WanImageToVideoPipeline`` video directories.

Layouts: Wan2.2 T2V-A14B (two experts: ``transformer`` for high noise, ``transformer_2`` for low
noise, switched at ``boundary_ratio`` from ``model_index.json``), Wan2.2 I2V-A14B (the same two
experts, whose input is the noise concatenated with the image's condition latents and a frame
mask: ``in_channels = 2 * out_channels + 4``; an image is required), Wan2.2 TI2V-5B (one expert,
48 latent channels, the Wan2.2 VAE, per-token timesteps via ``expand_timesteps``; text-to-video,
or image-to-video with the image as the first frame) and Wan2.1 (one expert, text only; the
CLIP image branch of Wan2.1 I2V is not implemented, see ``configs/wan.py``). A
``WanDMDPipeline`` directory (FastVideo's DMD-distilled FastWan2.1 / FastWan2.2-TI2V-5B, the same
layouts) is served with the DMD few-step sampler (``pipelines/dmd.py``, ``pipelines/wan.py``
``WanDMDPipeline``). Files of the family: ``configs/wan.py``, ``models/dits/wan.py`` (+
``wan_layers.py``), ``models/dits/wan_names.py``, ``pipelines/wan.py``, ``models/families/tiny/wan.py`` and this
declaration.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"

#: ``model_index.json`` ``_class_name`` of FastVideo's DMD-distilled Wan directories
#: (FastWan2.1-T2V, FastWan2.2-TI2V-5B): served with the DMD sampler.
DMD_PIPELINE_CLASS = "WanDMDPipeline"


def _max_frames(cfg) -> int:
    """Frames the DiT's rotary tables cover: ``rope_max_seq_len`` patches in time, each
    ``patch_size[0]`` latent frames of 4 frames (both Wan VAEs compress time by 4), plus the
    first frame, which the VAE keeps alone."""
    return (cfg.rope_max_seq_len * cfg.patch_size[0] - 1) * 4 + 1


def takes_image_condition(cfg) -> bool:
    """Whether the DiT's input is the noise concatenated with an image condition (Wan2.2
    I2V-A14B: ``out_channels`` noise channels, a 4-channel frame mask, ``out_channels`` image
    latent channels)."""
    return cfg.in_channels == 2 * cfg.out_channels + 4


def _defaults(cfg) -> SamplingDefaults:
    limits = RequestLimits(max_sequence_length=512, max_num_frames=_max_frames(cfg))
    if takes_image_condition(cfg):
        # I2V-A14B: 480x832, 81 frames at 16 fps, both experts' guidance 3.5; every request
        # gives the first frame
        params = WanSamplingParams(
            num_inference_steps=40, guidance_scale=3.5, height=480, width=832,
            max_sequence_length=512, num_frames=81, fps=16, guidance_scale_2=3.5,
        )  # fmt: skip
        return SamplingDefaults(
            params=params, limits=limits, outputs="video", inputs=("text", "image"),
            required_inputs=("text", "image"),
        )  # fmt: skip
    if cfg.in_channels == 48:  # TI2V-5B: 704x1280, 121 frames at 24 fps; an image is optional
        params = WanSamplingParams(
            num_inference_steps=50, guidance_scale=5.0, height=704, width=1280,
            max_sequence_length=512, num_frames=121, fps=24,
        )  # fmt: skip
        return SamplingDefaults(
            params=params, limits=limits, outputs="video", inputs=("text", "image")
        )
    # T2V-A14B (and Wan2.1): 480x832, 81 frames at 16 fps; the second expert's guidance 3.0
    # (the pipeline drops it for one-expert directories)
    params = WanSamplingParams(
        num_inference_steps=40, guidance_scale=4.0, height=480, width=832,
        max_sequence_length=512, num_frames=81, fps=16, guidance_scale_2=3.0,
    )  # fmt: skip
    return SamplingDefaults(params=params, limits=limits, outputs="video")


def _tp_divisors(cfg) -> dict[str, int]:
    return {"num_attention_heads": cfg.num_attention_heads, "ffn_dim": cfg.ffn_dim}


def _expert(component: str) -> DenoiserSpec:
    return DenoiserSpec(
        component=component,
        diffusers_classes=("WanTransformer3DModel",),
        config_class=f"{_PKG}.configs.wan:WanArchConfig",
        model_class=f"{_PKG}.models.dits.wan:WanTransformer",
        name_map=f"{_PKG}.models.dits.wan_names:WAN_NAME_MAP",
        lora_target=component,
        optional=component == "transformer_2",
    )


WAN = register_family(
    ModelFamily(
        name="wan",
        display_name="Wan2.x",
        pipeline_classes=("WanPipeline", "WanImageToVideoPipeline", DMD_PIPELINE_CLASS),
        pipeline=f"{_PKG}.pipelines.wan:WanPipeline",
        denoisers=(_expert("transformer"), _expert("transformer_2")),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.wan:WanSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.wan:build_wan_dir",
        default_model_name="sglang-default-wan-tiny",
        # the original / ComfyUI names of the blocks' modules (also musubi/kohya-flattened)
        lora_signature=(r"(^|[._])blocks[._]\d+[._](self_attn|cross_attn|ffn)",),
        lora_architecture="Wan",
    )
)
