"""``SamplingParams`` and ``RequestSpec``: the declarations, the rules of each field kind, the one
resolve, and what derives from the declarations (CLI flags, HTTP request models). The bounds of
``SamplingParams.validate``: ``sampling_params/test_validate.py``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from sglang.multimodal_gen.configs.sampling_params import (
    MAX_SEED,
    RequestLimits,
    RequestSpec,
    SamplingParams,
    VideoSamplingParams,
)
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.registry import list_families

FAMILY_CLASSES = sorted({f.params_class() for f in list_families()}, key=lambda c: c.__name__)
ALL_CLASSES = [SamplingParams, VideoSamplingParams, *FAMILY_CLASSES]

ZIMAGE_DEFAULTS = ZImageSamplingParams(
    height=64,
    width=64,
    num_inference_steps=2,
    guidance_scale=0.0,
    max_sequence_length=64,
    cfg_normalization=0.0,
    cfg_truncation=1.0,
)
ZIMAGE = RequestSpec(
    "zimage",
    "Z-Image",
    ZImageSamplingParams,
    ZIMAGE_DEFAULTS,
    RequestLimits(max_image_size=1024),
    spatial_factor=16,
)
WAN = RequestSpec(
    "wan",
    "Wan2.x",
    WanSamplingParams,
    WanSamplingParams(
        height=32,
        width=48,
        num_inference_steps=3,
        guidance_scale=4.0,
        max_sequence_length=32,
        num_frames=5,
        fps=16,
        guidance_scale_2=3.0,
    ),  # fmt: skip
    RequestLimits(max_image_size=512, max_num_frames=81),
    spatial_factor=16,
    outputs="video",
)


def _unbounded(cls) -> RequestSpec:
    none = RequestLimits(**{f.name: None for f in dataclasses.fields(RequestLimits)})
    return RequestSpec("t", "T", cls, cls(), none, spatial_factor=16)


#: A wrong value of each field kind (each refused by its kind's rule).
WRONG = {
    "text": [3, "x" * 20001, "\ud800"],
    "size": [40, 0, -16, 32.0, True],
    "count": [0, -1, 2.0, True, "2"],
    "scale": [-0.5, float("nan"), float("inf"), "3", True],
    "seed": [-1, MAX_SEED + 1, 1.5, True],
    "lora": [[("a", float("nan"))], [("a", 1.0), ("a", 0.5)], [(" ", 1.0)], "a"],
    "image": ["x", 3, ()],
    "fraction": [0, 0.0, 1.5, -0.1, float("nan"), True, "0.5"],
    "flag": [1, 0, "true"],
    "indices": [[-1], [1.5], [True], "28", 28],
    "cache": ["fastcache", {"method": "fbcache", "threshold": -1}, {"fn": 2}, 3],
}
FIELD_CASES = [
    (cls, f.name, f.metadata["kind"], value)
    for cls in ALL_CLASSES
    for f in dataclasses.fields(cls)
    for value in WRONG[f.metadata["kind"]]
]


def test_every_field_has_a_known_kind_and_help():
    for cls in ALL_CLASSES:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("kind") in WRONG, (cls.__name__, f.name)
            assert f.metadata.get("help"), (cls.__name__, f.name)


@pytest.mark.parametrize(
    "cls,name,kind,value",
    FIELD_CASES,
    ids=[f"{c.__name__}.{n}={v!r}"[:80] for c, n, _, v in FIELD_CASES],
)
def test_a_wrong_value_of_every_field_names_it(cls, name, kind, value):
    values = {"prompt": "a fox", name: value}
    with pytest.raises(InvalidRequestError) as e:
        cls(**values).validate(_unbounded(cls))
    assert e.value.param == name and e.value.status_code == 400
    assert e.value.message.startswith(name), e.value.message


def test_each_family_declares_its_own_fields():
    by_name = {c.__name__: c for c in FAMILY_CLASSES}
    assert by_name["ZImageSamplingParams"].own_fields() == ("cfg_normalization", "cfg_truncation")
    assert by_name["FluxSamplingParams"].own_fields() == ("true_cfg_scale",)
    assert by_name["QwenImageSamplingParams"].own_fields() == ("true_cfg_scale",)
    assert by_name["WanSamplingParams"].own_fields() == ("num_frames", "fps", "guidance_scale_2")
    assert issubclass(WanSamplingParams, VideoSamplingParams)
    assert SamplingParams.per_row_fields() == {
        "prompt", "negative_prompt", "seed", "lora", "image", "mask_image",
    }  # fmt: skip


# ------------------------------------------------------------------------------ undeclared fields


def test_a_field_the_model_does_not_declare_is_refused_naming_it():
    # the Python API: the dataclasses themselves
    with pytest.raises(TypeError, match="guidance_scale_2"):
        SamplingParams(prompt="p", guidance_scale_2=3)
    with pytest.raises(TypeError, match="guidance_scale_2"):
        ZImageSamplingParams(prompt="p", guidance_scale_2=3)
    # spec.params: one request of this model from field values (an edge)
    for field, value in (("guidance_scale_2", 3.0), ("true_cfg_scale", 4.0), ("num_frames", 5)):
        with pytest.raises(InvalidRequestError) as e:
            ZIMAGE.params(prompt="p", **{field: value})
        assert e.value.param == field and e.value.status_code == 400
        assert e.value.message.startswith(f"{field} is not a parameter of Z-Image models")
        assert "cfg_truncation" in e.value.message  # the model's parameters are listed
    with pytest.raises(InvalidRequestError) as e:
        WAN.params(prompt="p", cfg_normalization=1.0)
    assert e.value.param == "cfg_normalization"
    with pytest.raises(InvalidRequestError) as e:
        ZIMAGE.params(seed=1)
    assert e.value.param == "prompt" and e.value.message == "prompt is required"
    # spec.convert / resolve: another family's request with its own field set
    wan = WanSamplingParams(prompt="p", guidance_scale_2=3.0)
    for call in (ZIMAGE.convert, ZIMAGE.resolve):
        with pytest.raises(InvalidRequestError) as e:
            call(wan)
        assert e.value.param == "guidance_scale_2"
        assert e.value.message.startswith("guidance_scale_2 is not a parameter of Z-Image models")


def test_convert_takes_the_common_fields_of_any_class():
    base = SamplingParams(prompt="p", seed=3, height=32)
    z = ZIMAGE.convert(base)
    assert type(z) is ZImageSamplingParams
    assert (z.prompt, z.seed, z.height, z.cfg_truncation) == ("p", 3, 32, None)
    assert ZIMAGE.convert(z) is z
    # another family's class whose own fields are unset converts too
    w = ZIMAGE.convert(WanSamplingParams(prompt="p", guidance_scale=2.0))
    assert type(w) is ZImageSamplingParams and w.guidance_scale == 2.0


# ------------------------------------------------------------------------------ resolve


def test_resolve_fills_the_models_defaults_and_checks():
    r = ZIMAGE.resolve(SamplingParams(prompt="p", height=32))
    assert type(r) is ZImageSamplingParams and r.resolved
    expected = dataclasses.replace(ZIMAGE_DEFAULTS, prompt="p", height=32, num_outputs_per_prompt=1)
    assert dataclasses.replace(r, seed=None) == expected
    unset = {f.name for f in dataclasses.fields(r) if getattr(r, f.name) is None}
    assert unset == {
        "negative_prompt",
        "lora",
        "image",
        "mask_image",
        "strength",
        "cache",
    }  # no model default: CFG without one, no adapters; the pipeline's spec fills cache
    assert not SamplingParams(prompt="p").resolved
    with pytest.raises(InvalidRequestError) as e:
        ZIMAGE.resolve(SamplingParams(prompt="p", height=40))
    assert e.value.param == "height"
    # a default that breaks a limit is refused as the request's own value would be
    tight = ZIMAGE.with_limits(RequestLimits(max_inference_steps=1))
    with pytest.raises(InvalidRequestError) as e:
        tight.resolve(SamplingParams(prompt="p"))
    assert e.value.param == "num_inference_steps" and "[1, 1]" in e.value.message


def test_resolve_draws_the_seed_once():
    p = ZIMAGE.params(prompt="p")
    r = ZIMAGE.resolve(p)
    assert isinstance(r.seed, int) and 0 <= r.seed <= MAX_SEED
    assert ZIMAGE.resolve(r) is r  # resolved for this model: as is, same seed
    again = ZIMAGE.with_limits(RequestLimits(max_inference_steps=100)).resolve(r)
    assert again is not r and again.seed == r.seed  # checked again under tighter limits
    assert ZIMAGE.resolve(p).seed != r.seed  # an unresolved request draws a new one
    assert ZIMAGE.resolve(ZIMAGE.params(prompt="p", seed=7)).seed == 7
    # a changed copy is unresolved: resolved (and checked) again
    changed = r.replace(height=40)
    assert not changed.resolved
    with pytest.raises(InvalidRequestError):
        ZIMAGE.resolve(changed)
    assert ZIMAGE.resolve(r.replace(height=32)).seed == r.seed  # the seed is a field like any


def test_resolve_under_tighter_limits_checks_again():
    """A request resolved under the model's limits is not valid for a server whose bounds are
    tighter (``RequestSpec.resolve``: returned as is only when resolved "under these limits or
    tighter ones")."""
    r = ZIMAGE.resolve(ZIMAGE.params(prompt="p", num_inference_steps=50))
    server = ZIMAGE.with_limits(RequestLimits(max_inference_steps=10))
    with pytest.raises(InvalidRequestError) as e:
        server.resolve(r)
    assert e.value.param == "num_inference_steps"


def test_resolve_for_another_model_resolves_again():
    r = WAN.resolve(WanSamplingParams(prompt="p"))  # 48 pixels wide: a multiple of 16
    other = dataclasses.replace(WAN, family="wan-other")
    assert other.resolve(r).seed == r.seed
    coarser = dataclasses.replace(WAN, spatial_factor=32)
    with pytest.raises(InvalidRequestError) as e:
        coarser.resolve(r)
    assert e.value.param == "width" and "multiple of 32" in e.value.message


@pytest.mark.parametrize(
    "lora,expected",
    [
        (None, None),
        ([], ()),
        ([("a", 1)], (("a", 1.0),)),
        ([["a", 0.5], ("b", -1.0)], (("a", 0.5), ("b", -1.0))),
        ({"name": "a", "scale": 0.25}, (("a", 0.25),)),
        ([{"name": "a"}], (("a", 1.0),)),
        ([{"name": "a", "strength": 0.5}], (("a", 0.5),)),  # the documented spelling
    ],
)
def test_resolve_normalises_lora(lora, expected):
    r = ZIMAGE.resolve(ZIMAGE.params(prompt="p", lora=lora))
    assert r.lora == expected
    if expected is not None:
        assert type(r.lora) is tuple and all(type(x) is tuple for x in r.lora)
        assert all(type(s) is float for _, s in r.lora)
        hash(r)  # a resolved request is hashable (a frozen dataclass of tuples)


# ------------------------------------------------------------------------------ limits / as_dict


def test_with_limits_tightens():
    a = RequestLimits(max_image_size=1024, max_num_frames=81, max_sequence_length=512)
    b = RequestLimits(
        max_image_size=2048,
        max_num_frames=None,
        max_sequence_length=256,
        max_inference_steps=50,
        max_num_outputs_per_prompt=4,
        max_pixel_steps=None,
    )
    t = a.tightened(b)
    assert t == RequestLimits(
        max_image_size=1024,
        max_num_frames=81,
        max_sequence_length=256,
        max_inference_steps=50,
        max_num_outputs_per_prompt=4,
        max_pixel_steps=None,
    )
    assert b.tightened(a) == t
    spec = ZIMAGE.with_limits(RequestLimits(max_image_size=256, max_num_outputs_per_prompt=2))
    assert spec.limits.max_image_size == 256 and spec.limits.max_num_outputs_per_prompt == 2
    assert ZIMAGE.limits.max_image_size == 1024  # a new spec; the model's is unchanged
    assert spec.with_limits(RequestLimits(max_image_size=4096)).limits.max_image_size == 256
    assert (spec.family, spec.params_class, spec.defaults) == (
        ZIMAGE.family, ZIMAGE.params_class, ZIMAGE.defaults,
    )  # fmt: skip
    spec.resolve(spec.params(prompt="p", height=256, num_outputs_per_prompt=2))
    for field, value, message in (
        ("height", 272, "height must be <= 256, got 272"),
        ("num_outputs_per_prompt", 3, "num_outputs_per_prompt must be an integer in [1, 2], got 3"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            spec.resolve(spec.params(prompt="p", **{field: value}))
        assert (e.value.param, e.value.message) == (field, message)


def test_as_dict_is_the_flat_defaults():
    limits = {
        "max_image_size", "max_num_frames", "max_sequence_length_limit", "modality", "inputs",
        "required_inputs",
    }  # fmt: skip
    for spec in (ZIMAGE, WAN):
        d = spec.as_dict()
        fields = set(spec.params_class.field_names()) - {
            "prompt", "lora", "seed", "image", "mask_image",
        }  # fmt: skip
        assert set(d) == fields | limits
        for name in fields:
            assert d[name] == getattr(spec.defaults, name), name
    z, w = ZIMAGE.as_dict(), WAN.as_dict()
    assert (z["modality"], z["inputs"], z["max_image_size"]) == ("image", ["text"], 1024)
    assert (z["max_sequence_length_limit"], z["max_num_frames"]) == (512, 1)
    assert (z["height"], z["width"], z["cfg_truncation"]) == (64, 64, 1.0)
    assert (w["modality"], w["max_num_frames"], w["num_frames"], w["fps"]) == ("video", 81, 5, 16)
    assert w["guidance_scale_2"] == 3.0 and "cfg_truncation" not in w
    import json

    json.dumps(z), json.dumps(w)  # JSON-able (engine.defaults, /v1/models)


def test_generic_spec_checks_common_values_without_a_model():
    generic = RequestSpec.generic()
    generic.check_values({"prompt": "p", "height": 40, "guidance_scale_2": -1})  # not its fields
    for values, param in (
        ({"prompt": "p", "guidance_scale": -1.0}, "guidance_scale"),
        ({"prompt": "x" * 20001}, "prompt"),
        ({"prompt": "p", "seed": -1}, "seed"),
        ({"prompt": "p", "num_outputs_per_prompt": 0}, "num_outputs_per_prompt"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            generic.check_values(values)
        assert e.value.param == param


def test_parameters_describe_every_field():
    params = {p["name"]: p for p in WAN.parameters()}
    assert list(params) == list(WanSamplingParams.field_names())
    assert params["num_frames"]["kind"] == "count" and params["num_frames"]["default"] == 5
    assert params["guidance_scale_2"]["help"] and params["lora"]["kind"] == "lora"


# ------------------------------------------------------------------------------ derived edges


def _owners() -> dict[str, list[str]]:
    """``{field: [display names of the families that add it]}`` from the registry."""
    out: dict[str, list[str]] = {}
    for fam in list_families():
        for name in fam.params_class().own_fields():
            out.setdefault(name, []).append(fam.display_name)
    return out


def test_cli_flags_derive_from_every_familys_declarations():
    from sglang.cli.generate import sampling_flags

    flags = sampling_flags()
    # a family's field declared cli=False (LTX-2's stage_2_lora, an adapter list) has no flag
    no_cli = {f.name for c in FAMILY_CLASSES for f in dataclasses.fields(c)
              if not f.metadata.get("cli", True)}  # fmt: skip
    owners = {n: fams for n, fams in _owners().items() if n not in no_cli}
    # images: --image-path / --mask-path (files, decoded at the edge); cache: --cache-method
    # and its knobs (the engine's, which the CLI's one request runs with)
    files = {"lora", "image", "mask_image", "cache"}
    assert set(flags) == (set(SamplingParams.field_names()) - files) | set(owners)
    for name, fams in owners.items():
        assert list(flags[name][1]) == fams, name

    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        # no wrapping: argparse breaks lines after hyphens ("Qwen-\nImage-Edit-Plus")
        env={**os.environ, "COLUMNS": "100000"},
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the help at the terminal width
    for name in SamplingParams.field_names():
        if name not in files:  # --lora-path / --lora-scale, --image-path, --mask-path
            assert f"--{name.replace('_', '-')}" in text, name
    assert "--image-path" in text and "--mask-path" in text
    assert "--num-outputs-per-prompt" in text
    for name, fams in owners.items():
        flag = f"--{name.replace('_', '-')}"
        assert flag in text, name
        f = dataclasses.fields(next(c for c in FAMILY_CLASSES if name in c.own_fields()))
        help_text = next(x.metadata["help"] for x in f if x.name == name)
        assert f"{help_text} (models: {', '.join(fams)})" in text, name


def test_sampling_values_are_the_given_flags():
    import argparse

    from sglang.cli.generate import add_sampling_args, sampling_values

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(
        ["--prompt", "p", "--guidance-scale-2", "3", "--num-outputs-per-prompt", "2",
         "--cfg-truncation", "0.5", "--seed", "4"]
    )  # fmt: skip
    assert sampling_values(args) == {
        "prompt": "p",
        "guidance_scale_2": 3.0,
        "num_outputs_per_prompt": 2,
        "cfg_truncation": 0.5,
        "seed": 4,
    }


def test_http_request_models_have_every_declared_field():
    from sglang.multimodal_gen.entrypoints.protocol import ImageGenerationRequest
    from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest

    image = set(ImageGenerationRequest.model_fields)
    video = set(VideoGenerationRequest.model_fields)
    renamed = {"num_outputs_per_prompt": "n", "height": "size", "width": "size"}
    for fam in list_families():
        cls = fam.params_class()
        model = video if issubclass(cls, VideoSamplingParams) else image
        for name in cls.field_names():
            if model is video and name == "num_outputs_per_prompt":
                continue  # one video per job
            if name in ("image", "mask_image"):
                continue  # files: the edits route's parts, /v1/videos' input_reference
            assert renamed.get(name, name) in model, (fam.name, name)
    # a video's size in seconds or frames; never n (one video per job)
    assert {"seconds", "num_frames", "fps"} <= video and "n" not in video


# ------------------------------------------------------------------------------ typed outputs
