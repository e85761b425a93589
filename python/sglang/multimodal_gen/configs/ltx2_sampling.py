"""Request fields of the LTX-2 / LTX-2.3 audio-video models (``LTX2Pipeline``).

The knobs of diffusers' ``LTX2Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/ltx2/pipeline_ltx2.py``) under their diffusers names, each with the model's default
(``models/families/ltx2.py``); the frame rate is the common ``fps`` field (diffusers'
``frame_rate``). Guidance is per modality: a video weight (``guidance_scale``, ``stg_scale``,
``modality_scale``, ``guidance_rescale``) and its audio twin (``audio_...``); as in diffusers, an
audio weight of 0 falls back to the video one.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.multimodal_gen.configs.sampling_params import RequestSpec, VideoSamplingParams, param
from sglang.multimodal_gen.errors import InvalidRequestError

__all__ = ["LTX2SamplingParams"]


@dataclass(frozen=True)
class LTX2SamplingParams(VideoSamplingParams):
    """Request fields of LTX-2.x models: those of every video model plus the guidance of each
    modality, spatio-temporal guidance (STG), modality-isolation guidance, the decode noise and
    the motion speed.

    ``stage_2_lora`` is a composition like ``lora`` (same format and checks); the runner selects
    its adapters (an unknown one is refused naming the field) and the two-stage pipeline runs its
    second stage with them (``pipelines/ltx2_two_stage.py``).

    Raises (:meth:`check`, via ``validate``):
        InvalidRequestError: ``motion_speed`` 0; STG on (``stg_scale`` or ``audio_stg_scale``
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

    def __post_init__(self):
        blocks = self.spatio_temporal_guidance_blocks
        if isinstance(blocks, list):  # JSON arrays arrive as lists; requests stay hashable
            object.__setattr__(self, "spatio_temporal_guidance_blocks", tuple(blocks))

    def batch_key(self) -> tuple:
        """The common key; a two-stage request's is its own, so it never shares a denoising loop
        (its two loops at two sizes cannot join a batch; the serving model sets ``two_stage`` in
        its defaults, so a resolved request says how it runs)."""
        key = super().batch_key()
        return (*key, id(self)) if self.two_stage else key

    def check(self, spec: RequestSpec) -> None:
        super().check(spec)
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
