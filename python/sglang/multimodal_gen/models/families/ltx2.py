"""LTX-2 / LTX-2.3 (Lightricks): ``LTX2Pipeline`` directories, joint video and audio generation.

One DiT denoises a video stream and an audio stream together; the output is a video with a
sound track (the vocoder's sample rate). Text to video, or image to video with the request's
image as the first frame (diffusers' ``LTX2ImageToVideoPipeline``; either directory class). Files of the family:
``configs/ltx2.py`` (the DiT's config), ``configs/ltx2_sampling.py`` (the request fields),
``models/dits/ltx2*.py`` (the DiT and its name map), ``pipelines/ltx2.py``,
``models/families/tiny/ltx2.py`` and this declaration.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.ltx2_sampling import LTX2SamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"

#: LTX-2.3's STG block (diffusers' default; LTX-2.0 recommends 29). A block index the DiT does
#: not have perturbs nothing (as in diffusers): STG then equals the conditional prediction.
STG_BLOCK = 28
#: Longest video: 20 s at 24 fps as 8 k + 1 frames (diffusers' duration bound is 20 s).
MAX_FRAMES = 481


def _defaults(cfg) -> SamplingDefaults:
    # diffusers' LTX2Pipeline.__call__ defaults (LTX-2.3 guidance): 512x768, 121 frames at
    # 24 fps, 30 steps, CFG 3 (audio 7), STG 1, modality isolation 3, rescale 0.7
    params = LTX2SamplingParams(
        height=512, width=768, num_frames=121, fps=24, num_inference_steps=30,
        guidance_scale=3.0, max_sequence_length=1024, stg_scale=1.0, modality_scale=3.0,
        guidance_rescale=0.7, audio_guidance_scale=7.0, audio_stg_scale=1.0,
        audio_modality_scale=3.0, audio_guidance_rescale=0.7,
        spatio_temporal_guidance_blocks=(STG_BLOCK,), use_cross_timestep=True,
        decode_timestep=0.0, decode_noise_scale=None, motion_speed=1.0,
    )  # fmt: skip
    limits = RequestLimits(max_sequence_length=1024, max_num_frames=MAX_FRAMES)
    # an input image is optional: the first frame (LTX2ImageToVideoPipeline on the same weights)
    return SamplingDefaults(params=params, limits=limits, outputs="video", inputs=("text", "image"))


def _tp_divisors(cfg) -> dict[str, int]:
    from sglang.multimodal_gen.configs.ltx2 import ltx2_tp_divisors

    return ltx2_tp_divisors(cfg)


LTX2 = register_family(
    ModelFamily(
        name="ltx2",
        display_name="LTX-2",
        pipeline_classes=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
        pipeline=f"{_PKG}.pipelines.ltx2_two_stage:LTX2TwoStagePipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("LTX2VideoTransformer3DModel",),
                config_class=f"{_PKG}.configs.ltx2:LTX2ArchConfig",
                model_class=f"{_PKG}.models.dits.ltx2:LTX2Transformer",
                name_map=f"{_PKG}.models.dits.ltx2_names:LTX2_NAME_MAP",
            ),
        ),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.ltx2_sampling:LTX2SamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.ltx2:build_ltx2_dir",
        default_model_name="sglang-default-ltx2-tiny",
        # diffusers' names of the audio stream and the audio-video cross-attention (no other
        # family has them); a video-only adapter: top-level blocks with attn1 / attn2 (the
        # original checkpoint's names are the same)
        lora_signature=(
            r"(^|[._])transformer_blocks[._]\d+[._](audio_attn\d|audio_to_video_attn|"
            r"video_to_audio_attn|audio_ff)",
            r"^(?:base_model\.model\.|diffusion_model\.|transformer\.|lora_unet_)?"
            r"transformer_blocks[._]\d+[._]attn[12][._]",
        ),
        lora_architecture="LTX-2",
    )
)
