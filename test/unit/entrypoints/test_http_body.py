"""Multipart bodies (``entrypoints/http_body.py``, ``parse_form_body``) are parsed strictly: a body
cut short is refused rather than read without its last field, and text that is not UTF-8 is
refused naming the field, as in a JSON body (never read as Latin-1)."""

from __future__ import annotations

import asyncio

import pytest
from sglang.multimodal_gen.entrypoints.http_body import BodyError, parse_form_body
from sglang.multimodal_gen.entrypoints.videos import VideoGenerationRequest

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
