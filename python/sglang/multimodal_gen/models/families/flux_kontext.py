"""FLUX.1 Kontext (Black Forest Labs): ``FluxKontextPipeline`` directories, image editing.

The Flux.1 DiT (``models/dits/flux.py``, the same weights layout and LoRA names: Kontext LoRAs
load as Flux LoRAs do) with the stages of ``pipelines/flux_kontext.py``. Every request needs one
reference image (``image``); FLUX.1 Kontext [dev] is guidance-distilled (28 steps and guidance
3.5 by default, as diffusers' ``FluxKontextPipeline``; Black Forest Labs suggest 2.5 for edits).
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.flux import FluxSamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.families.flux import FLUX
from sglang.multimodal_gen.models.registry import ModelFamily, SamplingDefaults, register_family

_PKG = "sglang.multimodal_gen"


def _defaults(cfg) -> SamplingDefaults:
    params = FluxSamplingParams(
        height=1024, width=1024, num_inference_steps=28,
        guidance_scale=3.5 if cfg.guidance_embeds else 0.0, max_sequence_length=512,
        true_cfg_scale=1.0,
    )  # fmt: skip
    return SamplingDefaults(
        params=params,
        limits=RequestLimits(max_sequence_length=512, max_input_images=1),
        inputs=("text", "image"),
        required_inputs=("text", "image"),
    )


FLUX_KONTEXT = register_family(
    ModelFamily(
        name="flux_kontext",
        display_name="FLUX.1 Kontext",
        pipeline_classes=("FluxKontextPipeline",),
        pipeline=f"{_PKG}.pipelines.flux_kontext:FluxKontextPipeline",
        denoisers=FLUX.denoisers,
        defaults=_defaults,
        sampling_params=FLUX.sampling_params,
        tp_divisors=FLUX.tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.flux:build_flux_kontext_dir",
        default_model_name="sglang-default-flux-kontext-tiny",
    )
)
