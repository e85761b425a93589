"""The per-request log line (``entrypoints/request_log.py``): one line of ``key=value``, the
request id, and no prompt, LoRA path or key unless asked."""

from __future__ import annotations

import argparse

from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.request_log import (
    RequestRecord,
    format_value,
    lora_summary,
    request_id_from,
)
from sglang.multimodal_gen.entrypoints.scheduler import TaskTiming


def test_the_line_is_key_value_with_the_fields_that_apply():
    record = RequestRecord("abc", "POST", "/v1/images/generations")
    record.note(model="Z-Image", size="64x64", steps=4, n=2, lora=None)
    timing = record.timing()
    timing.queued_at, timing.started_at, timing.finished_at = 10.0, 10.25, 11.0
    line = record.line(200, 1.5)
    assert line == (
        "request_id=abc method=POST path=/v1/images/generations status=200 total_s=1.500 "
        "model=Z-Image size=64x64 steps=4 n=2 queued_s=0.250 compute_s=0.750"
    )
    bare = RequestRecord("r", "GET", "/v1/models").line(401, 0.001)
    assert bare == "request_id=r method=GET path=/v1/models status=401 total_s=0.001"


def test_prompts_and_lora_paths_only_when_asked():
    record = RequestRecord("r", "POST", "/v1/set_lora")
    record.note(lora="a,b", lora_path="/srv/loras/a.safetensors", prompt="secret prompt")
    hidden = record.line(200, 0.1)
    assert "lora=a,b" in hidden and "secret" not in hidden and "/srv/loras" not in hidden
    shown = record.line(200, 0.1, log_prompts=True)
    assert 'prompt="secret prompt"' in shown and "lora_path=/srv/loras/a.safetensors" in shown


def test_a_value_cannot_break_the_line_or_add_fields():
    assert format_value("a b") == '"a b"'
    assert format_value("x\nrequest_id=forged status=200") == ('"x\\nrequest_id=forged status=200"')
    assert "\n" not in format_value("/v1/\r\nx") and format_value("\u00e9") == '"\\u00e9"'
    long = format_value("p" * 5000)
    assert len(long) < 1100 and "(4000 more)" in long
    assert lora_summary(None) is None and lora_summary(()) == "[]"
    assert lora_summary((("a", 0.5), ("b", 1.0))) == "a:0.5,b:1"


def test_request_id_is_the_clients_short_token_else_new():
    assert request_id_from([(b"x-request-id", b"trace-42.a:b_c")]) == "trace-42.a:b_c"
    for given in (b"x" * 65, b"has space", b"new\nline", b"\xff"):
        rid = request_id_from([(b"x-request-id", given)])
        assert len(rid) == 32 and int(rid, 16) >= 0
    twice = [(b"x-request-id", b"a"), (b"X-Request-Id", b"b")]
    assert request_id_from(twice) not in ("a", "b")
    assert request_id_from([]) != request_id_from([])


def test_timing_is_none_until_it_applies():
    t = TaskTiming(queued_at=1.0)
    assert t.queued_s is None and t.compute_s is None
    t.started_at = 3.0
    assert t.queued_s == 2.0 and t.compute_s is None


def test_log_flags():
    parser = ServerArgs.add_cli_args(argparse.ArgumentParser())
    args = ServerArgs.from_cli_args(parser.parse_args([]))
    assert args.log_level == "info" and args.log_prompts is False
    args = ServerArgs.from_cli_args(parser.parse_args(["--log-prompts", "--log-level", "warning"]))
    assert args.log_prompts is True and args.log_level == "warning"
