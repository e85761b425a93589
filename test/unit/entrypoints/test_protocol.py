"""The HTTP request protocol (``entrypoints/protocol.py``): ``size`` parsing and the size rule,
a request body -> the engine's job (fields, family fields, the model's defaults, value checks), the
server's bounds on top of the model's (``server_spec``), ``set_lora`` validation.

Body parsing, schema errors, auth and error envelopes are tested next to their modules
(``test_http_body.py``, ``test_schema_errors.py``, ``test_auth.py``, ``test_openai_errors.py``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.entrypoints.http_body import SchemaError, parse_json_body
from sglang.multimodal_gen.entrypoints.protocol import (
    ImageGenerationRequest,
    SetLoRARequest,
    default_size,
    image_job,
    parse_size,
    validate_set_lora,
)
from sglang.multimodal_gen.errors import InvalidRequestError

#: A Z-Image model's declaration (its defaults and model limits: ``models/families/zimage.py``).
ZIMAGE_DEFAULTS = ZImageSamplingParams(
    height=1024,
    width=1024,
    num_inference_steps=8,
    guidance_scale=0.0,
    max_sequence_length=512,
    cfg_normalization=0.0,
    cfg_truncation=1.0,
)


def _spec(
    spatial_factor: int = 16,
    max_image_size: int = 1024,
    max_n: int | None = 8,
    max_steps: int | None = 1000,
    max_pixel_steps: int | None = None,
    defaults: ZImageSamplingParams = ZIMAGE_DEFAULTS,
) -> RequestSpec:
    """A Z-Image model's spec with a server's bounds on top (as ``server_spec`` makes it)."""
    model = RequestSpec(
        "zimage",
        "Z-Image",
        ZImageSamplingParams,
        defaults,
        RequestLimits(max_image_size=4096, max_sequence_length=1024),
        spatial_factor=spatial_factor,
    )
    return model.with_limits(
        RequestLimits(
            max_image_size=max_image_size,
            max_num_frames=None,
            max_sequence_length=None,
            max_inference_steps=max_steps,
            max_num_outputs_per_prompt=max_n,
            max_pixel_steps=max_pixel_steps,
        )
    )


SPEC = _spec()


# ------------------------------------------------------------------------------ size / values


@pytest.mark.parametrize(
    "size,wh", [("64x64", (64, 64)), ("1024X512", (1024, 512)), (" 32 x 48 ", (32, 48))]
)
def test_parse_size_ok(size, wh):
    assert parse_size(size, SPEC) == wh


@pytest.mark.parametrize(
    "size,needle",
    [("64", "WxH"), ("x64", "WxH"), ("-64x64", "WxH"), ("65x64", "multiples of 16"),
     ("2048x64", "maximum 1024"), ("64x2048", "maximum 1024"), ("0x64", "WxH"), ("64.0x64", "WxH"),
     ("\uff16\uff14x64", "WxH"), ("\u0666\u0664x64", "WxH")],  # full-width, Arabic-Indic digits
)  # fmt: skip
def test_parse_size_bad(size, needle):
    with pytest.raises(InvalidRequestError) as e:
        parse_size(size, SPEC)
    assert e.value.param == "size" and needle in e.value.message


def test_size_error_gives_an_example_the_server_accepts():
    small = _spec(spatial_factor=8, max_image_size=256)
    with pytest.raises(InvalidRequestError) as e:
        parse_size("512x512", small)
    example = e.value.message.split("e.g. ")[1].strip("'")
    assert example == "256x256" and parse_size(example, small) == (256, 256)
    with pytest.raises(InvalidRequestError) as e:
        parse_size("big", SPEC)
    assert "e.g. '1024x1024'" in e.value.message


def test_image_job_translates_fields():
    req = ImageGenerationRequest(
        prompt="p",
        size="128x64",
        n=2,
        seed=5,
        num_inference_steps=3,
        guidance_scale=2,
        negative_prompt="blurry",
        lora=[{"name": "a", "scale": 0.5}, {"name": "b"}],
        output_format="JPG",
        quality="high",
        user="u1",
    )
    job = image_job(req, SPEC)
    p = job.params
    assert type(p) is ZImageSamplingParams and p.resolved
    assert p.set_fields() == {
        "prompt": "p",
        "height": 64,
        "width": 128,
        "num_outputs_per_prompt": 2,
        "seed": 5,
        "num_inference_steps": 3,
        "guidance_scale": 2.0,
        "negative_prompt": "blurry",
        "lora": (("a", 0.5), ("b", 1.0)),
        # the model's defaults of the fields the client left out
        "max_sequence_length": 512,
        "cfg_normalization": 0.0,
        "cfg_truncation": 1.0,
    }
    assert isinstance(p.guidance_scale, float)
    assert job.output_format == "jpeg" and job.response_format == "b64_json"
    assert job.size == "128x64"


def test_image_job_family_fields_and_strength():
    """A field of the served model's family is passed on; ``strength`` is the adapter weight
    (``scale`` its alias; both given and different is refused)."""
    req = ImageGenerationRequest(
        prompt="p", cfg_normalization=1, cfg_truncation=0.5, lora={"name": "a", "strength": 0.25}
    )
    p = image_job(req, SPEC).params
    assert (p.cfg_normalization, p.cfg_truncation) == (1.0, 0.5)
    assert p.lora == (("a", 0.25),)
    req = ImageGenerationRequest(prompt="p", lora={"name": "a", "strength": 0.5, "scale": 0.5})
    assert image_job(req, SPEC).params.lora == (("a", 0.5),)
    with pytest.raises(InvalidRequestError) as e:
        image_job(
            ImageGenerationRequest(prompt="p", lora={"name": "a", "strength": 1, "scale": 2}), SPEC
        )
    assert e.value.param == "lora" and "alias" in e.value.message


@pytest.mark.parametrize("field,value", [("true_cfg_scale", 4.0), ("guidance_scale_2", 3.0)])
def test_a_field_of_another_family_is_refused_naming_it(field, value):
    """The body's schema takes every registered family's fields (Flux's ``true_cfg_scale``,
    Wan's ``guidance_scale_2``: 422 only for a field no model declares); the served model's
    spec refuses the ones it does not declare (400, naming the field)."""
    req = parse_json_body(
        json.dumps({"prompt": "p", field: value}).encode(), ImageGenerationRequest
    )
    with pytest.raises(InvalidRequestError) as e:
        image_job(req, SPEC)
    assert e.value.param == field and e.value.status_code == 400
    assert e.value.message.startswith(f"{field} is not a parameter of Z-Image models")


def test_a_field_no_model_declares_is_a_schema_error():
    with pytest.raises(SchemaError) as e:
        parse_json_body(b'{"prompt": "p", "num_inference_step": 3}', ImageGenerationRequest)
    assert e.value.status_code == 422 and e.value.param == "num_inference_step"


def test_image_job_defaults_are_the_models():
    p = image_job(ImageGenerationRequest(prompt="p"), SPEC).params
    assert p.replace(seed=None) == ZIMAGE_DEFAULTS.replace(prompt="p", num_outputs_per_prompt=1)
    assert p.seed is not None  # drawn once, here
    small = _spec(max_image_size=500)
    assert image_job(ImageGenerationRequest(prompt="p", size="auto"), small).size == "496x496"
    # without a size the model's own default size is used (the demo model's 64x64)
    own = image_job(
        ImageGenerationRequest(prompt="p"),
        _spec(defaults=ZIMAGE_DEFAULTS.replace(height=64, width=64)),
    )
    assert own.params.height == own.params.width == 64
    wide = image_job(
        ImageGenerationRequest(prompt="p"),
        _spec(max_image_size=500, defaults=ZIMAGE_DEFAULTS.replace(height=480, width=832)),
    )
    assert wide.size == "496x480"  # capped at the server's maximum, on the model's grid
    assert default_size(_spec(defaults=ZImageSamplingParams())) == (1024, 1024)
    assert default_size(_spec(max_image_size=500, defaults=ZImageSamplingParams())) == (496, 496)
    assert image_job(ImageGenerationRequest(prompt="p", lora=[]), SPEC).params.lora == ()


@pytest.mark.parametrize(
    "fields,param,needle",
    [
        ({"n": 0}, "n", "n must be an integer in [1, 8], got 0"),
        ({"n": 9}, "n", "n must be an integer in [1, 8], got 9"),
        ({"num_inference_steps": 0}, "num_inference_steps", "[1, 1000]"),
        ({"num_inference_steps": 1001}, "num_inference_steps", "[1, 1000]"),
        ({"guidance_scale": float("nan")}, "guidance_scale", "finite"),
        ({"guidance_scale": -0.5}, "guidance_scale", ">= 0"),
        ({"cfg_truncation": -0.5}, "cfg_truncation", ">= 0"),
        ({"seed": 2**63}, "seed", "[0, "),
        ({"response_format": "file"}, "response_format", "b64_json"),
        ({"output_format": "gif"}, "output_format", "png"),
        ({"output_compression": -1}, "output_compression", "[0, 100]"),
        ({"stream": True}, "stream", "not supported"),
        ({"lora": {"name": " "}}, "lora", "non-empty"),
        ({"lora": {"name": "a", "scale": float("inf")}}, "lora", "finite"),
        ({"prompt": "x" * 20001}, "prompt", "longer"),
    ],
)
def test_image_job_errors(fields, param, needle):
    req = ImageGenerationRequest(**{"prompt": "p", "size": "64x64", **fields})
    with pytest.raises(InvalidRequestError) as e:
        image_job(req, SPEC)
    assert e.value.param == param and needle in e.value.message, e.value.message


def test_server_spec_tightens_with_the_servers_bounds():
    """``server_spec``: the engine's spec with ``--max-image-size``, ``--max-n``,
    ``--max-steps`` and ``--max-pixel-steps`` on top; the model's own bounds stay."""
    from sglang.multimodal_gen.entrypoints.http_server import server_spec

    model = _spec(max_image_size=4096, max_n=None, max_steps=None)
    args = ServerArgs(
        max_image_size=512, max_images_per_request=3, max_inference_steps=20, max_pixel_steps=0
    )
    spec = server_spec(model, args)
    limits = spec.limits
    assert (limits.max_image_size, limits.max_num_outputs_per_prompt) == (512, 3)
    assert (limits.max_inference_steps, limits.max_pixel_steps) == (20, None)
    assert limits.max_sequence_length == 1024  # the model's
    assert (spec.params_class, spec.defaults) == (model.params_class, model.defaults)
    for body, param, message in (
        ({"n": 4}, "n", "n must be an integer in [1, 3], got 4"),
        ({"num_inference_steps": 21}, "num_inference_steps", "[1, 20]"),
        ({"size": "528x512"}, "size", "maximum 512"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            image_job(ImageGenerationRequest(prompt="p", **body), spec)
        assert e.value.param == param and message in e.value.message, e.value.message
    image_job(ImageGenerationRequest(prompt="p", n=3, num_inference_steps=20, size="512x512"), spec)
    # unset: the server's default side (2048), or the model's when smaller; a default budget
    default = server_spec(model, ServerArgs()).limits
    assert default.max_image_size == 2048 and default.max_pixel_steps is not None
    with pytest.raises(ValueError, match="larger than this model's maximum of 4096"):
        server_spec(model, ServerArgs(max_image_size=8192))


def test_validate_set_lora():
    targets = ("all", "transformer")
    from sglang.multimodal_gen.lora.requests import SetLoRAArgs

    args = validate_set_lora(SetLoRARequest(lora_nickname="a", lora_path="/x.safetensors"), targets)
    assert args == SetLoRAArgs(
        nicknames=["a"],
        paths=["/x.safetensors"],
        targets=["all"],
        strengths=[1.0],
        merge_mode=None,
    )
    args = validate_set_lora(
        SetLoRARequest(lora_nickname=["a", "b"], lora_path=[None, "b"], strength=[1, 0.5]), targets
    )
    assert args.strengths == [1.0, 0.5]
    # a scalar or a one-element list applies to every nickname
    args = validate_set_lora(
        SetLoRARequest(lora_nickname=["a", "b"], lora_path="p", strength=[0.5]), targets
    )
    assert args.paths == ["p", "p"] and args.strengths == [0.5, 0.5]
    args = validate_set_lora(SetLoRARequest(lora_nickname=["a", "b"], lora_path=["p"]), targets)
    assert args.paths == ["p", "p"]
    validate_set_lora(SetLoRARequest(lora_nickname=["a"], lora_path="a"), targets)
    for bad, param, needle in (
        (dict(lora_nickname=[]), "lora_nickname", "at least one"),
        (dict(lora_nickname=["a", "b"], lora_path=["a", "b", "c"]), "lora_path", "3 entries"),
        (dict(lora_nickname=["a", "b"], strength=[1.0, 2.0, 3.0]), "strength", "has 2"),
        (dict(lora_nickname=["a", "a"]), "lora_nickname", "twice"),
        (dict(lora_nickname=["a", "a"], lora_path=["p", "q"]), "lora_path", "two different"),
        (dict(lora_nickname="a", target="transformer_2"), "target", "'transformer'"),
        (dict(lora_nickname="a", lora_path=""), "lora_path", "non-empty"),
        (dict(lora_nickname="a", merge_mode="x"), "merge_mode", "'auto'"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            validate_set_lora(SetLoRARequest(**bad), targets)
        assert e.value.param == param, (bad, e.value.message)
        assert needle in e.value.message, (bad, e.value.message)


def test_parse_json_body_accepts_nan_literal_for_value_check():
    req = parse_json_body(b'{"prompt": "x", "guidance_scale": NaN}', ImageGenerationRequest)
    with pytest.raises(InvalidRequestError, match="guidance_scale"):
        image_job(req, SPEC)


def test_size_digits_bounded_and_pixel_budget():
    with pytest.raises(InvalidRequestError) as e:
        parse_size("9" * 5000 + "x64", SPEC)
    assert e.value.param == "size" and "Exceeds" not in e.value.message
    spec = _spec(max_pixel_steps=1024 * 1024 * 256)
    big = dict(prompt="p", size="1024x1024", num_inference_steps=50)
    image_job(ImageGenerationRequest(**big, n=1), spec)
    with pytest.raises(InvalidRequestError) as e:
        image_job(ImageGenerationRequest(**big, n=8), spec)
    assert e.value.param == "n" and "419430400 pixel-steps" in e.value.message
    # the model's default step count enters the budget when the request has none
    many = _spec(max_pixel_steps=1024 * 1024 * 8 * 2)
    image_job(ImageGenerationRequest(prompt="p", size="1024x1024", n=2), many)
    with pytest.raises(InvalidRequestError) as e:
        image_job(ImageGenerationRequest(prompt="p", size="1024x1024", n=3), many)
    assert e.value.param == "n" and "3 x 1024 x 1024 x 8 = " in e.value.message


# ----------------------------------------------------------------- the size rule is check_size's
# The HTTP ``size`` field is parsed, checked by ``check_size``, and its refusal reworded for
# ``size`` (which bound failed is asked of ``check_size`` too).


def _generic_spec(factor=16, top=1024) -> RequestSpec:
    spec = dataclasses.replace(RequestSpec.generic(), spatial_factor=factor)
    return spec.with_limits(RequestLimits(max_image_size=top))


@pytest.mark.parametrize(
    "size,reason",
    [
        ("33x32", "width and height must be multiples of 16 for this model"),
        ("32x40", "width and height must be multiples of 16 for this model"),
        ("2048x32", "larger than the server's maximum 1024 per side (--max-image-size)"),
        ("2050x33", "larger than the server's maximum 1024 per side (--max-image-size)"),
    ],
)
def test_a_refused_size_names_the_bound_it_fails(size, reason):
    with pytest.raises(InvalidRequestError) as e:
        parse_size(size, _generic_spec())
    assert e.value.param == "size"
    assert str(e.value) == (
        f"invalid size {size!r}: {reason}; expected 'WxH' with W and H multiples of 16 in "
        "[16, 1024], e.g. '1024x1024'"
    )


def test_accepted_sizes():
    assert parse_size("48x1024", _generic_spec()) == (48, 1024)
    assert parse_size("7x9", _generic_spec(factor=1, top=None)) == (7, 9)


def test_an_edit_without_size_takes_the_models_own_size_rule():
    """/v1/images/edits without ``size``: an image-to-image model keeps the input's size
    (``auto_size``); an edit model (it requires an image) leaves the size to its own rule, as
    the CLI and the Python API do (its defaults here)."""
    import numpy as np
    from sglang.multimodal_gen.configs.sampling_params import SamplingParams
    from sglang.multimodal_gen.entrypoints.protocol import ImageEditRequest, image_job
    from sglang.multimodal_gen.image_inputs import InputImage

    defaults = SamplingParams(prompt="", height=64, width=64, num_inference_steps=2,
                              guidance_scale=1.0, max_sequence_length=32, strength=0.6)  # fmt: skip
    img2img = RequestSpec("i", "Img", SamplingParams, defaults, RequestLimits(),
                          inputs=("text", "image"))  # fmt: skip
    edit = RequestSpec("e", "Edit", SamplingParams, defaults.replace(strength=None),
                       RequestLimits(), inputs=("text", "image"),
                       required_inputs=("text", "image"))  # fmt: skip
    image = (InputImage(np.zeros((32, 48, 3), np.uint8)),)
    body = ImageEditRequest(prompt="p")
    job = image_job(body, img2img, (48, 32), image=image)
    assert (job.params.width, job.params.height) == (48, 32)
    job = image_job(body, edit, (48, 32), image=image)
    assert (job.params.width, job.params.height) == (64, 64)  # the model's default
    job = image_job(ImageEditRequest(prompt="p", size="32x16"), edit, (48, 32), image=image)
    assert (job.params.width, job.params.height) == (32, 16)  # a given size is kept


def test_family_adapter_field_takes_the_lora_json_form():
    """A family's own field of kind ``lora`` (LTX-2's ``stage_2_lora``) reads ``{name,
    strength}`` entries over HTTP as ``lora`` does (the strength kept, ``[]`` kept)."""
    from sglang.multimodal_gen.configs.ltx2_sampling import LTX2SamplingParams
    from sglang.multimodal_gen.entrypoints.protocol import ImageGenerationRequest, sampling_params

    defaults = LTX2SamplingParams(height=64, width=64, num_inference_steps=2,
                                  guidance_scale=1.0, max_sequence_length=32)  # fmt: skip
    spec = RequestSpec("ltx2", "LTX-2", LTX2SamplingParams, defaults,
                       RequestLimits(max_image_size=4096, max_sequence_length=1024),
                       spatial_factor=32)  # fmt: skip
    body = ImageGenerationRequest(prompt="p", lora={"name": "d", "strength": 0.25},
                                  stage_2_lora=[{"name": "d", "strength": 0.5}])  # fmt: skip
    p = sampling_params(body, spec, None)
    assert p.lora == (("d", 0.25),) and p.stage_2_lora == (("d", 0.5),)
    body = ImageGenerationRequest(prompt="p", stage_2_lora=[])
    assert sampling_params(body, spec, None).stage_2_lora == ()
