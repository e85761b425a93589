"""Unit tests of the HTTP protocol layer: value checks, body parsing, auth, error envelopes, CLI."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.configs.server_args import ServerArgs, detect_model_type
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.entrypoints.auth import ApiKeyAuth, bearer_token
from sglang.multimodal_gen.entrypoints.http_body import (
    BodyError,
    SchemaError,
    parse_json_body,
)
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.entrypoints.protocol import (
    ImageGenerationRequest,
    SetLoRARequest,
    default_size,
    image_job,
    parse_size,
    validate_set_lora,
)
from sglang.multimodal_gen.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRAFormatError,
    NotFoundError,
    QueueFullError,
)

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


# ------------------------------------------------------------------------------ body parsing


def test_parse_json_body_errors_have_line_and_column():
    raw = b'{\n  "prompt": "three cats",\n  "size": "1024x1024",\n}'
    with pytest.raises(BodyError) as e:
        parse_json_body(raw, ImageGenerationRequest)
    assert "line 4, column 1" in e.value.message and "trailing comma" in e.value.message
    assert e.value.status_code == 400 and e.value.code == "invalid_json"
    with pytest.raises(BodyError, match="empty"):
        parse_json_body(b"  ", ImageGenerationRequest)
    with pytest.raises(BodyError, match="UTF-8"):
        parse_json_body(b'{"prompt": "\xff"}', ImageGenerationRequest)
    with pytest.raises(SchemaError) as e:
        parse_json_body(b'{"prompt": "x", "n": "two"}', ImageGenerationRequest)
    assert e.value.status_code == 422 and e.value.param == "n"
    assert parse_json_body(b"", SetLoRARequest.__base__, allow_empty=True) is not None


def test_parse_json_body_accepts_nan_literal_for_value_check():
    req = parse_json_body(b'{"prompt": "x", "guidance_scale": NaN}', ImageGenerationRequest)
    with pytest.raises(InvalidRequestError, match="guidance_scale"):
        image_job(req, SPEC)


def test_encode_image_quality_follows_output_compression():
    import io

    import numpy as np
    from PIL import Image
    from sglang.multimodal_gen.outputs import encode_image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    png = encode_image(img, "png", None)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(img))
    for fmt in ("jpeg", "webp"):
        small, large = encode_image(img, fmt, 0), encode_image(img, fmt, 100)
        assert len(small) < len(large)
        assert Image.open(io.BytesIO(small)).format == fmt.upper()


# ------------------------------------------------------------------------------ auth / errors


def test_bearer_and_auth_rules():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    auth = ApiKeyAuth(api_key="k", admin_api_key="adm")
    assert auth.check("/health", None) is None
    assert auth.check("/v1/models", "Bearer k") is None
    assert auth.check("/v1/models", "Bearer adm") is None
    assert auth.check("/v1/models", "Bearer k2") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer k").startswith("this key is not an admin key")
    assert auth.check("/v1/set_lora", "Bearer k2") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer adm") is None
    assert "missing" in auth.check("/v1/models", None)
    open_auth = ApiKeyAuth()
    assert open_auth.check("/v1/set_lora", "Bearer whatever") is None
    admin_only = ApiKeyAuth(admin_api_key="adm")
    assert admin_only.check("/v1/models", None) is None
    assert admin_only.check("/v1/unset_lora", None) is not None


def test_describe_exception_maps_error_types():
    s, body, h = describe_exception(InvalidRequestError("bad n", param="n"))
    assert s == 400 and body["error"] == {
        "message": "bad n",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }
    assert describe_exception(LoRAFormatError("bad file"))[0] == 400
    assert describe_exception(NotFoundError("no adapter"))[0] == 404
    s, body, h = describe_exception(QueueFullError("full", retry_after_s=7))
    assert s == 503 and h == {"Retry-After": "7"} and body["error"]["code"] == "queue_full"
    s, _, h = describe_exception(EngineDeadError("dead"))
    assert s == 503 and h["Retry-After"] == "1"
    assert describe_exception(ValueError("v"))[0] == 400
    assert describe_exception(FileNotFoundError("f"))[0] == 404
    s, body, _ = describe_exception(RuntimeError("secret internals"))
    assert s == 500 and "secret" not in body["error"]["message"]
    assert "ref" in body["error"]["message"]


# ------------------------------------------------------------------------------ server args / CLI


def _parse(argv):
    return ServerArgs.from_cli_args(
        ServerArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    )


def test_seed_command_line_parses(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    argv = f"--model-path {model} --model-type diffusion --dit-cpu-offload false --num-gpus 1 "
    argv += "--port 8080 --host localhost"
    a = _parse(argv.split())
    assert (a.model_path, a.model_type, a.dit_cpu_offload, a.tp_size, a.port, a.host) == (
        str(model), "diffusion", False, 1, 8080, "localhost"
    )  # fmt: skip
    assert _parse(["--model-path", str(model)]).model_type == "diffusion"  # detected
    assert _parse(["--num-gpus", "4", "--tp-size", "2"]).tp_size == 2
    assert _parse(["--num-gpus", "2"]).tp_size == 2
    assert _parse(["--dit-cpu-offload", "true"]).dit_cpu_offload is True


def test_model_type_detected_from_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ValueError, match="no model_index.json"):
        detect_model_type("Owner/Some-Model")
    repo = tmp_path / "hf" / "hub" / "models--Owner--Some-Model"
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "model_index.json").write_text(
        json.dumps({"_class_name": "ZImagePipeline"})
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert detect_model_type("Owner/Some-Model") == "diffusion"
    (repo / "snapshots" / commit / "model_index.json").write_text(
        json.dumps({"_class_name": "LlamaForCausalLM"})
    )
    with pytest.raises(ValueError, match="not a diffusers pipeline"):
        detect_model_type("Owner/Some-Model")


def test_server_args_loras_and_errors(tmp_path):
    a = _parse(["--lora-path", "/x/pixel.safetensors", "/y/style/", "--lora-dir", str(tmp_path)])
    assert a.startup_loras == [("pixel", "/x/pixel.safetensors", 1.0), ("style", "/y/style/", 1.0)]
    assert a.lora_dirs == [str(tmp_path)]
    a = _parse(["--lora-path", "p1", "p2", "--lora-nickname", "a", "b", "--lora-scale", "0.5", "1"])
    assert a.startup_loras == [("a", "p1", 0.5), ("b", "p2", 1.0)]
    with pytest.raises(ValueError, match="--lora-nickname"):
        _parse(["--lora-path", "p1", "p2", "--lora-nickname", "a"])
    with pytest.raises(ValueError, match="--lora-dir"):
        _parse(["--lora-dir", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--tp-size"):
        _parse(["--tp-size", "0"])
    with pytest.raises(ValueError, match="model_index.json"):
        detect_model_type(str(tmp_path))
    assert "***" in str(ServerArgs(api_key="secret").redacted()) and "secret" not in str(
        ServerArgs(api_key="secret").redacted()
    )


def test_cli_help_and_bad_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--model-path" in out.stdout and "--lora-dir" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--tp-size", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--tp-size must be >= 1" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--dit-cpu-offload", "maybe"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "true or false" in out.stderr


# ------------------------------------------------------------------------------ hostile input


def test_parse_json_body_bounds_what_json_allows():
    from sglang.multimodal_gen.errors import PayloadTooLargeError

    deep = b'{"prompt": "x", "lora": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(BodyError) as e:
        parse_json_body(deep, ImageGenerationRequest)
    assert e.value.param == "lora" and "nested more than 32" in e.value.message
    with pytest.raises(BodyError) as e:
        parse_json_body(b'{"prompt": "ok \\ud83d\\ude00 \\udc00"}', ImageGenerationRequest)
    assert e.value.param == "prompt" and "character 5 is a lone UTF-16 surrogate" in e.value.message
    # a paired surrogate escape is an ordinary character
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}', ImageGenerationRequest).prompt == "😀"
    with pytest.raises(BodyError) as e:
        parse_json_body(b'{"prompt": "x", "n": ' + b"7" * 5000 + b"}", ImageGenerationRequest)
    assert e.value.param == "n" and "5000 digits" in e.value.message
    with pytest.raises(PayloadTooLargeError) as e:
        parse_json_body(b" " * ((1 << 20) + 1), ImageGenerationRequest)
    assert e.value.status_code == 413


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

    models = _request_models()
    assert set(models) >= {"ImageGenerationRequest", "VideoGenerationRequest"}
    for name, model in models.items():
        for field in model_field_names(model):
            # the table's words, or (a family's declared field) its annotation's JSON type
            owner = model if field in model.model_fields else LoRASpec
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


def test_server_args_cost_and_connection_flags():
    a = _parse(
        ["--max-n", "2", "--max-steps", "50", "--max-pixel-steps", "0", "--limit-concurrency",
         "16", "--timeout-keep-alive", "3", "--timeout-headers", "4", "--timeout-body", "6",
         "--health-stall-timeout", "0", "--timeout-graceful-shutdown", "7.5"]
    )  # fmt: skip
    assert (a.max_images_per_request, a.max_inference_steps, a.max_pixel_steps) == (2, 50, 0)
    assert (a.limit_concurrency, a.timeout_keep_alive_s, a.timeout_headers_s) == (16, 3, 4)
    assert (a.timeout_body_s, a.health_stall_timeout_s, a.max_image_size) == (6, 0, None)
    assert a.graceful_shutdown_timeout_s == 7.5
    assert _parse([]).graceful_shutdown_timeout_s == 300
    for bad, needle in (
        (["--max-n", "0"], "--max-n"),
        (["--timeout-body", "-1"], "--timeout-body"),
        (["--timeout-graceful-shutdown", "-1"], "--timeout-graceful-shutdown"),
        (["--timeout-graceful-shutdown", "inf"], "--timeout-graceful-shutdown"),
    ):
        with pytest.raises(ValueError, match=needle):
            _parse(bad)


def test_cli_exit_codes_are_shared():
    from sglang.cli.errors import exit_code, one_line
    from sglang.multimodal_gen.errors import NonFiniteOutputError

    for exc in (
        InvalidRequestError("x", param="n"),
        LoRAFormatError("bad file"),
        NotFoundError("no adapter"),
        NonFiniteOutputError("nan"),
        ValueError("--tp-size"),
        FileNotFoundError("no model"),
        UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"),
    ):
        assert exit_code(exc) == 2, exc
    for exc in (
        EngineDeadError("dead"),
        RuntimeError("CUDA error"),
        MemoryError(),
        OSError(28, "disk full"),
    ):
        assert exit_code(exc) == 1, exc
    assert exit_code(KeyboardInterrupt()) == 130
    assert one_line(RuntimeError("boom\nTraceback (most recent call last):\n ...")) == (
        "RuntimeError: boom"
    )


def test_url_image_store_is_bounded_in_bytes_too():
    from sglang.multimodal_gen.entrypoints.images import ImageStore

    store = ImageStore(capacity=10, max_bytes=100)
    names = [store.put(bytes([i]) * 40, "png") for i in range(3)]
    assert store.get(names[0]) is None  # 120 bytes > 100: the oldest went
    assert store.get(names[1])[0] == bytes([1]) * 40 and store.get(names[2]) is not None
    big = store.put(b"x" * 500, "png")  # over the bound alone: kept, the others dropped
    assert store.get(big)[0] == b"x" * 500
    assert all(store.get(n) is None for n in names)
    small = store.put(b"y" * 10, "jpeg")  # the big one goes now
    assert store.get(big) is None and store.get(small) == (b"y" * 10, "image/jpeg")
    expiring = ImageStore(capacity=10, max_bytes=100, ttl_s=0.0)
    old = expiring.put(b"z" * 60, "png")
    assert expiring.get(old) is None  # expired: its bytes are no longer counted
    fresh = expiring.put(b"w" * 60, "png")
    expiring.ttl_s = 3600.0
    assert expiring.get(fresh) == (b"w" * 60, "image/png")  # 60 + 60 would have evicted it
    assert expiring.put(b"v" * 40, "png") and expiring.get(fresh) is not None
    counted = ImageStore(capacity=2)
    first = counted.put(b"a", "png")
    counted.put(b"b", "png")
    counted.put(b"c", "png")
    assert counted.get(first) is None  # the count bound as before


@pytest.mark.parametrize(
    "raw,param",
    [(b'{"prompt": "x", "n": 100, "n": 1}', "n"),
     (b'{"prompt": "x", "lora": {"name": "a", "scale": 1, "scale": 9}}', "scale")],
)  # fmt: skip
def test_a_key_given_twice_is_refused(raw, param):
    """Python's json keeps the last of two equal keys; which one a client meant is a guess."""
    with pytest.raises(BodyError) as e:
        parse_json_body(raw, ImageGenerationRequest)
    assert e.value.param == param and "more than once" in e.value.message
    assert e.value.status_code == 400


