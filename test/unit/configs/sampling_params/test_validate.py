"""``SamplingParams.validate``: every bound at its edge, with the field named in ``param``.

``RequestSpec.resolve`` calls it on every request (Python API, CLI and HTTP alike), so each rule
is checked on both sides of its boundary: the last accepted value and the first refused one. A
family's own fields (``true_cfg_scale``, ``num_frames``, ``guidance_scale_2``...) are checked on
every registered family's class that declares them; the common fields on every family's class.
"""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.flux import FluxSamplingParams
from sglang.multimodal_gen.configs.qwen_image import QwenImageSamplingParams
from sglang.multimodal_gen.configs.sampling_params import (
    RequestLimits,
    RequestSpec,
    SamplingParams,
)
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.errors import InvalidRequestError

LIMITS = RequestLimits(
    max_image_size=1024,
    max_sequence_length=512,
    max_num_outputs_per_prompt=4,
    max_inference_steps=50,
    max_num_frames=81,
)
CLASSES = (
    SamplingParams,
    ZImageSamplingParams,
    FluxSamplingParams,
    QwenImageSamplingParams,
    WanSamplingParams,
)
OK = dict(
    prompt="a fox",
    height=64,
    width=48,
    num_inference_steps=4,
    guidance_scale=0.0,
    max_sequence_length=512,
)


def _spec(cls, spatial_factor: int = 16, limits: RequestLimits = LIMITS) -> RequestSpec:
    return RequestSpec("test", "Test", cls, cls(), limits, spatial_factor=spatial_factor)


def _declaring(values: dict) -> list[type[SamplingParams]]:
    """The classes that declare every field of ``values`` (at least one)."""
    out = [c for c in CLASSES if set(values) <= set(c.field_names())]
    assert out, f"no class declares {sorted(values)}"
    return out


def _validate(cls, **fields):
    cls(**{**OK, **fields}).validate(_spec(cls))


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
        dict(true_cfg_scale=1.0),
        dict(max_sequence_length=1),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(num_outputs_per_prompt=1),
        dict(num_outputs_per_prompt=4),  # exactly the server's largest n
        dict(lora=[("a", 0.5), ("b", -1.0)]),
        dict(lora=[]),
        dict(negative_prompt="blurry"),
        dict(num_frames=1),
        dict(num_frames=81),  # exactly the model's largest frame count
        dict(guidance_scale_2=0),
        dict(guidance_scale_2=3.5),
        dict(cfg_normalization=0.0, cfg_truncation=1.0),
        dict(cfg_normalization=2, cfg_truncation=0),
    ],
)
def test_accepted_at_the_edges(fields):
    for cls in _declaring({**OK, **fields}):
        _validate(cls, **fields)


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
        (dict(num_outputs_per_prompt=0), "num_outputs_per_prompt"),
        (dict(num_outputs_per_prompt=5), "num_outputs_per_prompt"),
        (dict(num_outputs_per_prompt=True), "num_outputs_per_prompt"),
        (dict(lora=[("a", float("nan"))]), "lora"),
        (dict(lora=[("a", 1.0), ("a", 0.5)]), "lora"),
        (dict(num_frames=0), "num_frames"),
        (dict(num_frames=82), "num_frames"),
        (dict(num_frames=100_000_001), "num_frames"),
        (dict(num_frames=5.0), "num_frames"),
        (dict(num_frames=True), "num_frames"),
        (dict(fps=0), "fps"),
        (dict(fps=121), "fps"),
        (dict(fps=2.0), "fps"),
        (dict(guidance_scale_2=-1), "guidance_scale_2"),
        (dict(guidance_scale_2=float("nan")), "guidance_scale_2"),
        (dict(guidance_scale_2=float("inf")), "guidance_scale_2"),
        (dict(guidance_scale_2="3"), "guidance_scale_2"),
        (dict(cfg_normalization=-1), "cfg_normalization"),
        (dict(cfg_truncation=float("nan")), "cfg_truncation"),
    ],
)
def test_refused_with_the_field_named(fields, param):
    for cls in _declaring({**OK, **fields}):
        with pytest.raises(InvalidRequestError) as e:
            _validate(cls, **fields)
        assert e.value.param == param, cls.__name__
        assert e.value.status_code == 400


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(height=40), "height must be a positive multiple of 16, got 40"),
        (dict(width=1040), "width must be <= 1024, got 1040"),
        (dict(num_inference_steps=0), "num_inference_steps must be an integer in [1, 50], got 0"),
        (dict(guidance_scale=-0.5), "guidance_scale must be a finite number >= 0, got -0.5"),
        (
            dict(max_sequence_length=513),
            "max_sequence_length must be an integer in [1, 512], got 513",
        ),
        (dict(seed=-1), f"seed must be an integer in [0, {2**63 - 1}] or null, got -1"),
        (
            dict(num_outputs_per_prompt=5),
            "num_outputs_per_prompt must be an integer in [1, 4], got 5",
        ),
        (dict(prompt="x" * 20001), "prompt is longer than 20000 characters (20001)"),
        (dict(prompt=3), "prompt must be a string, got int"),
    ],
)
def test_messages_name_the_field_and_the_allowed_values(fields, message):
    with pytest.raises(InvalidRequestError) as e:
        _validate(SamplingParams, **fields)
    assert e.value.message == message


