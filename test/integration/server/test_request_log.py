"""One ``key=value`` log line per HTTP request, with its request id (also the ``X-Request-Id``
answer header), and no prompt, key or LoRA path in any log unless ``--log-prompts`` asks for
prompts and paths (real uvicorn, fake engine)."""

from __future__ import annotations

import logging

import httpx
import pytest
from fixtures.server import FakeEngine, running_server, wait_until, write_lora_file
from sglang.multimodal_gen.configs.server_args import ServerArgs

PROMPT = "a very private prompt about a lighthouse"


@pytest.fixture
def lora_dir(tmp_path):
    write_lora_file(str(tmp_path / "a.safetensors"), seed=1)
    return str(tmp_path)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sglang.request"]


def _wait_lines(caplog, n: int) -> list[str]:
    wait_until(lambda: len(_lines(caplog)) >= n, f"{n} request log lines")
    return _lines(caplog)


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split(" "))


def test_each_request_gets_one_line_and_an_id(caplog, lora_dir):
    caplog.set_level(logging.INFO)
    args = ServerArgs(api_key="user-key", lora_dirs=[lora_dir])
    auth = {"Authorization": "Bearer user-key"}
    with running_server(FakeEngine(lora_dirs=[lora_dir]), args) as (url, _, _):
        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 3, "n": 2, "seed": 1}
        r = httpx.post(f"{url}/v1/images/generations", json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert len(rid) == 32
        mine = {**auth, "X-Request-Id": "trace-7"}
        assert httpx.get(f"{url}/v1/models", headers=mine).headers["x-request-id"] == "trace-7"
        bad = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "no spaces please"})
        assert bad.status_code == 401 and bad.headers["x-request-id"] != "no spaces please"
        lines = _wait_lines(caplog, 3)
    assert len(lines) == 3, lines
    gen, models, refused = (_fields(line) for line in lines)
    assert gen["request_id"] == rid and gen["method"] == "POST"
    assert gen["path"] == "/v1/images/generations" and gen["status"] == "200"
    assert (gen["model"], gen["size"], gen["steps"], gen["n"]) == ("fake-zimage", "64x64", "3", "2")
    assert float(gen["queued_s"]) >= 0 and float(gen["compute_s"]) >= 0
    assert float(gen["total_s"]) >= float(gen["compute_s"])
    assert models["request_id"] == "trace-7" and models["status"] == "200"
    assert "queued_s" not in models and "model" not in models
    assert refused["status"] == "401" and refused["request_id"] == bad.headers["x-request-id"]


def test_no_prompt_key_or_lora_path_in_any_log_unless_asked(caplog, lora_dir):
    caplog.set_level(logging.DEBUG)
    for log_prompts in (False, True):
        caplog.clear()
        args = ServerArgs(
            api_key="user-key-123", admin_api_key="admin-key-456", lora_dirs=[lora_dir],
            log_prompts=log_prompts,
        )  # fmt: skip
        engine = FakeEngine(lora_dirs=[lora_dir])
        user = {"Authorization": "Bearer user-key-123"}
        admin = {"Authorization": "Bearer admin-key-456"}
        with running_server(engine, args) as (url, _, _):
            r = httpx.post(f"{url}/v1/set_lora", headers=admin, timeout=30,
                           json={"lora_nickname": "a", "lora_path": "a.safetensors"})  # fmt: skip
            assert r.status_code == 200, r.text
            body = {"prompt": PROMPT, "negative_prompt": "secret negative", "size": "64x64",
                    "num_inference_steps": 1, "lora": {"name": "a", "strength": 0.5}}  # fmt: skip
            r = httpx.post(f"{url}/v1/images/generations", json=body, headers=user, timeout=30)
            assert r.status_code == 200, r.text
            lines = _wait_lines(caplog, 2)
        everything = "\n".join(r.getMessage() for r in caplog.records)
        assert "key-123" not in everything and "key-456" not in everything
        assert ("lora=a" in lines[0]) and ("lora=a:0.5" in lines[1])
        if log_prompts:
            assert "lora_path=a.safetensors" in lines[0] and f'prompt="{PROMPT}"' in lines[1]
            assert 'negative_prompt="secret negative"' in lines[1]
        else:
            assert "private prompt" not in everything and "secret negative" not in everything
            assert "a.safetensors" not in everything and lora_dir not in everything


def test_log_level_warning_silences_the_lines(caplog):
    caplog.set_level(logging.WARNING)
    with running_server(FakeEngine()) as (url, _, _):
        assert httpx.get(f"{url}/v1/models").status_code == 200
    assert _lines(caplog) == []


def test_successful_probes_are_debug_failing_ones_info(caplog):
    caplog.set_level(logging.INFO)
    engine = FakeEngine()
    with running_server(engine) as (url, _, _):
        for path in ("/health", "/ready", "/metrics"):
            r = httpx.get(url + path)
            assert r.status_code == 200 and r.headers["x-request-id"]
        assert httpx.get(f"{url}/v1/models").status_code == 200
        _wait_lines(caplog, 1)
        engine.alive = False
        assert httpx.get(f"{url}/health").status_code == 503
        lines = _wait_lines(caplog, 2)
    assert [_fields(line)["path"] for line in lines] == ["/v1/models", "/health"]
    assert _fields(lines[1])["status"] == "503"
    debug = [r for r in caplog.records if r.name == "sglang.request" and r.levelno < logging.INFO]
    assert debug == []  # not even created at info
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    with running_server(FakeEngine()) as (url, _, _):
        assert httpx.get(f"{url}/health").status_code == 200
        lines = _wait_lines(caplog, 1)
    assert _fields(lines[0])["path"] == "/health"
