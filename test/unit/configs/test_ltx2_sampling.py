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


# Lightricks' HQ two-stage recipe as published (github.com/Lightricks/LTX-2, commit 400fd31):
# ltx_pipelines/utils/constants.py LTX_2_3_HQ_PARAMS (15 steps, stage 1 at 1088 // 2 x 1920 // 2,
# video cfg 3 / stg 0 / rescale 0.45 / modality 3, audio cfg 7 / stg 0 / rescale 1 / modality 3),
# utils/args.py hq_2_stage_arg_parser (distilled LoRA 0.25 in stage 1, 0.5 in stage 2),
# ti2vid_two_stages_hq.py (res2s_audio_video_denoising_loop in both stages); written out here
PUBLISHED_HQ = dict(
    two_stage=True, res2s_sampler=True, height=1088, width=1920, num_inference_steps=15,
    guidance_scale=3.0, stg_scale=0.0, guidance_rescale=0.45, modality_scale=3.0,
    audio_guidance_scale=7.0, audio_stg_scale=0.0, audio_guidance_rescale=1.0,
    audio_modality_scale=3.0, lora=(("distilled", 0.25),), stage_2_lora=(("distilled", 0.5),),
)  # fmt: skip


def _family_spec() -> RequestSpec:
    from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig

    d = get_family("ltx2").sampling_defaults(LTX2ArchConfig())
    return RequestSpec("ltx2", "LTX-2", LTX2SamplingParams, d.params, d.limits, spatial_factor=32)


def test_hq_preset_resolves_to_the_published_settings():
    spec = _family_spec()
    hq = spec.resolve(spec.params(prompt="x", two_stage_preset="hq"))
    assert {k: getattr(hq, k) for k in PUBLISHED_HQ} == PUBLISHED_HQ
    # what the recipe does not set keeps the model's defaults (diffusers' LTX2Pipeline)
    plain = spec.resolve(spec.params(prompt="x", seed=hq.seed))
    rest = [n for n in LTX2SamplingParams.field_names() if n not in PUBLISHED_HQ]
    assert all(getattr(hq, n) == getattr(plain, n) for n in rest if n != "two_stage_preset")
    assert hq.num_frames == 121 and hq.fps == 24  # Lightricks' defaults too
    # "default" is the request as given
    default = spec.resolve(spec.params(prompt="x", seed=hq.seed, two_stage_preset="default"))
    assert default.replace(two_stage_preset=None) == plain.replace()


def test_hq_preset_explicit_fields_win():
    spec = _family_spec()
    mine = dict(height=256, width=384, num_inference_steps=8, guidance_scale=5.0, lora=[],
                stage_2_lora=[("distilled", 1.0)], res2s_sampler=False, stg_scale=1.0)  # fmt: skip
    p = spec.resolve(spec.params(prompt="x", two_stage_preset="hq", **mine))
    mine.update(lora=(), stage_2_lora=(("distilled", 1.0),))
    assert {k: getattr(p, k) for k in mine} == mine
    others = {k: v for k, v in PUBLISHED_HQ.items() if k not in mine}
    assert {k: getattr(p, k) for k in others} == others


@pytest.mark.parametrize(
    "fields",
    [
        dict(two_stage_preset="HQ"),
        dict(two_stage_preset="fast"),
        dict(two_stage_preset=1),
        dict(two_stage_preset="hq", two_stage=False),
    ],
)
def test_bad_preset_names_the_field(fields):
    with pytest.raises(InvalidRequestError) as e:
        _family_spec().resolve(LTX2SamplingParams(prompt="x", **fields))
    assert e.value.param == "two_stage_preset" and e.value.status_code == 400