def _form(fields: list[tuple[str, str]], boundary: str = "b0undary") -> tuple[bytes, str]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
        for k, v in fields
    ]
    return ("".join(parts) + f"--{boundary}--\r\n").encode(), (
        f"multipart/form-data; boundary={boundary}"
    )


def test_form_bodies_are_typed_by_the_schema():
    import asyncio

    from sglang.multimodal_gen.entrypoints.http_body import parse_form_body
    from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest

    def parse(fields):
        raw, ctype = _form(fields)
        return asyncio.run(parse_form_body(raw, ctype, VideoGenerationRequest))

    req = parse([("prompt", "42"), ("seconds", "4"), ("num_frames", "9"),
                 ("guidance_scale", "3.5"), ("lora", '{"name": "a", "scale": 0.5}')])  # fmt: skip
    assert (req.prompt, req.seconds, req.num_frames, req.guidance_scale) == ("42", "4", 9, 3.5)
    assert req.lora.name == "a" and req.lora.scale == 0.5
    with pytest.raises(SchemaError) as e:
        parse([("prompt", "x"), ("num_frames", "nine")])
    assert e.value.param == "num_frames"
    with pytest.raises(BodyError) as e:
        parse([("prompt", "x"), ("fps", "8"), ("fps", "9")])
    assert e.value.param == "fps" and "more than once" in e.value.message
    with pytest.raises(BodyError) as e:
        asyncio.run(
            parse_form_body(
                b"not multipart", "multipart/form-data; boundary=zz", VideoGenerationRequest
            )
        )
    assert e.value.status_code == 400


