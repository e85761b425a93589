"""Qwen-Image-Edit (Alibaba Qwen): ``QwenImageEditPipeline`` directories (Qwen-Image-Edit) and
``QwenImageEditPlusPipeline`` directories (Qwen-Image-Edit-2509, -2511), two families.

Files: ``configs/qwen_image_edit.py`` (request fields, the size rule), ``pipelines/
qwen_image_edit.py`` (the stages), ``models/families/tiny/qwen_image_edit.py`` (tiny models) and
this declaration; the DiT, its config and name map are Qwen-Image's (``models/dits/qwen_image.py``),
so are the LoRA layouts (diffusers' ``transformer_blocks.N...`` and kohya/ComfyUI's
``diffusion_model.transformer_blocks...``). Every request needs an input image; there is no
``strength`` (the image conditions every step, it is not re-noised). Edit takes one image, Plus up
to three (diffusers' recommendation for 2509: one to three images).

The tiny builders (``build_qwen_image_edit_dir``, ``build_qwen_image_edit_plus_dir``) are not yet
declared as ``build_tiny``: the conformance suite does not give its requests an input image nor
load the processor without torchvision (``reference_pipeline`` does); the family tests run them.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.qwen_image_edit import QwenImageEditSamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"
_TINY = f"{_PKG}.models.families.tiny.qwen_image_edit"


def _defaults(max_images: int) -> SamplingDefaults:
    # The edit pipelines' __call__ defaults: 50 steps, true CFG 4.0 (with a negative prompt); the
    # size follows the input image unless given (QwenImageEditSamplingParams.conform)
    return SamplingDefaults(
        params=QwenImageEditSamplingParams(
            num_inference_steps=50,
            guidance_scale=1.0,
            max_sequence_length=512,
            true_cfg_scale=4.0,
        ),  # fmt: skip
        limits=RequestLimits(max_sequence_length=1024, max_input_images=max_images),
        inputs=("text", "image"),
        required_inputs=("text", "image"),
    )


def _tp_divisors(cfg) -> dict[str, int]:
    return {"num_attention_heads": cfg.num_attention_heads, "MLP hidden size": 4 * cfg.inner_dim}


_DIT = DenoiserSpec(
    component="transformer",
    diffusers_classes=("QwenImageTransformer2DModel",),
    config_class=f"{_PKG}.configs.qwen_image:QwenImageArchConfig",
    model_class=f"{_PKG}.models.dits.qwen_image:QwenImageTransformer",
    name_map=f"{_PKG}.models.dits.qwen_image_names:QWEN_IMAGE_NAME_MAP",
)

QWEN_IMAGE_EDIT = register_family(
    ModelFamily(
        name="qwen-image-edit",
        display_name="Qwen-Image-Edit",
        pipeline_classes=("QwenImageEditPipeline",),
        pipeline=f"{_PKG}.pipelines.qwen_image_edit:QwenImageEditPipeline",
        denoisers=(_DIT,),
        defaults=_defaults(1),
        sampling_params=f"{_PKG}.configs.qwen_image_edit:QwenImageEditSamplingParams",
        tp_divisors=_tp_divisors,
        default_model_name="sglang-default-qwen-image-edit-tiny",
        extra={"reference_pipeline": f"{_TINY}:reference_pipeline"},
    )
)

QWEN_IMAGE_EDIT_PLUS = register_family(
    ModelFamily(
        name="qwen-image-edit-plus",
        display_name="Qwen-Image-Edit-Plus",
        pipeline_classes=("QwenImageEditPlusPipeline",),
        pipeline=f"{_PKG}.pipelines.qwen_image_edit:QwenImageEditPlusPipeline",
        denoisers=(_DIT,),
        defaults=_defaults(3),
        sampling_params=f"{_PKG}.configs.qwen_image_edit:QwenImageEditSamplingParams",
        tp_divisors=_tp_divisors,
        default_model_name="sglang-default-qwen-image-edit-plus-tiny",
        extra={"reference_pipeline": f"{_TINY}:reference_pipeline"},
    )
)
