"""Error envelopes (``entrypoints/openai_errors.py``): exception types -> HTTP status, OpenAI error
body and headers; messages bounded and never a whole body."""

from __future__ import annotations

import json

import pytest
from sglang.multimodal_gen.entrypoints.http_body import SchemaError, parse_json_body
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.entrypoints.protocol import ImageGenerationRequest
from sglang.multimodal_gen.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRAFormatError,
    NotFoundError,
    QueueFullError,
)


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
