"""Qwen-Image (Alibaba Qwen): ``QwenImagePipeline`` directories (Qwen-Image, Qwen-Image-2512).

Files of the family: ``configs/qwen_image.py``, ``models/dits/qwen_image.py`` (+
``qwen_image_layers.py``), ``models/dits/qwen_image_names.py``, ``pipelines/qwen_image.py``,
``models/families/tiny/qwen_image.py`` and this declaration. Qwen-Image-2512 directories differ
only in weights and config values and load through the same family.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.qwen_image import QwenImageSamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"

# QwenImagePipeline.__call__'s defaults: 50 steps, true CFG 4.0 (with a negative prompt), 512
# text tokens (at most 1024); --guidance-scale only matters for guidance-distilled variants;
# strength 0.6 for an input image.
_DEFAULTS = SamplingDefaults(
    params=QwenImageSamplingParams(
        height=1024,
        width=1024,
        num_inference_steps=50,
        guidance_scale=1.0,
        max_sequence_length=512,
        true_cfg_scale=4.0,
        strength=0.6,
    ),  # fmt: skip
    limits=RequestLimits(max_sequence_length=1024),
    # an input image: image-to-image (QwenImageImg2ImgPipeline); with a mask, inpainting
    # (QwenImageInpaintPipeline); both default to strength 0.6
    inputs=("text", "image", "mask"),
)


def _tp_divisors(cfg) -> dict[str, int]:
    return {"num_attention_heads": cfg.num_attention_heads, "MLP hidden size": 4 * cfg.inner_dim}


QWEN_IMAGE = register_family(
    ModelFamily(
        name="qwen-image",
        display_name="Qwen-Image",
        pipeline_classes=("QwenImagePipeline",),
        pipeline=f"{_PKG}.pipelines.qwen_image:QwenImagePipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("QwenImageTransformer2DModel",),
                config_class=f"{_PKG}.configs.qwen_image:QwenImageArchConfig",
                model_class=f"{_PKG}.models.dits.qwen_image:QwenImageTransformer",
                name_map=f"{_PKG}.models.dits.qwen_image_names:QWEN_IMAGE_NAME_MAP",
            ),
        ),
        defaults=_DEFAULTS,
        sampling_params=f"{_PKG}.configs.qwen_image:QwenImageSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.qwen_image:build_qwen_image_dir",
        default_model_name="sglang-default-qwen-image-tiny",
        # the per-stream MLPs and modulations of diffusers' names (also kohya-flattened)
        lora_signature=(r"transformer_blocks[._]\d+[._](img_mlp|txt_mlp|img_mod|txt_mod)",),
    )
)
