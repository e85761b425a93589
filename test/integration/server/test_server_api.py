"""HTTP API tests on real uvicorn with a fake engine (fast; every row of server_requests.md).

The fake engine (``fixtures.server.FakeEngine``) makes each image a pure function of the request and
of the adapter composition it ran with, so a response image tells which composition was used. LoRA
files go through the project's real loader (path containment, Hub cache lookups).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from fixtures.server import (
    FAKE_SPEC,
    FakeEngine,
    assert_envelope,
    fake_params,
    fake_reference_image,
    free_port,
    running_server,
    wait_not_accepting,
    wait_until,
    write_lora_file,
)
from PIL import Image
from sglang.multimodal_gen.configs.server_args import ServerArgs


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    write_lora_file(str(root / "a.safetensors"), seed=1)
    write_lora_file(str(root / "b.safetensors"), seed=2)
    peft = root / "peft_c"
    write_lora_file(str(peft / "adapter_model.safetensors"), seed=3)
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    return str(root)


@pytest.fixture
def engine(lora_dir):
    return FakeEngine(lora_dirs=[lora_dir])


@pytest.fixture
def server(engine, lora_dir):
    with running_server(engine, ServerArgs(lora_dirs=[lora_dir])) as (url, app, _):
        yield url


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def expected(engine: FakeEngine, comp_names, index=0, **fields) -> np.ndarray:
    req = fake_params(**fields)
    comp = engine.composition_of(comp_names)
    return np.asarray(fake_reference_image(req, comp, index))


def gen(url, **body):
    body.setdefault("prompt", "a red fox")
    body.setdefault("size", "64x64")
    body.setdefault("num_inference_steps", 2)
    body.setdefault("seed", 7)
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=30)


def list_loras(url, headers=None):
    r = httpx.get(f"{url}/v1/list_loras", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------ OpenAI client


def test_openai_client_png_equals_engine_output(server, engine):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-unused", max_retries=0)
    resp = client.images.generate(
        model="fake-zimage",
        prompt="a lighthouse at dusk",
        size="64x64",
        response_format="b64_json",
        n=2,
        extra_body={"seed": 42, "num_inference_steps": 2, "guidance_scale": 1.5},
    )
    assert len(resp.data) == 2
    raw = base64.b64decode(resp.data[0].b64_json)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    fields = dict(
        prompt="a lighthouse at dusk",
        height=64,
        width=64,
        seed=42,
        num_inference_steps=2,
        guidance_scale=1.5,
        num_outputs_per_prompt=2,
    )
    for i, item in enumerate(resp.data):
        got = np.asarray(decode(item.b64_json).convert("RGB"))
        np.testing.assert_array_equal(got, expected(engine, [], index=i, **fields))
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-zimage"]
    assert client.models.retrieve("fake-zimage").id == "fake-zimage"  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_unknown_route_is_404_without_echoing_a_huge_path(server):
    r = httpx.get(f"{server}/v1/" + "x" * 50_000)
    err = assert_envelope(r, 404)
    assert err["message"].startswith("no route GET /v1/xxx") and len(err["message"]) < 300


def test_output_formats(server):
    for fmt, magic in (("jpeg", b"\xff\xd8"), ("webp", b"RIFF")):
        r = gen(server, output_format=fmt, output_compression=80)
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"])[: len(magic)] == magic
        assert r.json()["output_format"] == fmt
    assert_envelope(gen(server, output_format="gif"), 400, "output_format")
    assert_envelope(gen(server, output_compression=101), 400, "output_compression")


# ------------------------------------------------------------------------------ S1 invalid JSON


@pytest.mark.parametrize(
    "raw",
    [
        # backtick continuations left in the body, last field with a trailing comma
        '{ `\n  "prompt": "three cats ...", `\n  "size": "1024x1024", `\n}',
        # the shell ate the backticks: one line, trailing comma
        '{ "prompt": "three cats ...",   "size": "1024x1024", }',
    ],
)
def test_s1_invalid_json_400_with_line_and_column(server, engine, raw):
    r = httpx.post(
        f"{server}/v1/images/generations",
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
    )
    err = assert_envelope(r, 400)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"
    msg = err["message"]
    assert "invalid JSON" in msg and "line" in msg and "column" in msg, msg
    if "`" in raw:
        assert "line 1, column 3" in msg and "backtick" in msg, msg
    else:
        assert "trailing comma" in msg, msg
    assert engine.calls == []


def test_schema_errors_are_422(server, engine):
    err = assert_envelope(gen(server, n="many"), 422, "n")
    assert "n must be an integer, got the string 'many'" in err["message"], err["message"]
    err = assert_envelope(gen(server, num_inference_step=3), 422, "num_inference_step")
    assert "unknown field" in err["message"]
    r = httpx.post(f"{server}/v1/images/generations", json=["prompt"])
    assert_envelope(r, 422)
    r = httpx.post(f"{server}/v1/images/generations", json={"size": "64x64"})
    assert_envelope(r, 422, "prompt")
    assert engine.calls == []


def test_engine_failure_is_500_without_internals_and_server_continues(server, engine, caplog):
    r = gen(server, prompt="raise internal error")
    err = assert_envelope(r, 500)
    assert "secret" not in r.text and "/opt/model.py" not in r.text
    assert "ref " in err["message"]
    assert gen(server).status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200


def test_unknown_route_and_method(server):
    assert_envelope(httpx.get(f"{server}/v1/nope"), 404)
    assert_envelope(httpx.get(f"{server}/v1/images/generations"), 405)


def test_unknown_model_404(server, engine):
    err = assert_envelope(gen(server, model="dall-e-3"), 404, "model")
    assert "fake-zimage" in err["message"]
    assert engine.calls == []


# ------------------------------------------------------------------------------ S2 / S3 auth


def test_s2_bearer_ignored_without_api_key(server):
    r = httpx.post(
        f"{server}/v1/images/generations",
        json={"prompt": "x", "size": "64x64", "num_inference_steps": 1},
        headers={"Authorization": "Bearer sk-proj-1234567890"},
    )
    assert r.status_code == 200, r.text


def test_s3_wrong_key_401_and_no_work(engine, lora_dir):
    args = ServerArgs(api_key="other-key", lora_dirs=[lora_dir])
    with running_server(engine, args) as (url, _, _):
        bad = {"Authorization": "Bearer sk-proj-1234567890"}
        for method, path in (
            ("POST", "/v1/images/generations"),
            ("POST", "/v1/set_lora"),
            ("POST", "/v1/unset_lora"),
            ("GET", "/v1/list_loras"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
        ):
            body = {"prompt": "x", "size": "64x64"} if method == "POST" else None
            for headers in (bad, {}, {"Authorization": "Basic b3RoZXIta2V5"}):
                r = httpx.request(method, url + path, json=body, headers=headers)
                err = assert_envelope(r, 401)
                assert err["type"] in ("invalid_request_error", "authentication_error")
                assert r.headers["www-authenticate"] == "Bearer"
        assert engine.calls == []
        assert httpx.get(f"{url}/health").status_code == 200
        good = {"Authorization": "Bearer other-key"}
        r = httpx.post(
            f"{url}/v1/images/generations",
            json={"prompt": "x", "size": "64x64", "num_inference_steps": 1},
            headers=good,
        )
        assert r.status_code == 200
        assert engine.calls == ["generate"]


def test_admin_api_key(engine, lora_dir):
    args = ServerArgs(api_key="user-key", admin_api_key="admin-key", lora_dirs=[lora_dir])
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    with running_server(engine, args) as (url, _, _):
        body = {"lora_nickname": "a", "lora_path": "a.safetensors"}
        err = assert_envelope(httpx.post(f"{url}/v1/set_lora", json=body, headers=user), 403)
        assert err["code"] == "insufficient_permissions" and "not an admin key" in err["message"]
        assert engine.loaded == {}
        r = httpx.post(f"{url}/v1/set_lora", json=body, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "ok"
        # list_loras and generation take either key
        assert "a" in list_loras(url, user)["loaded"]
        assert "a" in list_loras(url, admin)["loaded"]
        assert_envelope(httpx.post(f"{url}/v1/unset_lora", headers=user), 403)
        assert httpx.post(f"{url}/v1/unset_lora", headers=admin).status_code == 200


# ------------------------------------------------------------------------------ S4 / S5 Hub ids


def test_s4_repo_id_not_cached_4xx_nothing_changed(server, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = httpx.post(
        f"{server}/v1/set_lora", json={"lora_nickname": "a", "lora_path": "a.safetensors"}
    )
    assert r.status_code == 200
    before = list_loras(server)
    body = {"lora_nickname": "lora_name", "lora_path": "Owner/Some-LoRA-Repo", "target": "all"}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=30)
    assert 400 <= r.status_code < 500
    err = assert_envelope(r, r.status_code)
    msg = err["message"].lower()
    assert "could not be found locally" in msg and "download" in msg, msg
    assert list_loras(server) == before
    assert engine.active == [("a", 1.0)]


def test_s5_repo_id_from_local_hf_cache(server, engine, tmp_path, monkeypatch):
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = hf_home / "hub" / "models--Owner--Some-LoRA-Repo"
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_lora_file(str(repo / "snapshots" / commit / "pytorch_lora_weights.safetensors"), seed=5)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    body = {"lora_nickname": "lora_name", "lora_path": "Owner/Some-LoRA-Repo", "target": "all"}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert "lora_name" in list_loras(server)["loaded"]
    r = gen(server)
    assert r.status_code == 200
    got = np.asarray(decode(r.json()["data"][0]["b64_json"]).convert("RGB"))
    ref = expected(
        engine, [("lora_name", 1.0)], prompt="a red fox", height=64, width=64,
        num_inference_steps=2, seed=7,
    )  # fmt: skip
    np.testing.assert_array_equal(got, ref)


def test_lora_path_outside_lora_dir_refused(server, engine, tmp_path):
    outside = write_lora_file(str(tmp_path / "evil.safetensors"), seed=9)
    for path in (outside, "../" * 10 + outside.lstrip("/")):
        r = httpx.post(f"{server}/v1/set_lora", json={"lora_nickname": "e", "lora_path": path})
        err = assert_envelope(r, 400, "lora_path")
        assert "outside" in err["message"]
    assert engine.loaded == {}


# ------------------------------------------------------------------------------ S6 / S7 values


@pytest.mark.parametrize(
    "size", ["64", "64x", "sixtyfour", "64x64x64", "100x100", "64x72", "4096x4096", "0x0"]
)
def test_s6_bad_size(server, engine, size):
    err = assert_envelope(gen(server, size=size), 400, "size")
    assert "WxH" in err["message"] and "16" in err["message"], err["message"]
    assert engine.calls == []


def test_s6_size_above_configured_max(engine):
    with running_server(engine, ServerArgs(max_image_size=128)) as (url, _, _):
        err = assert_envelope(gen(url, size="256x256"), 400, "size")
        assert "128" in err["message"]
        assert gen(url, size="128x64").status_code == 200


@pytest.mark.parametrize(
    "field,value,range_text",
    [
        ("n", 0, "[1, 8]"),
        ("n", 1000, "[1, 8]"),
        ("num_inference_steps", 0, "[1, 1000]"),
        ("num_inference_steps", 10000, "[1, 1000]"),
        ("guidance_scale", float("nan"), ">= 0"),
        ("guidance_scale", float("inf"), ">= 0"),
        ("guidance_scale", -1.0, ">= 0"),
        ("seed", -3, "[0, "),
    ],
)
def test_s7_out_of_range(server, engine, field, value, range_text):
    body = {"prompt": "x", "size": "64x64", field: value}
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals, as some clients send
    r = httpx.post(f"{server}/v1/images/generations", content=raw.encode())
    err = assert_envelope(r, 400, field)
    assert field in err["message"] and range_text in err["message"], err["message"]
    assert engine.calls == []


# ------------------------------------------------------------------------------ S8 url


def test_s8_response_format_url_serves_the_image(engine):
    with running_server(engine, ServerArgs(api_key="k")) as (url, _, _):
        h = {"Authorization": "Bearer k"}
        body = {"prompt": "x", "size": "64x64", "seed": 3, "num_inference_steps": 1}
        r = httpx.post(
            f"{url}/v1/images/generations", json={**body, "response_format": "url"}, headers=h
        )
        assert r.status_code == 200, r.text
        image_url = r.json()["data"][0]["url"]
        assert image_url.startswith(url + "/v1/images/files/")
        assert httpx.get(image_url).status_code == 401  # same auth as every endpoint
        got = httpx.get(image_url, headers=h)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        r2 = httpx.post(f"{url}/v1/images/generations", json=body, headers=h)
        assert got.content == base64.b64decode(r2.json()["data"][0]["b64_json"])
        assert_envelope(httpx.get(url + "/v1/images/files/nope.png", headers=h), 404)
        err = assert_envelope(
            httpx.post(
                f"{url}/v1/images/generations", json={**body, "response_format": "file"}, headers=h
            ),
            400,
            "response_format",
        )
        assert "b64_json" in err["message"]


# ------------------------------------------------------------------------------ LoRA endpoints


def test_lora_endpoints_and_per_request_lora(server, engine, lora_dir):
    base = gen(server).json()["data"][0]["b64_json"]
    r = httpx.post(
        f"{server}/v1/set_lora", json={"lora_nickname": "a", "lora_path": "a.safetensors"}
    )
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    with_a = gen(server).json()["data"][0]["b64_json"]
    assert with_a != base
    ref = expected(
        engine, [("a", 1.0)], prompt="a red fox", height=64, width=64, num_inference_steps=2, seed=7
    )
    np.testing.assert_array_equal(np.asarray(decode(with_a).convert("RGB")), ref)
    # PEFT folder, then a list of two with strengths
    r = httpx.post(f"{server}/v1/set_lora", json={"lora_nickname": "c", "lora_path": "peft_c"})
    assert r.status_code == 200, r.text
    body = {
        "lora_nickname": ["a", "b"],
        "lora_path": [None, "b.safetensors"],
        "strength": [0.5, 0.8],
    }
    r = httpx.post(f"{server}/v1/set_lora", json=body)
    assert r.status_code == 200, r.text
    listed = list_loras(server)
    assert set(listed["loaded"]) == {"a", "b", "c"}
    assert listed["active"]["all"] == [
        {"name": "a", "strength": 0.5},
        {"name": "b", "strength": 0.8},
    ]
    # per-request lora overrides the global composition, exactly
    r = gen(server, lora={"name": "c", "scale": 0.3})
    ref = expected(
        engine, [("c", 0.3)], prompt="a red fox", height=64, width=64, num_inference_steps=2, seed=7
    )
    np.testing.assert_array_equal(
        np.asarray(decode(r.json()["data"][0]["b64_json"]).convert("RGB")), ref
    )
    r = gen(server, lora=[])  # explicit: no adapter
    assert r.json()["data"][0]["b64_json"] == base
    # unknown per-request adapter: 404, duplicate: 400
    assert_envelope(gen(server, lora={"name": "zzz"}), 404)
    assert_envelope(gen(server, lora=[{"name": "a"}, {"name": "a"}]), 400, "lora")
    # unset returns the base image exactly; adapters stay loaded
    assert httpx.post(f"{server}/v1/unset_lora", json={"target": "all"}).status_code == 200
    assert gen(server).json()["data"][0]["b64_json"] == base
    assert set(list_loras(server)["loaded"]) == {"a", "b", "c"}
    # merge / unmerge
    assert httpx.post(f"{server}/v1/merge_lora_weights", json={}).status_code == 200
    assert engine.merged
    assert httpx.post(f"{server}/v1/unmerge_lora_weights").status_code == 200
    assert not engine.merged
    # unload one; unloading it again is a 404; set_lora with null path for it too
    assert httpx.post(f"{server}/v1/unload_lora", json={"lora_nickname": "b"}).status_code == 200
    assert "b" not in list_loras(server)["loaded"]
    assert_envelope(httpx.post(f"{server}/v1/unload_lora", json={"lora_nickname": "b"}), 404)
    assert_envelope(httpx.post(f"{server}/v1/set_lora", json={"lora_nickname": "b"}), 404)


# ------------------------------------------------------------------------------ S9 / S10


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({"lora_nickname": ["a", "b"], "lora_path": ["a.safetensors"] * 3}, "lora_path", "3 entries"),
        ({"lora_nickname": ["a", "b"], "lora_path": ["a.safetensors", "b.safetensors"], "strength": [1.0, 2.0, 3.0]},
         "strength", "lora_nickname has 2"),
        ({"lora_nickname": ["a", "b"], "lora_path": []}, "lora_path", "0 entries"),
        ({"lora_nickname": ["a", "a"], "lora_path": ["a.safetensors", "a.safetensors"]}, "lora_nickname", "twice"),
        ({"lora_nickname": "a", "lora_path": "a.safetensors", "strength": float("nan")}, "strength", "finite"),
        ({"lora_nickname": "a", "lora_path": "a.safetensors", "merge_mode": "fast"}, "merge_mode", "auto"),
    ],
)  # fmt: skip
def test_s9_set_lora_mismatch_400_nothing_changed(server, engine, body, param, needle):
    r = httpx.post(
        f"{server}/v1/set_lora", json={"lora_nickname": "b", "lora_path": "b.safetensors"}
    )
    assert r.status_code == 200
    before = list_loras(server)
    r = httpx.post(f"{server}/v1/set_lora", content=json.dumps(body, allow_nan=True).encode())
    err = assert_envelope(r, 400, param)
    assert needle in err["message"], err["message"]
    assert list_loras(server) == before
    assert engine.calls.count("set_lora") == 1


def test_s10_unknown_target_lists_valid_targets(server, engine):
    for path, body in (
        (
            "/v1/set_lora",
            {"lora_nickname": "a", "lora_path": "a.safetensors", "target": "transformer_2"},
        ),
        ("/v1/unset_lora", {"target": "transformer_2"}),
        ("/v1/merge_lora_weights", {"target": "transformer_2"}),
        ("/v1/unmerge_lora_weights", {"target": "transformer_2"}),
    ):
        err = assert_envelope(httpx.post(server + path, json=body), 400, "target")
        assert "'all'" in err["message"] and "'transformer'" in err["message"], err["message"]
    assert engine.calls == []


# ------------------------------------------------------------------------------ S11 concurrency


def test_s11_concurrent_generations_with_alternating_set_unset(lora_dir):
    engine = FakeEngine(delay_s=0.01, lora_dirs=[lora_dir])
    with running_server(engine, ServerArgs(lora_dirs=[lora_dir], max_queue_size=64)) as (url, _, _):
        assert (
            httpx.post(
                f"{url}/v1/set_lora", json={"lora_nickname": "b", "lora_path": "b.safetensors"}
            ).status_code
            == 200
        )
        assert httpx.post(f"{url}/v1/unset_lora").status_code == 200
        stop = threading.Event()
        admin_codes = []

        def admin_loop():
            i = 0
            while not stop.is_set():
                if i % 2 == 0:
                    r = httpx.post(
                        f"{url}/v1/set_lora",
                        json={"lora_nickname": "a", "lora_path": "a.safetensors"},
                        timeout=30,
                    )
                else:
                    r = httpx.post(f"{url}/v1/unset_lora", timeout=30)
                admin_codes.append(r.status_code)
                i += 1
                time.sleep(0.005)

        def one(i):
            body = {"prompt": f"p{i}", "size": "32x32", "seed": i, "num_inference_steps": 2}
            if i % 4 == 3:
                body["lora"] = [{"name": "b", "scale": 0.7}]
            r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=60)
            return i, body, r

        admin = threading.Thread(target=admin_loop)
        admin.start()
        with ThreadPoolExecutor(max_workers=32) as pool:
            results = list(pool.map(one, range(32)))
        stop.set()
        admin.join(timeout=30)
        assert admin_codes and set(admin_codes) == {200}
        seen_global = set()
        for i, body, r in results:
            assert r.status_code == 200, r.text
            got = np.asarray(decode(r.json()["data"][0]["b64_json"]).convert("RGB"))
            fields = dict(prompt=body["prompt"], height=32, width=32, seed=i, num_inference_steps=2)
            if "lora" in body:
                allowed = [[("b", 0.7)]]
            else:
                allowed = [[], [("a", 1.0)]]
            matches = [c for c in allowed if np.array_equal(got, expected(engine, c, **fields))]
            assert len(matches) == 1, (i, body)
            if "lora" not in body:
                seen_global.add(tuple(matches[0]))
        # the engine log shows no call ever overlapped (FakeEngine asserts) and every image
        # matches its own composition; admin changes really interleaved:
        assert engine.calls.count("set_lora") >= 2


# ------------------------------------------------------------------------------ S12 queue full


def test_s12_queue_full_503_retry_after_and_keeps_serving(lora_dir):
    engine = FakeEngine(lora_dirs=[lora_dir])
    engine.release.clear()  # block generate until released
    with running_server(engine, ServerArgs(max_queue_size=2)) as (url, app, _):
        scheduler = app.state.scheduler
        with ThreadPoolExecutor(max_workers=3) as pool:
            try:
                futures = [pool.submit(gen, url, seed=0)]
                wait_until(lambda: scheduler.busy, "first request did not start")
                futures += [pool.submit(gen, url, seed=i) for i in (1, 2)]
                wait_until(lambda: scheduler.queue_depth == 2, "queue did not fill")
                r = gen(url, seed=99)
                err = assert_envelope(r, 503)
                assert err["code"] == "queue_full"
                assert int(r.headers["retry-after"]) >= 1
                metrics = httpx.get(f"{url}/metrics").text
                assert "sglang_queue_depth 2.0" in metrics
            finally:
                engine.release.set()
            assert [f.result().status_code for f in futures] == [200, 200, 200]
        assert gen(url, seed=100).status_code == 200
        assert len(engine.generate_log) == 4


# ------------------------------------------------------------------------------ health, metrics, shutdown


def test_disconnected_client_queued_request_is_dropped():
    engine = FakeEngine()
    engine.release.clear()
    with running_server(engine, ServerArgs()) as (url, app, _):
        scheduler = app.state.scheduler
        with ThreadPoolExecutor(max_workers=1) as pool:
            try:
                first = pool.submit(gen, url, seed=1)
                wait_until(lambda: scheduler.busy, "first request did not start")
                # a client that goes away once its request is queued (not on a client-side
                # timeout, which a loaded server can outlast before it even queued the request)
                body = json.dumps({"prompt": "gone", "size": "32x32", "num_inference_steps": 1})
                host, port = url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall(
                        (
                            "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
                            "Content-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n{body}"
                        ).encode()
                    )
                    wait_until(lambda: scheduler.queue_depth == 1, "request not queued")
                wait_until(  # dropped from the queue once noticed
                    lambda: scheduler.queue_depth == 0, "queued request of a gone client kept", 10
                )
            finally:
                engine.release.set()
            assert first.result().status_code == 200
        assert gen(url, seed=2).status_code == 200
        prompts = [req.prompt for req, _ in engine.generate_log]
        assert "gone" not in prompts and len(prompts) == 2
        text = httpx.get(f"{url}/metrics").text
        assert 'endpoint="/v1/images/generations",status="499"' in text


def test_metrics_content(server):
    assert gen(server).status_code == 200
    assert gen(server, n=0).status_code == 400
    assert (
        httpx.post(
            f"{server}/v1/set_lora", json={"lora_nickname": "a", "lora_path": "a.safetensors"}
        ).status_code
        == 200
    )
    text = httpx.get(f"{server}/metrics").text
    for needle in (
        'sglang_http_requests_total{endpoint="/v1/images/generations",status="200"} 1.0',
        'sglang_http_requests_total{endpoint="/v1/images/generations",status="400"} 1.0',
        "sglang_queue_depth",
        "sglang_request_e2e_seconds_count 1.0",
        "sglang_step_seconds_count 1.0",
        'sglang_lora_admin_seconds_count{op="set_lora"} 1.0',
        "sglang_engine_alive 1.0",
    ):
        assert needle in text, needle


def test_dead_engine_health_503_and_requests_503(lora_dir):
    engine = FakeEngine()
    engine.release.clear()
    with running_server(engine, ServerArgs()) as (url, _, _):
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        with ThreadPoolExecutor(max_workers=1) as pool:
            inflight = pool.submit(gen, url)
            wait_until(lambda: "generate" in engine.calls, "the request did not reach the engine")
            engine.alive = False  # a worker died while a request runs (and never returns)
            t0 = time.monotonic()
            r = inflight.result(timeout=20)
            assert_envelope(r, 503)
            assert time.monotonic() - t0 < 10
            engine.release.set()
        assert_envelope(httpx.get(f"{url}/health"), 503)
        t0 = time.monotonic()
        assert_envelope(gen(url), 503)
        assert time.monotonic() - t0 < 2
        assert "sglang_engine_alive 0.0" in httpx.get(f"{url}/metrics").text


def test_graceful_shutdown_finishes_in_flight(lora_dir):
    engine = FakeEngine()
    engine.release.clear()
    with running_server(engine, ServerArgs()) as (url, app, server):
        with ThreadPoolExecutor(max_workers=1) as pool:
            inflight = pool.submit(gen, url)
            wait_until(lambda: app.state.scheduler.busy, "the request did not start")
            server.should_exit = True  # what SIGTERM does
            wait_not_accepting(url)  # the listener closes
            assert not inflight.done()
            engine.release.set()
            r = inflight.result(timeout=20)
            assert r.status_code == 200
    assert len(engine.generate_log) == 1


# ------------------------------------------------------------------------------ hostile input


def _raw_exchange(url: str, data: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh socket and read until the server closes it or ``timeout``;
    returns ``(answer, seconds until the first byte)``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        t0 = time.monotonic()
        if data:
            s.sendall(data)
        chunks, first = [], None
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if first is None:
                first = time.monotonic() - t0
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                break
    return b"".join(chunks), first if first is not None else timeout


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


@pytest.mark.parametrize(
    "raw,param,needle",
    [
        # an array nested ~1,000 deep (json: RecursionError) and one under that limit
        ('{"prompt": "x", "lora": ' + "[" * 1000 + "]" * 1000 + "}", "lora", "nested more than 32"),
        ('{"prompt": "x", "lora": ' + "[" * 40 + "]" * 40 + "}", "lora", "nested more than 32"),
        ('{"prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate"),
        ('{"prompt": "x", "negative_prompt": "a\\udfffb"}', "negative_prompt", "surrogate"),
        ('{"prompt": "x", "size": "' + "1" * 5000 + 'x64"}', "size", "expected 'WxH'"),
        ('{"prompt": "x", "n": ' + "1" * 5000 + "}", "n", "5000 digits"),
        ('{"prompt": "x", "seed": -' + "9" * 200 + "}", "seed", "200 digits"),
    ],
)
def test_hostile_json_is_400_naming_the_field(server, engine, raw, param, needle):
    r = httpx.post(f"{server}/v1/images/generations", content=raw.encode(), timeout=30)
    err = assert_envelope(r, 400, param)
    assert needle in err["message"], err["message"]
    assert "Exceeds the limit" not in err["message"] and "recursion" not in err["message"]
    assert engine.calls == []
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize(
    "fields,param,needle",
    [
        ({"n": "2"}, "n", "n must be an integer, got the string '2'"),
        ({"seed": True}, "seed", "seed must be an integer, got true"),
        ({"guidance_scale": True}, "guidance_scale", "guidance_scale must be a number, got true"),
        ({"stream": 1}, "stream", "stream must be true or false, got an integer"),
        ({"lora": [{"name": "a", "scale": "x"}]}, "lora", "lora.0.scale must be a number"),
        ({"lora": {"name": "a", "sclae": 1}}, "lora", "lora: unknown field 'sclae'"),
        ({"lora": [[1]]}, "lora", "lora.0 must be an object"),
        ({"lora": "a"}, "lora", 'lora must be an object {"name"'),
    ],
)
def test_strict_types_422_in_our_words(server, engine, fields, param, needle):
    err = assert_envelope(gen(server, **fields), 422, param)
    assert needle in err["message"], err["message"]
    for internal in ("list[", "LoRASpec", "Input should", "function-after"):
        assert internal not in err["message"], err["message"]
    assert engine.calls == []
    assert gen(server, guidance_scale=2).status_code == 200  # an integer is a number


def test_set_lora_strict_and_float32_range(server, engine):
    body = {"lora_nickname": "a", "lora_path": "a.safetensors"}
    err = assert_envelope(httpx.post(f"{server}/v1/set_lora", json={**body, "strength": True}), 422)
    assert err["param"] == "strength" and "got true" in err["message"], err
    err = assert_envelope(
        httpx.post(f"{server}/v1/set_lora", json={**body, "strength": 1e308}), 400, "strength"
    )
    assert "float32" in err["message"], err["message"]
    err = assert_envelope(gen(server, lora={"name": "a", "scale": 1e308}), 400, "lora")
    assert "float32" in err["message"], err["message"]
    assert engine.calls == [] and engine.loaded == {}


def _safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.fixture(scope="module")
def unusable_lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("unusable_loras")
    files = {
        "meta_number": _safetensors_bytes({"__metadata__": 5}),
        "meta_string": _safetensors_bytes({"__metadata__": "abc"}),
        "e8m0": _safetensors_bytes(
            {"x.lora_A.weight": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}},
            b"\0\0",
        ),
        "empty": b"",
        "lfs": b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 228\n",
        "html": b"<!DOCTYPE html><html><body>Sign in</body></html>",
        "truncated": _safetensors_bytes(
            {"x.lora_A.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}},
            b"\0" * 10,
        ),
    }
    for name, data in files.items():
        (root / f"{name}.safetensors").write_bytes(data)
    os.mkfifo(root / "fifo.safetensors")
    with open(root / "sparse.safetensors", "wb") as f:
        f.truncate(2 << 30)  # 2 GiB of zeros, sparse: costs no disk
    return str(root)


@pytest.mark.parametrize(
    "name,needle",
    [
        ("meta_number", "its __metadata__ is a number; it must be an object of strings"),
        ("meta_string", "its __metadata__ is a string"),
        ("e8m0", "dtype F8_E8M0"),
        ("empty", "not a safetensors file: the file is empty"),
        ("lfs", "Git LFS pointer file, not the weights: the download is incomplete"),
        ("html", "an HTML page"),
        ("truncated", "truncated"),
        ("fifo", "a FIFO (named pipe), not a regular file"),
        ("sparse", "not a safetensors file"),
    ],
)
def test_unusable_lora_files_400_at_once(unusable_lora_dir, name, needle):
    engine = FakeEngine(lora_dirs=[unusable_lora_dir])
    with running_server(engine, ServerArgs(lora_dirs=[unusable_lora_dir])) as (url, _, _):
        before = list_loras(url)
        t0 = time.monotonic()
        r = httpx.post(
            f"{url}/v1/set_lora",
            json={"lora_nickname": "z", "lora_path": f"{name}.safetensors"},
            timeout=30,
        )
        assert time.monotonic() - t0 < 5  # nothing read whole, nothing blocked
        err = assert_envelope(r, 400, "lora_path")
        assert needle in err["message"], err["message"]
        for internal in ("pickle/zip", "dictionary update", "SafetensorError", "Errno"):
            assert internal not in err["message"], err["message"]
        assert list_loras(url) == before
        assert gen(url).status_code == 200  # the engine is not stuck behind it


# ------------------------------------------------------------------------------ bounded resources


def test_body_size_and_time_are_bounded_before_reading(engine):
    from sglang.multimodal_gen.entrypoints.http_body import MAX_BODY_BYTES

    args = ServerArgs(timeout_body_s=1, timeout_headers_s=1)
    with running_server(engine, args) as (url, _, _):
        head = (
            "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        )
        for declared in (100 << 20, 10_000_000_000):  # 11 bytes actually sent
            answer, first = _raw_exchange(
                url, (head + f"Content-Length: {declared}\r\n\r\n" + '{"prompt":1}').encode()
            )
            status, err = _status_and_error(answer)
            assert status == 413 and err["code"] == "request_too_large", answer[:300]
            assert first < 2
        chunked = (head + "Transfer-Encoding: chunked\r\n\r\n").encode()
        over = b"x" * (MAX_BODY_BYTES + 1)
        answer, _ = _raw_exchange(url, chunked + f"{len(over):x}\r\n".encode() + over + b"\r\n")
        assert _status_and_error(answer)[0] == 413
        at_limit = json.dumps({"prompt": "x", "size": "64x64", "num_inference_steps": 1})
        at_limit = at_limit.ljust(MAX_BODY_BYTES).encode()
        answer, _ = _raw_exchange(
            url, chunked + f"{len(at_limit):x}\r\n".encode() + at_limit + b"\r\n0\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        # a body that never arrives: 408 after --timeout-body, not a hang
        answer, first = _raw_exchange(
            url, (head + "Content-Length: 100\r\n\r\n" + '{"prompt"').encode()
        )
        status, err = _status_and_error(answer)
        assert status == 408 and err["code"] == "request_timeout" and first < 5
        # headers that never arrive: 408 after --timeout-headers, and the socket is closed
        for partial in (b"", b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"):
            answer, first = _raw_exchange(url, partial)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert first < 5
    assert len(engine.generate_log) == 1


def test_connection_cap(engine):
    args = ServerArgs(limit_concurrency=2, timeout_headers_s=30)
    with running_server(engine, args) as (url, _, server):
        open_connections = server.server_state.connections
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            wait_until(lambda: len(open_connections) == 2, "idle connections not accepted")
            answer, first = _raw_exchange(url, b"")
            status, err = _status_and_error(answer)
            assert status == 503 and "too many open connections" in err["message"]
            assert first < 10  # at once, not after the 30 s header timeout
        finally:
            for s in idle:
                s.close()
        wait_until(lambda: not open_connections, "closed connections still counted")
        assert gen(url).status_code == 200


def test_health_503_when_the_engine_makes_no_progress(engine):
    engine.release.clear()  # generate blocks: an engine call that does not return
    with running_server(engine, ServerArgs(health_stall_timeout_s=0.5)) as (url, app, _):
        time.sleep(0.7)
        assert httpx.get(f"{url}/health").status_code == 200  # idle is not stalled
        with ThreadPoolExecutor(max_workers=1) as pool:
            try:
                pending = pool.submit(gen, url)
                # running, so the stall names it (a request still queued would say "nothing")
                wait_until(lambda: app.state.scheduler.busy, "the request did not start")
                deadline = time.monotonic() + 10
                while (r := httpx.get(f"{url}/health")).status_code == 200:
                    assert time.monotonic() < deadline, "stall not reported"
                    time.sleep(0.1)
                err = assert_envelope(r, 503)
                assert "no progress" in err["message"] and "generate" in err["message"]
            finally:
                engine.release.set()
            assert pending.result().status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200


# ------------------------------------------------------------------------------ cost caps


def test_cost_caps_name_the_field(engine):
    args = ServerArgs(max_inference_steps=10, max_images_per_request=2)
    with running_server(engine, args) as (url, _, _):
        err = assert_envelope(gen(url, num_inference_steps=11), 400, "num_inference_steps")
        assert "[1, 10]" in err["message"]
        err = assert_envelope(gen(url, n=3), 400, "n")
        assert "[1, 2]" in err["message"]
    with running_server(engine, ServerArgs()) as (url, _, _):  # default budget
        big = {"size": "1024x1024", "num_inference_steps": 50}
        err = assert_envelope(gen(url, n=8, **big), 400, "n")
        assert "8 x 1024 x 1024 x 50" in err["message"] and "--max-pixel-steps" in err["message"]
        assert gen(url, n=1, **big).status_code == 200
    with running_server(engine, ServerArgs(max_pixel_steps=64 * 64 * 7)) as (url, _, _):
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "64x64"})
        assert_envelope(r, 400, "num_inference_steps")  # the model's default: 8 steps
    assert len(engine.generate_log) == 1


def test_max_image_size_above_the_models_refused_at_startup(monkeypatch, capsys):
    from sglang.cli.main import main
    from sglang.multimodal_gen.entrypoints import http_server

    class SmallModel(FakeEngine):
        spec = dataclasses.replace(
            FAKE_SPEC, limits=dataclasses.replace(FAKE_SPEC.limits, max_image_size=512)
        )

    app = http_server.create_app(SmallModel(), ServerArgs())
    assert app.state.spec.limits.max_image_size == 512  # the default follows a smaller model
    assert http_server.create_app(FakeEngine(), ServerArgs()).state.spec.limits.max_image_size == (
        2048
    )
    with pytest.raises(ValueError, match="larger than this model's maximum of 512"):
        http_server.create_app(SmallModel(), ServerArgs(max_image_size=1024))
    engine = SmallModel()
    monkeypatch.setattr(http_server, "build_engine", lambda args: engine)
    rc = main(["serve", "--port", str(free_port()), "--max-image-size", "1024"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip() == (
        "sglang serve: error: --max-image-size 1024 is larger than this model's maximum of 512 "
        "pixels per side; use --max-image-size 512 or less"
    )
    assert not engine.alive  # shut down
    rc = main(["serve", "--port", str(free_port()), "--device", "tpu9"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == (
        "sglang serve: error: --device 'tpu9' is not a device; use cpu, cuda or cuda:N"
    )


# ------------------------------------------------------------------------------ body transport
@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/set_lora", "/v1/unload_lora"])
def test_client_gone_while_sending_the_body_is_499_not_500(server, path):
    """Headers promise 100 bytes, 10 arrive, the socket closes: a 499 in the metrics (it was a
    500 with a ClientDisconnect traceback in the log), and the server keeps serving."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                'Content-Length: 100\r\n\r\n{"prompt":'
            ).encode()
        )
        time.sleep(0.2)  # the handler is reading the body
    wait_until(
        lambda: f'endpoint="{path}",status="499"' in httpx.get(f"{server}/metrics").text,
        "the disconnect was not counted as 499",
    )
    assert f'endpoint="{path}",status="500"' not in httpx.get(f"{server}/metrics").text
    assert gen(server).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"},
     {"origin": "https://evil.example"}, {"origin": "null"}, {"origin": "http://[::1"},
     {"sec-fetch-site": "cross-site", "content-type": "text/plain"}],
)  # fmt: skip
def test_a_browser_request_from_another_site_changes_nothing(server, engine, headers):
    """A page on another site can make a browser POST here without a CORS preflight (a form,
    text/plain, an untyped body): refused before anything runs, whatever the content type."""
    before = httpx.get(f"{server}/v1/list_loras").json()
    for path, body in (
        ("/v1/images/generations", {"prompt": "x", "size": "32x32", "num_inference_steps": 1}),
        ("/v1/set_lora", {"lora_nickname": "a", "lora_path": "a.safetensors"}),
        ("/v1/unset_lora", {}),
    ):
        r = httpx.post(f"{server}{path}", content=json.dumps(body), headers=headers)
        err = assert_envelope(r, 403, param=None)
        assert err["code"] == "cross_origin_request" and err["type"] == "permission_error"
    assert httpx.get(f"{server}/v1/list_loras").json() == before
    assert engine.generate_log == []
    assert httpx.get(f"{server}/v1/models", headers=headers).status_code == 200  # reads pass


