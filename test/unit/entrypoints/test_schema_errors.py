"""Schema errors (``entrypoints/schema_errors.py``): a body that does not match the schema is a 422
with one sentence naming the field and what it takes, for every field of every request body."""

from __future__ import annotations

import json

import pytest
from sglang.multimodal_gen.entrypoints.http_body import SchemaError, parse_json_body
from sglang.multimodal_gen.entrypoints.protocol import ImageGenerationRequest, SetLoRARequest


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"prompt": "p", "n": "2"}, "n", "n must be an integer, got the string '2'"),
        ({"prompt": "p", "seed": True}, "seed", "seed must be an integer, got true"),
        ({"prompt": "p", "n": 2.0}, "n", "n must be an integer, got a number"),
        (
            {"prompt": "p", "lora": [{"name": 3}]},
            "lora",
            "lora.0.name must be a string, got an integer",
        ),
        ({"size": "64x64"}, "prompt", "prompt is required"),
        ({"prompt": "p", "sed": 1}, "sed", "sed: unknown field"),
    ],
)
def test_schema_errors_are_one_sentence_per_field(body, param, message):
    with pytest.raises(SchemaError) as e:
        parse_json_body(json.dumps(body).encode(), ImageGenerationRequest)
    assert e.value.param == param
    assert e.value.message == "request body does not match the schema: " + message


def _request_models():
    from sglang.multimodal_gen.entrypoints import protocol, videos

    # by their public names (the generation bodies are built with ``create_model`` from
    # ``_ImageGenerationBody`` / ``_VideoGenerationBody`` plus the declared fields)
    return {
        name: m
        for mod in (protocol, videos)
        for name, m in vars(mod).items()
        if isinstance(m, type) and name.endswith("Request") and hasattr(m, "model_fields")
    }


def test_every_request_field_has_its_own_schema_sentence():
    """A wrong JSON type in any field of any request body is a 422 naming that field and what
    it takes (the video fields once fell through to 'the body must be a JSON object')."""
    from sglang.multimodal_gen.entrypoints.protocol import LoRASpec
    from sglang.multimodal_gen.entrypoints.schema_errors import _expected, model_field_names
    from sglang.multimodal_gen.entrypoints.videos import _InputReference

    models = _request_models()
    assert set(models) >= {"ImageGenerationRequest", "VideoGenerationRequest"}
    for name, model in models.items():
        for field in model_field_names(model):
            # the table's words, or (a family's declared field) its annotation's JSON type
            nested = (LoRASpec, _InputReference)  # the objects a body field may hold
            owner = (
                model
                if field in model.model_fields
                else next((m for m in nested if field in m.model_fields), LoRASpec)
            )
            assert field in owner.model_fields, (name, field)
            assert _expected(owner, field) != "a value of another type", (name, field)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("cfg_normalization", True, "cfg_normalization must be a number, got true"),
        ("cfg_truncation", "1", "cfg_truncation must be a number, got the string '1'"),
        ("true_cfg_scale", [4], "true_cfg_scale must be a number, got a list"),
    ],
)
def test_family_fields_schema_errors_name_the_field(field, value, expected):
    with pytest.raises(SchemaError) as e:
        parse_json_body(json.dumps({"prompt": "p", field: value}).encode(), ImageGenerationRequest)
    assert e.value.param == field and e.value.status_code == 422
    assert e.value.message == "request body does not match the schema: " + expected


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("seconds", [4], "seconds must be a number or a numeric string, got a list"),
        ("fps", "16", "fps must be an integer, got the string '16'"),
        ("num_frames", 8.5, "num_frames must be an integer, got a number"),
        ("guidance_scale_2", True, "guidance_scale_2 must be a number, got true"),
        # a family's own adapter field (LTX-2) is worded as lora is
        ("stage_2_lora", 3, 'stage_2_lora must be an object {"name": string, "strength": number}'),
        ("stage_2_lora", [3], 'stage_2_lora.0 must be an object {"name": string, "strength": '),
    ],
)
def test_video_schema_errors_name_the_field(field, value, expected):
    from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest

    with pytest.raises(SchemaError) as e:
        parse_json_body(json.dumps({"prompt": "p", field: value}).encode(), VideoGenerationRequest)
    assert e.value.param == field
    assert expected in e.value.message, e.value.message


def test_set_lora_schema_is_strict():
    with pytest.raises(SchemaError) as e:
        parse_json_body(b'{"lora_nickname": "a", "strength": true}', SetLoRARequest)
    assert e.value.param == "strength"
    assert "strength must be a number or a list of numbers, got true" in e.value.message
    assert parse_json_body(b'{"lora_nickname": "a", "strength": 2}', SetLoRARequest).strength == 2
