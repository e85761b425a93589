"""LTX2SamplingParams: its own rules (motion speed, STG blocks), the flag / indices kinds on its
fields, and the family's declared defaults (diffusers 0.42.1 ``LTX2Pipeline.__call__``)."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.ltx2_sampling import LTX2SamplingParams
from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.registry import get_family


def _spec() -> RequestSpec:
    return RequestSpec("ltx2", "LTX-2", LTX2SamplingParams, LTX2SamplingParams(),
                       RequestLimits(max_num_frames=481), spatial_factor=32)  # fmt: skip


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(motion_speed=0.0), "motion_speed"),
        (
            dict(stg_scale=1.0, spatio_temporal_guidance_blocks=[]),
            "spatio_temporal_guidance_blocks",
        ),
        (
            dict(audio_stg_scale=0.5, spatio_temporal_guidance_blocks=()),
            "spatio_temporal_guidance_blocks",
        ),
        (dict(spatio_temporal_guidance_blocks=[-1]), "spatio_temporal_guidance_blocks"),
        (dict(spatio_temporal_guidance_blocks="28"), "spatio_temporal_guidance_blocks"),
        (dict(use_cross_timestep=1), "use_cross_timestep"),
        (dict(decode_noise_scale=-0.1), "decode_noise_scale"),
    ],
)
def test_bad_values_name_their_field(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        LTX2SamplingParams(prompt="x", **fields).validate(_spec())
    assert e.value.param == param


def test_lists_become_tuples_and_stg_off_needs_no_blocks():
    p = LTX2SamplingParams(prompt="x", spatio_temporal_guidance_blocks=[27, 28])
    assert p.spatio_temporal_guidance_blocks == (27, 28)
    hash(p.batch_key())  # requests stay hashable (the scheduler groups them by this key)
    LTX2SamplingParams(prompt="x", stg_scale=0.0, spatio_temporal_guidance_blocks=[]).validate(
        _spec()
    )


def test_family_defaults_are_diffusers_ltx2_defaults():
    from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig

    d = get_family("ltx2").sampling_defaults(LTX2ArchConfig())
    p = d.params
    assert (d.outputs, d.inputs, d.limits.max_num_frames) == ("video", ("text", "image"), 481)
    assert (p.height, p.width, p.num_frames, p.fps, p.num_inference_steps) == (
        512,
        768,
        121,
        24,
        30,
    )
    assert (p.guidance_scale, p.stg_scale, p.modality_scale, p.guidance_rescale) == (
        3.0,
        1.0,
        3.0,
        0.7,
    )
    assert (p.audio_guidance_scale, p.audio_stg_scale, p.audio_modality_scale) == (7.0, 1.0, 3.0)
    assert (p.audio_guidance_rescale, p.spatio_temporal_guidance_blocks) == (0.7, (28,))
    assert (p.use_cross_timestep, p.decode_timestep, p.decode_noise_scale) == (True, 0.0, None)
    assert (p.motion_speed, p.max_sequence_length) == (1.0, 1024)
