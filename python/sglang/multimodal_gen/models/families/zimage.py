"""Z-Image (Tongyi-MAI): ``ZImagePipeline`` directories, e.g. Z-Image-Turbo.

Files of the family: ``configs/zimage.py``, ``models/dits/zimage.py`` (+ ``zimage_layers.py``),
``models/dits/zimage_names.py``, ``pipelines/zimage.py``, ``models/families/tiny/zimage.py``
and this declaration.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"


def _defaults(cfg) -> SamplingDefaults:
    # Z-Image-Turbo: 8 steps, no CFG. The RoPE tables cover axes_lens[1:] patches per side.
    patch = cfg.all_patch_size[0]
    side = min(cfg.axes_lens[1], cfg.axes_lens[2]) * patch * 8
    return SamplingDefaults(
        params=ZImageSamplingParams(
            height=1024,
            width=1024,
            num_inference_steps=8,
            guidance_scale=0.0,
            max_sequence_length=512,
            cfg_normalization=0.0,
            cfg_truncation=1.0,
            strength=0.6,
        ),  # fmt: skip
        limits=RequestLimits(max_image_size=side, max_sequence_length=1024),
        # an input image: image-to-image (ZImageImg2ImgPipeline, strength 0.6 by default); with
        # a mask, inpainting (ZImageInpaintPipeline, whose own default strength is 1.0)
        inputs=("text", "image", "mask"),
    )


def _tp_divisors(cfg) -> dict[str, int]:
    return {"n_heads": cfg.n_heads, "ffn_hidden": cfg.ffn_hidden}


ZIMAGE = register_family(
    ModelFamily(
        name="zimage",
        display_name="Z-Image",
        pipeline_classes=("ZImagePipeline",),
        pipeline=f"{_PKG}.pipelines.zimage:ZImagePipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("ZImageTransformer2DModel",),
                config_class=f"{_PKG}.configs.zimage:ZImageArchConfig",
                model_class=f"{_PKG}.models.dits.zimage:ZImageTransformer",
                name_map=f"{_PKG}.models.dits.zimage_names:ZIMAGE_NAME_MAP",
            ),
        ),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.zimage:ZImageSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.zimage:build_zimage_dir",
        embedded_model=f"{_PKG}.models:demo/zimage-shapes",  # scripts/train_demo_model.py
        embedded_lora=f"{_PKG}.models:demo/lora-swap-colors",  # "swap colours", same script
        default_model_name="sglang-default-zimage-tiny",
        # the main and refiner blocks' attention and feed-forward (diffusers and kohya names)
        lora_signature=(
            r"(layers|noise_refiner|context_refiner)[._]\d+[._](attention|feed_forward)",
        ),
    )
)


def load_zimage_transformer(component_dir: str, **kwargs):
    """Our Z-Image DiT from ``<model>/transformer`` (``models.loader.load_denoiser``; kwargs:
    ``dtype``, ``device``, ``tp_rank``, ``tp_size``)."""
    from sglang.multimodal_gen.models.loader import load_denoiser

    return load_denoiser(component_dir, ZIMAGE.denoiser(), **kwargs)


def zimage_from_diffusers_module(reference, **kwargs):
    """Our Z-Image DiT with the weights of an in-memory diffusers ``ZImageTransformer2DModel``
    (``models.loader.denoiser_from_module``; benchmarks and tests)."""
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    return denoiser_from_module(reference, ZIMAGE.denoiser(), **kwargs)
