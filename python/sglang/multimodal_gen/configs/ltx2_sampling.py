"""Request fields of the LTX-2 / LTX-2.3 audio-video models (``LTX2Pipeline``).

The knobs of diffusers' ``LTX2Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/ltx2/pipeline_ltx2.py``) under their diffusers names, each with the model's default
(``models/families/ltx2.py``); the frame rate is the common ``fps`` field (diffusers'
``frame_rate``). Guidance is per modality: a video weight (``guidance_scale``, ``stg_scale``,
``modality_scale``, ``guidance_rescale``) and its audio twin (``audio_...``); as in diffusers, an
audio weight of 0 falls back to the video one.

``two_stage_preset`` selects a whole two-stage recipe: ``"hq"`` is Lightricks' HQ pipeline
(github.com/Lightricks/LTX-2 ``ltx_pipelines/ti2vid_two_stages_hq.py`` with
``utils/constants.py`` ``LTX_2_3_HQ_PARAMS`` and ``utils/args.py`` ``hq_2_stage_arg_parser``):
:data:`LTX2_HQ_PRESET` fills every field the request leaves unset (explicit fields win), and the
two-stage pipeline keeps stage 1's audio (``pipelines/ltx2_two_stage.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from sglang.multimodal_gen.configs.sampling_params import RequestSpec, VideoSamplingParams, param
from sglang.multimodal_gen.errors import InvalidRequestError

__all__ = [
    "LTX2_DISTILLED_ADAPTER",
    "LTX2_HQ_PRESET",
    "LTX2SamplingParams",
    "TWO_STAGE_PRESETS",
]

#: The values of ``two_stage_preset``: ``"default"`` (the fields as given, the model's defaults
#: for the rest; diffusers' documented two-stage composition) and ``"hq"`` (Lightricks' HQ one).
TWO_STAGE_PRESETS = ("default", "hq")

#: The adapter nickname the ``"hq"`` preset composes: Lightricks' distilled LoRA
#: (``ltx-2.3-22b-distilled-lora-384-1.1.safetensors`` for LTX-2.3), loaded under this name
#: (``sglang serve --lora-path distilled=...`` or ``/v1/set_lora``).
LTX2_DISTILLED_ADAPTER = "distilled"

#: The ``"hq"`` preset: the request fields Lightricks' HQ two-stage pipeline sets
#: (``ltx_pipelines/utils/constants.py`` ``LTX_2_3_HQ_PARAMS``: 15 steps, stage 1 at
#: 1088 x 1920 / 2, video CFG 3 / STG 0 / rescale 0.45 / modality 3, audio CFG 7 / STG 0 /
#: rescale 1 / modality 3; ``utils/args.py`` ``hq_2_stage_arg_parser``: the distilled LoRA at
#: 0.25 in stage 1 and 0.5 in stage 2; ``ti2vid_two_stages_hq.py``: the res_2s loop in both
#: stages). ``height`` / ``width`` are the output size (stage 1 runs at half of each). Lightricks'
#: empty STG block list is not set: with both STG weights 0 the blocks do nothing.
LTX2_HQ_PRESET = MappingProxyType(
    dict(
        two_stage=True, res2s_sampler=True, height=1088, width=1920, num_inference_steps=15,
        guidance_scale=3.0, stg_scale=0.0, guidance_rescale=0.45, modality_scale=3.0,
        audio_guidance_scale=7.0, audio_stg_scale=0.0, audio_guidance_rescale=1.0,
        audio_modality_scale=3.0, lora=((LTX2_DISTILLED_ADAPTER, 0.25),),
        stage_2_lora=((LTX2_DISTILLED_ADAPTER, 0.5),),
    )
)  # fmt: skip


@dataclass(frozen=True)
class LTX2SamplingParams(VideoSamplingParams):
    """Request fields of LTX-2.x models: those of every video model plus the guidance of each
    modality, spatio-temporal guidance (STG), modality-isolation guidance, the decode noise and
    the motion speed.

    ``stage_2_lora`` is a composition like ``lora`` (same format and checks); the runner selects
    its adapters (an unknown one is refused naming the field) and the two-stage pipeline runs its
    second stage with them (``pipelines/ltx2_two_stage.py``).

    ``two_stage_preset="hq"`` fills the fields the request leaves unset with
    :data:`LTX2_HQ_PRESET` when the request is built (before the model's defaults fill the rest),
    so the resolved request shows every value it runs with.

    Raises (:meth:`check`, via ``validate``):
        InvalidRequestError: ``two_stage_preset`` not one of :data:`TWO_STAGE_PRESETS`, or
            ``"hq"`` with ``two_stage`` false; ``motion_speed`` 0; STG on (``stg_scale`` or ``audio_stg_scale``
            > 0) with no ``spatio_temporal_guidance_blocks``; a block index that is not an
            integer >= 0. Each names the field.
    """

    stg_scale: float | None = param(
        "scale",
        "spatio-temporal guidance weight of the video (away from a pass with the self-attention "
        "of the STG blocks skipped); 0 turns STG off",
    )
    modality_scale: float | None = param(
        "scale",
        "modality-isolation guidance weight of the video (away from a pass without the "
        "audio-video cross-attention); 1 turns it off",
    )
    guidance_rescale: float | None = param(
        "scale",
        "rescale of the guided video prediction toward the conditional one's standard deviation "
        "(0: none, 1: full)",
    )
    audio_guidance_scale: float | None = param(
        "scale", "classifier-free guidance weight of the audio (0: the video's guidance_scale)"
    )
    audio_stg_scale: float | None = param(
        "scale", "spatio-temporal guidance weight of the audio (0: the video's stg_scale)"
    )
    audio_modality_scale: float | None = param(
        "scale", "modality-isolation guidance weight of the audio (0: the video's modality_scale)"
    )
    audio_guidance_rescale: float | None = param(
        "scale", "guidance rescale of the audio (0: the video's guidance_rescale)"
    )
    spatio_temporal_guidance_blocks: tuple[int, ...] | None = param(
        "indices", "transformer blocks (0-based) whose self-attention the STG pass skips"
    )
    use_cross_timestep: bool | None = param(
        "flag",
        "modulate each stream's audio-video cross-attention by the other stream's noise level "
        "(true: LTX-2.3; false: LTX-2.0)",
    )
    decode_timestep: float | None = param(
        "scale", "noise level the video VAE decodes at (VAEs with timestep conditioning)"
    )
    decode_noise_scale: float | None = param(
        "scale",
        "share of fresh noise mixed into the latents before such a decode (default: "
        "decode_timestep)",
    )
    motion_speed: float | None = param(
        "scale",
        "speed of the motion relative to real time: the positions are conditioned on "
        "fps / motion_speed (below 1: slow motion); > 0",
    )

    two_stage: bool | None = param(
        "flag",
        "generate in two stages: half the size, the latent upsampler (x2), then three distilled "
        "steps at full size (default: when the model has a latent upsampler)",
    )
    res2s_sampler: bool | None = param(
        "flag",
        "the res_2s second-order sampler (two model evaluations per step) instead of Euler",
    )
    stage_2_lora: tuple[tuple[str, float], ...] | None = param(
        "lora",
        "adapters of the second stage of a two-stage request: [{name, strength}] of loaded "
        "adapters ([]: none); null: the request's lora (the first stage always runs with lora)",
        cli=False,
    )
    two_stage_preset: str | None = param(
        "text",
        'two-stage recipe: "default" or "hq" (Lightricks\' HQ pipeline: res_2s in both stages, '
        "15 steps, 1088x1920, its guidance, the adapter 'distilled' at 0.25 in stage 1 and 0.5 in "
        "stage 2, stage 1's audio kept); fields the request sets explicitly win over the preset",
    )

    def __post_init__(self):
        blocks = self.spatio_temporal_guidance_blocks
        if isinstance(blocks, list):  # JSON arrays arrive as lists; requests stay hashable
            object.__setattr__(self, "spatio_temporal_guidance_blocks", tuple(blocks))
        if self.two_stage_preset == "hq":  # explicit fields win; an unknown preset: check()
            for name, value in LTX2_HQ_PRESET.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)

    def batch_key(self) -> tuple:
        """The common key; a two-stage request's is its own, so it never shares a denoising loop
        (its two loops at two sizes cannot join a batch; the serving model sets ``two_stage`` in
        its defaults, so a resolved request says how it runs)."""
        key = super().batch_key()
        return (*key, id(self)) if self.two_stage else key

    def check(self, spec: RequestSpec) -> None:
        super().check(spec)
        preset = self.two_stage_preset
        if preset is not None and preset not in TWO_STAGE_PRESETS:
            raise InvalidRequestError(
                f"two_stage_preset must be one of {', '.join(map(repr, TWO_STAGE_PRESETS))}, "
                f"got {preset!r}",
                param="two_stage_preset",
            )
        if preset == "hq" and self.two_stage is False:
            raise InvalidRequestError(
                "two_stage_preset 'hq' is a two-stage recipe; it cannot run with two_stage false",
                param="two_stage_preset",
            )
        if self.motion_speed is not None and self.motion_speed <= 0:
            raise InvalidRequestError(
                f"motion_speed must be > 0, got {self.motion_speed!r}", param="motion_speed"
            )
        stg = (self.stg_scale or 0) > 0 or (self.audio_stg_scale or 0) > 0
        if stg and self.spatio_temporal_guidance_blocks == ():
            raise InvalidRequestError(
                "spatio_temporal_guidance_blocks must name at least one block while stg_scale "
                "or audio_stg_scale is > 0",
                param="spatio_temporal_guidance_blocks",
            )