def test_unbounded_counts_say_so():
    """Without a limit a count's rule reads ``>= 1`` (``RequestSpec.generic()``: the checks
    ``sglang generate`` runs before the model is loaded)."""
    with pytest.raises(InvalidRequestError) as e:
        RequestSpec.generic().check_values({"prompt": "x", "num_inference_steps": 0})
    assert e.value.param == "num_inference_steps"
    assert e.value.message == "num_inference_steps must be an integer >= 1, got 0"


def test_spatial_factor_is_the_specs():
    p = SamplingParams(**{**OK, "height": 40, "width": 8})
    p.validate(_spec(SamplingParams, spatial_factor=8))
    with pytest.raises(InvalidRequestError):
        SamplingParams(**{**OK, "height": 40}).validate(_spec(SamplingParams, spatial_factor=16))


def test_pixel_steps_count_frames():
    """A video's cost is ``n x num_frames x width x height x steps``: the same request fits
    the budget with 5 frames and not with 6; the frames are named when ``n`` is 1."""
    from dataclasses import replace

    spec = _spec(WanSamplingParams, limits=replace(LIMITS, max_pixel_steps=5 * 64 * 48 * 4))
    WanSamplingParams(**{**OK, "num_frames": 5}).validate(spec)
    with pytest.raises(InvalidRequestError) as e:
        WanSamplingParams(**{**OK, "num_frames": 6}).validate(spec)
    assert e.value.param == "num_frames" and "1 x 6 x 48 x 64 x 4" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        WanSamplingParams(**{**OK, "num_frames": 5, "num_outputs_per_prompt": 2}).validate(spec)
    assert e.value.param == "num_outputs_per_prompt"


def test_server_pixel_step_budget_fits_the_models_default_request():
    from sglang.multimodal_gen.configs.server_args import DEFAULT_MAX_PIXEL_STEPS
    from sglang.multimodal_gen.entrypoints.http_server import resolve_max_pixel_steps

    image = dict(width=1024, height=1024, num_inference_steps=50, num_frames=1)
    video = dict(width=832, height=480, num_inference_steps=40, num_frames=81)
    assert resolve_max_pixel_steps(None, image) == DEFAULT_MAX_PIXEL_STEPS
    assert resolve_max_pixel_steps(None, video) == 4 * 832 * 480 * 40 * 81
    assert resolve_max_pixel_steps(0, video) is None  # no bound
    assert resolve_max_pixel_steps(1000, video) == 1000