def test_error_messages_never_echo_a_whole_body():
    from sglang.multimodal_gen.entrypoints.openai_errors import MAX_MESSAGE_CHARS, error_body

    with pytest.raises(SchemaError) as e:  # an unknown key of 500,000 characters
        parse_json_body(
            json.dumps({"prompt": "x", "k" * 500_000: 1}).encode(), ImageGenerationRequest
        )
    err = error_body(e.value.message, 422, param=e.value.param)["error"]
    assert len(err["message"]) < MAX_MESSAGE_CHARS + 50 and "more characters)" in err["message"]
    assert len(err["param"]) <= 203
    short = error_body("n must be an integer", 400, param="n")["error"]
    assert short["message"] == "n must be an integer" and short["param"] == "n"


def test_form_charset_and_field_names_come_out_safe():
    """A charset= of the client's is not used to decode the fields (punycode's decoder is
    quadratic); a field name that is not valid Unicode is escaped in the error's param."""
    import asyncio

    from sglang.multimodal_gen.entrypoints.http_body import parse_form_body
    from sglang.multimodal_gen.entrypoints.openai_errors import error_body
    from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest

    raw, ctype = _form([("prompt", "xn--caf-dma")])
    req = asyncio.run(parse_form_body(raw, ctype + "; charset=punycode", VideoGenerationRequest))
    assert req.prompt == "xn--caf-dma"  # as sent, not decoded
    for bad in ("multipart/form-data", 'multipart/form-data; boundary="a\x00b"'):
        with pytest.raises(BodyError) as e:
            asyncio.run(parse_form_body(raw, bad, VideoGenerationRequest))
        assert e.value.param == "Content-Type"
    err = error_body("x", 400, param="\ud800")["error"]
    assert err["param"] == "\\ud800"
