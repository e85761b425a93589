"""HunyuanVideo 1.5 (Tencent): ``HunyuanVideo15Pipeline`` (text to video) and
``HunyuanVideo15ImageToVideoPipeline`` (image to video) directories.

One DiT (``HunyuanVideo15Transformer3DModel``) denoises 32-channel video latents of the
HunyuanVideo 1.5 VAE (16x spatial, 4x temporal compression) conditioned on Qwen2.5-VL text
features and ByT5 features of the quoted (glyph) text of the prompt; classifier-free guidance as
the directory's ``ClassifierFreeGuidance`` guider configures it. An image-to-video directory
(a SigLIP ``image_encoder``) requires the request's ``image``, the first frame (its SigLIP
features and latents condition every step); a text-to-video one refuses an image (400 naming
``image``). Files of the family:
``configs/hunyuan_video15.py`` (the DiT's config), ``models/dits/hunyuan_video15*.py`` (the DiT
and its name map), ``pipelines/hunyuan_video15.py``, ``models/families/tiny/hunyuan_video15.py``
and this declaration.
"""

from __future__ import annotations

from sglang.multimodal_gen.configs.sampling_params import RequestLimits, VideoSamplingParams
from sglang.multimodal_gen.models.registry import (
    DenoiserSpec,
    ModelFamily,
    SamplingDefaults,
    register_family,
)

_PKG = "sglang.multimodal_gen"

#: Text tokens the Qwen2.5-VL encoder keeps after the template's prefix (diffusers'
#: ``tokenizer_max_length``).
MAX_SEQUENCE_LENGTH = 1000
#: Longest video: 10 s at 24 fps as 4 k + 1 frames (twice the released models' 121 frames; the
#: DiT's rotary tables are computed per call and bound nothing).
MAX_FRAMES = 241


def _defaults(cfg) -> SamplingDefaults:
    """diffusers' ``HunyuanVideo15Pipeline.__call__`` defaults: 121 frames, 50 steps, the size of
    the 16:9 bucket of the DiT's ``target_size`` (480 x 848 at 640, 720 x 1280 at 960; the
    pipeline recomputes it with the directory's VAE factor); 24 fps (the released models'
    rate); the guidance weight is the guider's (6.0 in the released directories; the pipeline
    reads the directory's ``guider`` config). The pipeline adds the required ``image`` input for an
    image-to-video directory."""
    params = VideoSamplingParams(
        num_inference_steps=50, guidance_scale=6.0, height=480, width=848,
        max_sequence_length=MAX_SEQUENCE_LENGTH, num_frames=121, fps=24,
    )  # fmt: skip
    limits = RequestLimits(max_sequence_length=MAX_SEQUENCE_LENGTH, max_num_frames=MAX_FRAMES)
    return SamplingDefaults(params=params, limits=limits, outputs="video", inputs=("text",))


def _tp_divisors(cfg) -> dict[str, int]:
    from sglang.multimodal_gen.configs.hunyuan_video import hunyuan_video_tp_divisors

    return hunyuan_video_tp_divisors(cfg)


HUNYUAN_VIDEO15 = register_family(
    ModelFamily(
        name="hunyuan-video-1.5",
        display_name="HunyuanVideo 1.5",
        pipeline_classes=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
        pipeline=f"{_PKG}.pipelines.hunyuan_video15:HunyuanVideo15Pipeline",
        denoisers=(
            DenoiserSpec(
                component="transformer",
                diffusers_classes=("HunyuanVideo15Transformer3DModel",),
                config_class=f"{_PKG}.configs.hunyuan_video15:HunyuanVideo15ArchConfig",
                model_class=f"{_PKG}.models.dits.hunyuan_video15:HunyuanVideo15Transformer",
                name_map=f"{_PKG}.models.dits.hunyuan_video15_names:HUNYUAN_VIDEO15_NAME_MAP",
            ),
        ),
        defaults=_defaults,
        sampling_params=f"{_PKG}.configs.sampling_params:VideoSamplingParams",
        tp_divisors=_tp_divisors,
        build_tiny=f"{_PKG}.models.families.tiny.hunyuan_video15:build_hunyuan_video15_dir",
        default_model_name="sglang-default-hunyuan-video-1.5-tiny",
        # the LoRA-family guess (lora.key_grammar.best_architecture): any double-block key counts
        # (a shorter piece than Flux's pattern, so a file with no 1.5-only name stays Flux's); the
        # names only 1.5 has win the tie on the longer piece: Tencent's split img_attn_q|k|v (to
        # the key's end, longer than what 1.0 shares), the ByT5 / SigLIP / cond-type / time
        # embedders, a double block past 1.0's 20; Tencent's modulation / MLP names, the token
        # refiner and txt_in / context_embedder are HunyuanVideo's (1.0 lists them too)
        lora_signature=(
            r"double_block(?=s[._]\d)",
            r"double_blocks[._]\d+[._](img|txt)_(mod[._]linear|mlp[._]fc[12])",
            r"double_blocks[._]\d+[._](img|txt)_attn_[qkv](?=[._]|$).*",
            r"double_blocks\.\d+\.(img|txt)_attn_proj\b",
            r"individual_token_refiner|token_refiner[._]refiner_blocks|"
            r"txt_in[._](input_embedder|[tc]_embedder)|context_embedder[._](proj_in|time_text_embed)",
            r"(^|[._])(byt5_in|vision_in|context_embedder_2|cond_type_embed)[._]",
            r"(^|[._])image_embedder[._]linear_[12]",  # (Wan I2V's is image_embedder.ff / norm)
            r"(^|[._])time_embed[._]timestep_embedder",
            r"double_blocks[._]([2-4]\d|5[0-3])[._].*",
        ),
        lora_architecture="HunyuanVideo 1.5",
    )
)
