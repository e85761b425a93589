"""Request bodies (``entrypoints/http_body.py``): JSON and multipart form bodies parsed against the
request schema; malformed, hostile or oversized input is a 4xx naming what is wrong."""

from __future__ import annotations

import asyncio

import pytest
from sglang.multimodal_gen.entrypoints.http_body import (
    BodyError,
    SchemaError,
    parse_form_body,
    parse_json_body,
)
from sglang.multimodal_gen.entrypoints.protocol import ImageGenerationRequest, SetLoRARequest
from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest


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


# ------------------------------------------------------------ multipart parsed strictly

BOUNDARY = "b0undary"
CTYPE = f"multipart/form-data; boundary={BOUNDARY}"


def _part(name: bytes, value: bytes) -> bytes:
    return (
        b"--" + BOUNDARY.encode() + b'\r\nContent-Disposition: form-data; name="' + name
        + b'"\r\n\r\n' + value + b"\r\n"
    )  # fmt: skip


def _close() -> bytes:
    return b"--" + BOUNDARY.encode() + b"--\r\n"


def parse(raw: bytes, ctype: str = CTYPE):
    return asyncio.run(parse_form_body(raw, ctype, VideoGenerationRequest))


def test_a_complete_body_parses():
    req = parse(_part(b"prompt", "café".encode()) + _part(b"num_frames", b"9") + _close())
    assert (req.prompt, req.num_frames) == ("café", 9)
    # no line break after the close delimiter, or a few: the same body
    assert parse(_part(b"prompt", b"x") + _close().rstrip()).prompt == "x"
    assert parse(_part(b"prompt", b"x") + _close() + b"\r\n").prompt == "x"


@pytest.mark.parametrize(
    "tail",
    [
        b"",  # the close delimiter never came
        b"--" + BOUNDARY.encode(),  # cut inside it
        b"--" + BOUNDARY.encode() + b"-",
    ],
)
def test_a_body_cut_short_is_refused_not_read_without_its_last_field(tail):
    body = _part(b"prompt", b"x") + _part(b"num_frames", b"9")
    with pytest.raises(BodyError) as e:
        parse(body + tail)
    assert e.value.status_code == 400 and e.value.code == "invalid_form"
    assert "does not end with its closing boundary" in e.value.message


def test_nothing_may_follow_the_closing_boundary():
    body = _part(b"prompt", b"x") + _close() + _part(b"num_frames", b"9") + _close()
    with pytest.raises(BodyError) as e:
        parse(body)
    assert "after its closing boundary" in e.value.message


def test_a_value_that_is_not_utf8_is_refused_naming_the_field():
    body = _part(b"prompt", b"ok") + _part(b"negative_prompt", b"caf\xe9") + _close()
    with pytest.raises(BodyError) as e:
        parse(body)
    assert e.value.status_code == 400 and e.value.param == "negative_prompt"
    assert "not valid UTF-8" in e.value.message
    # a charset= of the client's changes nothing: UTF-8 or refused
    with pytest.raises(BodyError):
        parse(body, CTYPE + "; charset=latin-1")


def test_a_field_name_that_is_not_utf8_is_refused():
    with pytest.raises(BodyError) as e:
        parse(_part(b"prompt", b"x") + _part(b"pr\xffompt", b"y") + _close())
    assert e.value.status_code == 400 and "not valid UTF-8" in e.value.message
    assert "\\xff" in e.value.message  # shown escaped


def test_too_many_fields_and_parts_without_a_name():
    body = b"".join(_part(f"f{i}".encode(), b"1") for i in range(65)) + _close()
    with pytest.raises(BodyError, match="more than 64 fields"):
        parse(body)
    nameless = (
        b"--" + BOUNDARY.encode() + b"\r\nContent-Disposition: form-data\r\n\r\nx\r\n" + _close()
    )
    with pytest.raises(BodyError, match="no name"):
        parse(nameless)


def test_nested_extra_body_values_arrive_as_the_openai_client_spells_them():
    """The ``openai`` client sends a nested ``extra_body`` value of a multipart request with
    bracketed names (its own serializer makes them here): ``lora`` as a list of objects, or one
    object, reaches the schema as the JSON value it stands for."""
    import openai
    from sglang.multimodal_gen.entrypoints.http_body import parse_form_with_files
    from sglang.multimodal_gen.entrypoints.protocol import ImageEditRequest

    client = openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    for lora, expected in (
        ([{"name": "a", "strength": 0.5}, {"name": "b", "strength": 2}],
         [("a", 0.5), ("b", 2.0)]),
        ({"name": "a", "strength": 0.25}, [("a", 0.25)]),
    ):  # fmt: skip
        # the client's own multipart serializer: every key's values together, in key order
        data = client._serialize_multipartform({"prompt": "p", "seed": 3, "lora": lora})
        items = [(k, x) for k, v in data.items() for x in (v if isinstance(v, list) else [v])]
        body, ctype = _form([(k, str(v)) for k, v in items])
        req, files = parse_form_with_files(
            body, ctype, ImageEditRequest, {"image": True, "mask": False}, limit=1 << 20
        )
        specs = req.lora if isinstance(req.lora, list) else [req.lora]
        assert [s.as_pair() for s in specs] == expected and req.seed == 3 and files == {}
    # a name spelt both ways is refused naming it
    body, ctype = _form([("lora", '[{"name": "a"}]'), ("lora[][name]", "b")])
    with pytest.raises(BodyError) as e:
        parse_form_with_files(body, ctype, ImageEditRequest, {"image": True}, limit=1 << 20)
    assert e.value.param == "lora"