@pytest.mark.parametrize(
    "headers",
    [{}, {"content-type": "application/json"}, {"content-type": "text/plain"},
     {"content-type": "application/x-www-form-urlencoded"},  # curl -d without -H
     {"sec-fetch-site": "same-origin"}, {"sec-fetch-site": "none"}, {"sec-fetch-site": ""},
     # a browser sends Authorization cross-site only after a CORS preflight someone approved
     {"sec-fetch-site": "cross-site", "authorization": "Bearer k"}],
)  # fmt: skip
def test_same_origin_and_non_browser_requests_pass(server, headers):
    host = server.removeprefix("http://")
    for extra in ({}, {"origin": f"http://{host}"}):
        body = json.dumps({"prompt": "x", "size": "32x32", "num_inference_steps": 1})
        r = httpx.post(
            f"{server}/v1/images/generations", content=body, headers={**headers, **extra}
        )
        assert r.status_code == 200, r.text


def test_scheduler_keeps_its_state_across_generations(engine):
    """The video-progress bookkeeping once reused the name of the started flag: after one
    generation a second start() raised, and a dead worker thread went unnoticed."""
    from concurrent.futures import Future

    from sglang.multimodal_gen.entrypoints.scheduler import Scheduler

    sched = Scheduler(engine, idle_check_s=0.05)
    assert sched.steps_done_for(Future()) is None  # before any task: not running, no error
    sched.start()
    kw = dict(prompt="x", height=32, width=32, num_inference_steps=1, seed=1)
    sched.submit_generation(FAKE_SPEC.resolve(fake_params(**kw))).result(timeout=60)
    sched.start()  # idempotent, also after a generation
    assert sched.engine_alive()

    def crash():
        raise RuntimeError("the worker thread dies")

    sched._next_task = crash  # its next turn ends the thread, without stop()
    wait_until(lambda: not sched._thread.is_alive(), "the worker thread did not end")
    assert not sched.engine_alive() and "scheduler thread" in sched.dead_reason
