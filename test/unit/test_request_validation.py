"""``GenerationRequest.validate``: every bound at its edge, with the field named in ``param``.

The engine calls it on every request (Python API and HTTP alike), so each rule is checked on both
sides of its boundary: the last accepted value and the first refused one.
"""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.runtime import GenerationRequest

LIMITS = {
    "max_image_size": 1024,
    "max_sequence_length_limit": 512,
    "max_num_images": 4,
    "max_inference_steps": 50,
    "max_num_frames": 81,
}
OK = dict(
    prompt="a fox",
    height=64,
    width=48,
    num_inference_steps=4,
    guidance_scale=0.0,
    true_cfg_scale=1.0,
    max_sequence_length=512,
)


def _validate(**fields):
    GenerationRequest(**{**OK, **fields}).validate(spatial_factor=16, limits=LIMITS)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(height=16, width=16),  # the smallest multiple
        dict(height=1024, width=1024),  # exactly the family's largest side
        dict(num_inference_steps=1),
        dict(num_inference_steps=50),  # exactly the server's largest step count
        dict(guidance_scale=0, true_cfg_scale=7),  # finite numbers >= 0 (ints too)
        dict(guidance_scale=2.5, true_cfg_scale=0.0),
        dict(max_sequence_length=1),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(num_images=1),
        dict(num_images=4),  # exactly the server's largest n
        dict(lora=[("a", 0.5), ("b", -1.0)]),
        dict(lora=[]),
        dict(negative_prompt="blurry"),
        dict(num_frames=1),
        dict(num_frames=81),  # exactly the model's largest frame count
        dict(guidance_scale_2=0),
        dict(guidance_scale_2=3.5),
    ],
)
def test_accepted_at_the_edges(fields):
    _validate(**fields)


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(prompt=3), "prompt"),
        (dict(negative_prompt=["x"]), "negative_prompt"),
        (dict(height=40), "height"),  # not a multiple of 16
        (dict(width=8), "width"),
        (dict(height=0), "height"),
        (dict(width=-16), "width"),
        (dict(height=1040), "height"),  # a multiple, but over the family's largest side
        (dict(width=1040), "width"),
        (dict(height=32.0), "height"),
        (dict(width=True), "width"),
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(num_inference_steps=2.0), "num_inference_steps"),
        (dict(num_inference_steps=51), "num_inference_steps"),
        (dict(guidance_scale=-0.5), "guidance_scale"),
        (dict(true_cfg_scale=-1), "true_cfg_scale"),
        (dict(guidance_scale=float("nan")), "guidance_scale"),
        (dict(guidance_scale=float("inf")), "guidance_scale"),
        (dict(true_cfg_scale=float("-inf")), "true_cfg_scale"),
        (dict(guidance_scale="3"), "guidance_scale"),
        (dict(max_sequence_length=0), "max_sequence_length"),
        (dict(max_sequence_length=513), "max_sequence_length"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(num_images=0), "n"),
        (dict(num_images=5), "n"),
        (dict(num_images=True), "n"),
        (dict(lora=[("a", float("nan"))]), "lora"),
        (dict(lora=[("a", 1.0), ("a", 0.5)]), "lora"),
        (dict(num_frames=0), "num_frames"),
        (dict(num_frames=82), "num_frames"),
        (dict(num_frames=100_000_001), "num_frames"),
        (dict(num_frames=5.0), "num_frames"),
        (dict(num_frames=True), "num_frames"),
        (dict(guidance_scale_2=-1), "guidance_scale_2"),
        (dict(guidance_scale_2=float("nan")), "guidance_scale_2"),
        (dict(guidance_scale_2=float("inf")), "guidance_scale_2"),
        (dict(guidance_scale_2="3"), "guidance_scale_2"),
    ],
)
def test_refused_with_the_field_named(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        _validate(**fields)
    assert e.value.param == param
    assert e.value.status_code == 400


def test_spatial_factor_is_the_callers():
    GenerationRequest(**{**OK, "height": 40, "width": 8}).validate(spatial_factor=8)
    with pytest.raises(InvalidRequestError):
        GenerationRequest(**{**OK, "height": 40}).validate(spatial_factor=16)


def test_pixel_steps_count_frames():
    """A video's cost is ``n x num_frames x width x height x steps``: the same request fits
    the budget with 5 frames and not with 6; the frames are named when ``n`` is 1."""
    budget = {**LIMITS, "max_pixel_steps": 5 * 64 * 48 * 4}
    GenerationRequest(**{**OK, "num_frames": 5}).validate(spatial_factor=16, limits=budget)
    with pytest.raises(InvalidRequestError) as e:
        GenerationRequest(**{**OK, "num_frames": 6}).validate(spatial_factor=16, limits=budget)
    assert e.value.param == "num_frames" and "1 x 6 x 48 x 64 x 4" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        GenerationRequest(**{**OK, "num_frames": 5, "num_images": 2}).validate(
            spatial_factor=16, limits=budget
        )
    assert e.value.param == "n"


def test_server_pixel_step_budget_fits_the_models_default_request():
    from sglang.multimodal_gen.configs.server_args import DEFAULT_MAX_PIXEL_STEPS
    from sglang.multimodal_gen.entrypoints.http_server import resolve_max_pixel_steps

    image = dict(width=1024, height=1024, num_inference_steps=50, num_frames=1)
    video = dict(width=832, height=480, num_inference_steps=40, num_frames=81)
    assert resolve_max_pixel_steps(None, image) == DEFAULT_MAX_PIXEL_STEPS
    assert resolve_max_pixel_steps(None, video) == 4 * 832 * 480 * 40 * 81
    assert resolve_max_pixel_steps(0, video) is None  # no bound
    assert resolve_max_pixel_steps(1000, video) == 1000
