"""Flux.1 (Black Forest Labs): ``FluxPipeline`` directories, [dev] and [schnell].

Files of the family: ``configs/flux.py``, ``models/dits/flux.py``, ``models/dits/flux_names.py``,
``pipelines/flux.py``, ``models/families/tiny/flux.py`` and this declaration. The variant is read
from the transformer config: [dev] has ``guidance_embeds`` (distilled guidance, 28 steps,
guidance 3.5, 512 T5 tokens), [schnell] has not (4 steps, 256 T5 tokens).
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.flux import FluxSamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"


def _defaults(cfg) -> SamplingDefaults:
    limits = RequestLimits(max_sequence_length=512)
    if cfg.guidance_embeds:  # FLUX.1-dev
        params = FluxSamplingParams(
            height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5,
            max_sequence_length=512, true_cfg_scale=1.0, strength=0.6,
        )  # fmt: skip
    else:  # FLUX.1-schnell
        params = FluxSamplingParams(
            height=1024, width=1024, num_inference_steps=4, guidance_scale=0.0,
            max_sequence_length=256, true_cfg_scale=1.0, strength=0.6,
        )  # fmt: skip
    # an input image: image-to-image (FluxImg2ImgPipeline); with a mask, inpainting
    # (FluxInpaintPipeline)
    return SamplingDefaults(params=params, limits=limits, inputs=("text", "image", "mask"))


def _tp_divisors(cfg) -> dict[str, int]:
    return {"num_attention_heads": cfg.num_attention_heads, "mlp_hidden": cfg.mlp_hidden}


FLUX = register_family(
    ModelFamily(
        name="flux",
        display_name="Flux.1",
        pipeline_classes=("FluxPipeline",),
        pipeline=f"{_PKG}.pipelines.flux:FluxPipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("FluxTransformer2DModel",),
                config_class=f"{_PKG}.configs.flux:FluxArchConfig",
                model_class=f"{_PKG}.models.dits.flux:FluxTransformer",
                name_map=f"{_PKG}.models.dits.flux_names:FLUX_NAME_MAP",
            ),
        ),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.flux:FluxSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.flux:build_flux_dir",
        default_model_name="sglang-default-flux-tiny",
        # BFL names (kohya, ComfyUI, XLabs: double_blocks, single_blocks), diffusers' single blocks
        lora_signature=(r"(double_blocks|single_blocks|single_transformer_blocks)[._]\d+",),
        lora_architecture="Flux",
    )
)
