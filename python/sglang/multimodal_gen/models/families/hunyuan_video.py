"""HunyuanVideo 1.0 (Tencent): ``HunyuanVideoPipeline`` text-to-video directories, FastHunyuan
included.

One DiT (``HunyuanVideoTransformer3DModel``: dual-stream then single-stream blocks, a token
refiner, an embedded-guidance embedding) denoises 16-channel latents of the HunyuanVideo VAE (8x
spatial, 4x temporal compression), conditioned on a LLaVA-Llama-3 hidden state of the templated
prompt and the pooled CLIP-L features. ``guidance_scale`` is the embedded guidance (one forward
per step); ``true_cfg_scale`` > 1 with a negative prompt adds real classifier-free guidance.

FastHunyuan (``FastVideo/FastHunyuan-diffusers``, consistency-distilled from HunyuanVideo) has the
same ``_class_name`` and layout, so it is served by this family as it is; its flow shift is the
one its ``scheduler/scheduler_config.json`` says, and its 6 steps are a request field (or a
``_sglang_defaults`` entry of its ``transformer/config.json``; ``docs/models.md``).

Files of the family: ``configs/hunyuan_video.py`` (the DiT's config),
``configs/hunyuan_video_sampling.py`` (the request fields), ``models/dits/hunyuan_video*.py`` (the
DiT and its name map), ``pipelines/hunyuan_video.py``, ``models/families/tiny/hunyuan_video.py``
and this declaration.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.hunyuan_video_sampling import HunyuanVideoSamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"

#: Llama tokens kept after the template's prefix: the released model's text length (diffusers'
#: ``max_sequence_length`` default).
MAX_SEQUENCE_LENGTH = 256
#: Longest video: 10 s at 24 fps as 4 k + 1 frames (the released model makes 129; the DiT's
#: rotary tables are computed per call and bound nothing).
MAX_FRAMES = 241


def _defaults(cfg) -> SamplingDefaults:
    """diffusers' ``HunyuanVideoPipeline.__call__`` defaults: 720 x 1280, 129 frames, 50 steps,
    embedded guidance 6.0, no true CFG (``true_cfg_scale`` 1), 256 text tokens; 24 fps (the
    released model's rate, the frame rate of diffusers' examples)."""
    params = HunyuanVideoSamplingParams(
        num_inference_steps=50, guidance_scale=6.0, true_cfg_scale=1.0, height=720, width=1280,
        max_sequence_length=MAX_SEQUENCE_LENGTH, num_frames=129, fps=24,
    )  # fmt: skip
    limits = RequestLimits(max_sequence_length=MAX_SEQUENCE_LENGTH, max_num_frames=MAX_FRAMES)
    return SamplingDefaults(params=params, limits=limits, outputs="video", inputs=("text",))


def _tp_divisors(cfg) -> dict[str, int]:
    from sglang.multimodal_gen.configs.hunyuan_video import hunyuan_video_tp_divisors

    return hunyuan_video_tp_divisors(cfg)


HUNYUAN_VIDEO = register_family(
    ModelFamily(
        name="hunyuan-video",
        display_name="HunyuanVideo",
        pipeline_classes=("HunyuanVideoPipeline",),
        pipeline=f"{_PKG}.pipelines.hunyuan_video:HunyuanVideoPipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("HunyuanVideoTransformer3DModel",),
                config_class=f"{_PKG}.configs.hunyuan_video:HunyuanVideoArchConfig",
                model_class=f"{_PKG}.models.dits.hunyuan_video:HunyuanVideoTransformer",
                name_map=f"{_PKG}.models.dits.hunyuan_video_names:HUNYUAN_VIDEO_NAME_MAP",
            ),
        ),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.hunyuan_video_sampling:HunyuanVideoSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.hunyuan_video:build_hunyuan_video_dir",
        default_model_name="sglang-default-hunyuan-video-tiny",
        # the LoRA-family guess (lora.key_grammar.best_architecture): any block key counts (a
        # shorter piece than Flux's pattern, so a file with no HunyuanVideo-only name, e.g.
        # ComfyUI's or diffusers' block names, which are Flux's, stays Flux's); longer pieces
        # only HunyuanVideo has decide: Tencent's modulation / MLP names and dotted img_attn_qkv,
        # the token refiner, txt_in / context_embedder, guidance_in.mlp, a double block 19 or a
        # single block 38 / 39 (Flux has 19 and 38)
        lora_signature=(
            r"(double|single)_block(?=s[._]\d)",
            r"single_transformer_block(?=s[._]\d)",
            r"(double|single)_blocks[._]\d+[._]"
            r"((img|txt)_(mod[._]linear|mlp[._]fc[12])|modulation[._]linear)",
            r"double_blocks\.\d+\.(img|txt)_attn_(qkv|proj)\b",
            r"individual_token_refiner|token_refiner[._]refiner_blocks|"
            r"txt_in[._](input_embedder|[tc]_embedder)|context_embedder[._](proj_in|time_text_embed)",
            r"guidance_in[._]mlp[._][02]",
            r"double_blocks[._]19[._]|single_(transformer_)?blocks[._]3[89][._]",
        ),
        lora_architecture="HunyuanVideo",
    )
)
