"""A request naming an adapter that will not be loaded when it runs is refused before a job or a
queue entry exists (404 naming ``lora``, as the image route); LoRA commands queued ahead of it
count (a queued ``set_lora`` loads its adapters, a queued ``unload_lora`` frees one), so the
check never races with them (real uvicorn, fake video and image engines)."""

from __future__ import annotations

import threading

import httpx
import pytest
from fixtures.server import (
    FakeEngine,
    FakeVideoEngine,
    assert_envelope,
    running_server,
    wait_until,
    write_lora_file,
)
from sglang.multimodal_gen.configs.server_args import ServerArgs

VIDEO = {"prompt": "a paper boat", "num_inference_steps": 1}


@pytest.fixture
def lora_dir(tmp_path):
    write_lora_file(str(tmp_path / "a.safetensors"), seed=1)
    write_lora_file(str(tmp_path / "b.safetensors"), seed=2)
    return str(tmp_path)


def _jobs(url) -> list[dict]:
    return httpx.get(f"{url}/v1/videos").json()["data"]


def test_a_video_naming_an_unloaded_adapter_creates_no_job(lora_dir):
    engine = FakeVideoEngine(lora_dirs=[lora_dir])
    with running_server(engine, ServerArgs(lora_dirs=[lora_dir])) as (url, app, _):
        body = dict(VIDEO, lora=[{"name": "nope", "strength": 1.0}])
        err = assert_envelope(httpx.post(f"{url}/v1/videos", json=body), 404, param="lora")
        assert "'nope' is not loaded" in err["message"]
        assert _jobs(url) == [] and engine.calls == []
        assert app.state.scheduler.queue_depth == 0


def test_the_image_route_refuses_before_queueing(lora_dir):
    engine = FakeEngine(lora_dirs=[lora_dir])
    with running_server(engine, ServerArgs(lora_dirs=[lora_dir])) as (url, _, _):
        body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1,
                "lora": {"name": "nope", "strength": 1.0}}  # fmt: skip
        r = httpx.post(f"{url}/v1/images/generations", json=body)
        assert_envelope(r, 404, param="lora")
        assert engine.calls == []  # never reached the engine


def test_queued_lora_commands_count_for_the_requests_behind_them(lora_dir):
    engine = FakeVideoEngine(lora_dirs=[lora_dir])
    with running_server(engine, ServerArgs(lora_dirs=[lora_dir])) as (url, app, _):
        ledger = app.state.scheduler.adapters
        r = httpx.post(
            f"{url}/v1/set_lora", json={"lora_nickname": "a", "lora_path": "a.safetensors"}
        )
        assert r.status_code == 200, r.text
        engine.release.clear()  # the next generation holds the engine
        blocker = httpx.post(f"{url}/v1/videos", json=VIDEO).json()["id"]
        wait_until(lambda: "generate" in engine.calls, "the blocking job did not start")
        answers = {}

        def admin(name, path, body):
            answers[name] = httpx.post(f"{url}{path}", json=body, timeout=60)

        calls = [
            threading.Thread(target=admin, args=("set", "/v1/set_lora",
                             {"lora_nickname": "b", "lora_path": "b.safetensors"})),
            threading.Thread(target=admin, args=("unload", "/v1/unload_lora",
                             {"lora_nickname": "a"})),
        ]  # fmt: skip
        calls[0].start()
        wait_until(lambda: "b" in ledger.view(), "set_lora b was not queued")
        calls[1].start()
        wait_until(lambda: "a" not in ledger.view(), "unload_lora a was not queued")
        assert "b" not in engine.loaded and "a" in engine.loaded  # neither has run yet
        # b: loaded by the set_lora queued ahead, accepted although not loaded now
        with_b = httpx.post(f"{url}/v1/videos", json=dict(VIDEO, lora=[{"name": "b"}]))
        assert with_b.status_code == 200, with_b.text
        # a: loaded now, but the unload queued ahead frees it before this would run
        with_a = httpx.post(f"{url}/v1/videos", json=dict(VIDEO, lora=[{"name": "a"}]))
        assert_envelope(with_a, 404, param="lora")
        assert {j["id"] for j in _jobs(url)} == {blocker, with_b.json()["id"]}
        engine.release.set()
        for t in calls:
            t.join(timeout=60)
        assert answers["set"].status_code == 200 and answers["unload"].status_code == 200
        job = with_b.json()["id"]
        wait_until(
            lambda: httpx.get(f"{url}/v1/videos/{job}").json()["status"] == "completed",
            "the job with b did not complete",
        )
        assert [n for n, _, _ in engine.generate_log[-1][1]] == ["b"]
        assert ledger.view() == {"b"} == set(engine.loaded)
