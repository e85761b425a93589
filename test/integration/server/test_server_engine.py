"""End-to-end HTTP tests on the real engine (tiny Z-Image, CPU) behind real uvicorn.

References are the engine's own direct output for the same arguments (the engine's parity with
diffusers is tested by the pipeline tests): a PNG over HTTP must decode to exactly the pixels
``DiffusionEngine.generate`` returns, and an image generated under a global ``set_lora`` must equal
the one generated with the same adapters as a per-request composition. One composition of two
peft-made adapters is also compared with diffusers' ``load_lora_weights`` + ``set_adapters``.
The model and those adapters are the session fixtures of ``test/integration/conftest.py``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from fixtures.server import assert_envelope, running_server, write_zimage_lora
from fixtures.tiny_models import psnr, reference_image, reference_pipeline
from PIL import Image
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.http_server import load_startup_loras
from sglang.multimodal_gen.runtime import DiffusionEngine


@pytest.fixture(scope="module")
def model_path(tiny_zimage_dir):
    return tiny_zimage_dir


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, model_path):
    root = tmp_path_factory.mktemp("zloras")
    write_zimage_lora(str(root / "a.safetensors"), model_path, seed=11)
    write_zimage_lora(str(root / "b.safetensors"), model_path, seed=12, modules=("to_k",))
    write_zimage_lora(
        str(root / "peft_c"), model_path, seed=13, modules=("to_q", "to_k"), peft=True
    )
    return str(root)


@pytest.fixture(scope="module")
def lora_dirs(lora_dir, tiny_zimage_loras):
    """Allowed roots: ours and the one holding the peft-made diffusers-format fixtures."""
    return [lora_dir, os.path.dirname(tiny_zimage_loras[0])]


@pytest.fixture(scope="module")
def engine(model_path, lora_dirs):
    eng = DiffusionEngine(model_path=model_path, lora_dirs=lora_dirs, device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, lora_dirs, model_path):
    args = ServerArgs(model_path=model_path, lora_dirs=lora_dirs)
    with running_server(engine, args) as (url, app, _):
        yield url


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def direct(engine, **fields) -> np.ndarray:
    return np.asarray(engine.generate(**fields)[0].convert("RGB"))


def assert_close(got: np.ndarray, ref: np.ndarray, max_levels: int = 2) -> None:
    """A global composition may be merged into the weights (rounded once) while the direct
    per-request reference runs it dynamically: equal up to a level or two of 255."""
    assert got.shape == ref.shape
    diff = np.abs(got.astype(int) - ref.astype(int))
    assert diff.max() <= max_levels, (diff.max(), (diff > 0).mean())


def post_gen(url, **body):
    body.setdefault("prompt", "a tiny red boat")
    body.setdefault("size", "32x32")
    body.setdefault("num_inference_steps", 1)
    body.setdefault("seed", 3)
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return pixels(r.json()["data"][0]["b64_json"])


def test_openai_client_png_equals_engine_output(server, engine):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    resp = client.images.generate(
        model=engine.model_name,
        prompt="a watercolor fox",
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 42, "num_inference_steps": 2},
    )
    raw = base64.b64decode(resp.data[0].b64_json)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    ref = direct(
        engine, prompt="a watercolor fox", height=64, width=64, seed=42, num_inference_steps=2
    )
    np.testing.assert_array_equal(pixels(resp.data[0].b64_json), ref)
    assert ref.std() > 0


def test_engine_limits_reach_the_server(server, engine):
    assert engine.spatial_factor == 16
    r = httpx.post(f"{server}/v1/images/generations", json={"prompt": "x", "size": "40x40"})
    err = assert_envelope(r, 400, "size")
    assert "multiples of 16" in err["message"]
    r = httpx.post(f"{server}/v1/set_lora", json={"lora_nickname": "a", "target": "transformer_2"})
    err = assert_envelope(r, 400, "target")
    assert "'all'" in err["message"] and "'transformer'" in err["message"]
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == engine.model_name


def test_s4_repo_id_not_cached_nothing_changed(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    before = httpx.get(f"{server}/v1/list_loras").json()
    body = {"lora_nickname": "lora_name", "lora_path": "Owner/Some-LoRA-Repo", "target": "all"}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = assert_envelope(r, r.status_code)
    msg = err["message"].lower()
    assert "could not be found locally" in msg and "download" in msg, msg
    assert httpx.get(f"{server}/v1/list_loras").json() == before


def test_s5_repo_id_from_local_hf_cache(server, engine, model_path, tmp_path, monkeypatch):
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    repo = hf_home / "hub" / "models--Owner--Some-LoRA-Repo"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    write_zimage_lora(str(snap / "pytorch_lora_weights.safetensors"), model_path, seed=21)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    body = {"lora_nickname": "hub_lora", "lora_path": "Owner/Some-LoRA-Repo", "target": "all"}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=60)
    assert r.status_code == 200, r.text
    try:
        got = post_gen(server)
        ref = direct(
            engine, prompt="a tiny red boat", height=32, width=32, seed=3, num_inference_steps=1,
            lora=[("hub_lora", 1.0)],
        )  # fmt: skip
        assert_close(got, ref)
    finally:
        assert httpx.post(f"{server}/v1/unset_lora").status_code == 200
        assert (
            httpx.post(f"{server}/v1/unload_lora", json={"lora_nickname": "hub_lora"}).status_code
            == 200
        )


def test_lora_over_http_file_peft_list_unset(server, engine, model_path, tiny_zimage_loras):
    base = post_gen(server)
    gen_fields = dict(prompt="a tiny red boat", height=32, width=32, seed=3, num_inference_steps=1)
    # 1. a single diffusers-format file
    r = httpx.post(
        f"{server}/v1/set_lora",
        json={"lora_nickname": "a", "lora_path": "a.safetensors"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    with_a = post_gen(server)
    assert not np.array_equal(with_a, base)
    assert_close(with_a, direct(engine, **gen_fields, lora=[("a", 1.0)]))
    # 2. a PEFT folder
    r = httpx.post(
        f"{server}/v1/set_lora", json={"lora_nickname": "c", "lora_path": "peft_c"}, timeout=60
    )
    assert r.status_code == 200, r.text
    with_c = post_gen(server)
    assert not np.array_equal(with_c, base) and not np.array_equal(with_c, with_a)
    assert_close(with_c, direct(engine, **gen_fields, lora=[("c", 1.0)]))
    # 3. a list of two with strengths (a reused by nickname)
    body = {
        "lora_nickname": ["a", "b"],
        "lora_path": [None, "b.safetensors"],
        "strength": [0.5, 0.8],
    }
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=60)
    assert r.status_code == 200, r.text
    with_ab = post_gen(server)
    assert_close(with_ab, direct(engine, **gen_fields, lora=[("a", 0.5), ("b", 0.8)]))
    # 4. two diffusers-format folders made with peft, vs the engine and vs diffusers itself
    fa, fb = tiny_zimage_loras
    body = {"lora_nickname": ["fa", "fb"], "lora_path": [fa, fb], "strength": [0.7, 1.3]}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=60)
    assert r.status_code == 200, r.text
    fields = dict(prompt="a watercolor fox", seed=4, num_inference_steps=2)
    got = post_gen(server, size="48x32", **fields)
    assert_close(
        got, direct(engine, height=32, width=48, lora=[("fa", 0.7), ("fb", 1.3)], **fields)
    )
    pipe = reference_pipeline(model_path)
    kw = dict(height=32, width=48, num_inference_steps=2, guidance_scale=0.0)
    ref_base = reference_image(pipe, "a watercolor fox", 4, **kw)
    pipe.load_lora_weights(fa, adapter_name="fa")
    pipe.load_lora_weights(fb, adapter_name="fb")
    pipe.set_adapters(["fa", "fb"], [0.7, 1.3])
    ref_two = reference_image(pipe, "a watercolor fox", 4, **kw)
    assert psnr(got, ref_two) >= 45.0
    assert psnr(got, ref_base) < 35.0  # the adapters are not a no-op
    listed = httpx.get(f"{server}/v1/list_loras").json()
    text = json.dumps(listed)
    for name in ("a", "b", "c", "fa", "fb"):
        assert f'"{name}"' in text, listed
    # per-request composition over HTTP
    per_req = post_gen(server, lora={"name": "c", "scale": 1.0})
    np.testing.assert_array_equal(per_req, direct(engine, **gen_fields, lora=[("c", 1.0)]))
    assert_close(per_req, with_c)
    # unset returns the base image exactly; adapters stay loaded
    assert httpx.post(f"{server}/v1/unset_lora", json={"target": "all"}).status_code == 200
    np.testing.assert_array_equal(post_gen(server), base)
    text = json.dumps(httpx.get(f"{server}/v1/list_loras").json())
    assert '"c"' in text
    # merge / unmerge keep the images equal up to merge rounding and back exactly
    r = httpx.post(
        f"{server}/v1/set_lora", json={"lora_nickname": "a", "merge_mode": "merge"}, timeout=60
    )
    assert r.status_code == 200, r.text
    merged = post_gen(server)
    assert np.abs(merged.astype(int) - with_a.astype(int)).max() <= 2
    assert httpx.post(f"{server}/v1/unmerge_lora_weights").status_code == 200
    assert httpx.post(f"{server}/v1/unset_lora").status_code == 200
    np.testing.assert_array_equal(post_gen(server), base)


def test_lora_dir_containment_reaches_the_engine(server, tmp_path, model_path):
    outside = write_zimage_lora(str(tmp_path / "outside.safetensors"), model_path, seed=41)
    before = httpx.get(f"{server}/v1/list_loras").json()
    for path in (outside, "../../../../../../../../" + outside.lstrip("/")):
        body = {"lora_nickname": "evil", "lora_path": path}
        err = assert_envelope(httpx.post(f"{server}/v1/set_lora", json=body, timeout=60), 400)
        assert err["param"] == "lora_path" and "outside" in err["message"], err
    assert httpx.get(f"{server}/v1/list_loras").json() == before


def test_relative_lora_path_resolves_against_every_lora_dir(
    server, engine, tiny_zimage_loras, monkeypatch
):
    """A relative ``lora_path`` is looked up inside each ``--lora-dir`` in turn (here the second
    root), as docs/serving.md says; the same folder named relative to the server's working
    directory is not (a client cannot know it), and the 400 says where relative paths are taken."""
    folder = tiny_zimage_loras[0]
    root = os.path.dirname(folder)
    body = {"lora_nickname": "rel", "lora_path": os.path.basename(folder)}
    r = httpx.post(f"{server}/v1/set_lora", json=body, timeout=60)
    assert r.status_code == 200, r.text
    try:
        gen = dict(prompt="a tiny red boat", height=32, width=32, seed=3, num_inference_steps=1)
        got = post_gen(server)
        assert_close(got, direct(engine, **gen, lora=[("rel", 1.0)]))
        assert not np.array_equal(got, direct(engine, **gen, lora=[]))
    finally:
        assert httpx.post(f"{server}/v1/unset_lora", json={}).status_code == 200
    before = httpx.get(f"{server}/v1/list_loras").json()
    monkeypatch.chdir(os.path.dirname(root))  # the server runs in this process
    cwd_relative = os.path.join(os.path.basename(root), os.path.basename(folder))
    assert os.path.isdir(cwd_relative)
    body = {"lora_nickname": "cwd", "lora_path": cwd_relative}
    err = assert_envelope(httpx.post(f"{server}/v1/set_lora", json=body, timeout=60), 400)
    assert err["param"] == "lora_path" and "relative paths" in err["message"], err
    assert httpx.get(f"{server}/v1/list_loras").json() == before


def test_s9_mismatch_nothing_changed(server):
    before = httpx.get(f"{server}/v1/list_loras").json()
    # one value (or a one-element list) applies to every nickname; other lengths must match
    for body, param in (
        ({"lora_nickname": ["a", "b"], "lora_path": ["a.safetensors"] * 3}, "lora_path"),
        (
            {
                "lora_nickname": ["a", "b"],
                "lora_path": ["a.safetensors", "b.safetensors"],
                "strength": [1.0, 0.5, 0.2],
            },
            "strength",
        ),
    ):
        err = assert_envelope(httpx.post(f"{server}/v1/set_lora", json=body), 400, param)
        assert "3 entries" in err["message"] and "lora_nickname has 2" in err["message"], err
    assert httpx.get(f"{server}/v1/list_loras").json() == before


def _same_image(got: np.ndarray, ref: np.ndarray) -> bool:
    return psnr(got, ref) >= 60.0 and int(np.abs(got.astype(int) - ref.astype(int)).max()) <= 1


def test_s11_concurrency_real_engine(server, engine):
    r = httpx.post(
        f"{server}/v1/set_lora",
        json={"lora_nickname": "b", "lora_path": "b.safetensors"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server}/v1/set_lora",
        json={"lora_nickname": "a", "lora_path": "a.safetensors"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    seeds = (1, 2)

    def ref_over_http(seed, **extra):
        return post_gen(server, prompt="p", size="32x32", seed=seed, num_inference_steps=1, **extra)

    # References, each made the way the request under test will run: the global "a" ones with
    # "a" set globally (it may be merged), per-request ones with their own composition.
    refs = {(s, "a"): ref_over_http(s) for s in seeds}
    assert httpx.post(f"{server}/v1/unset_lora").status_code == 200
    for s in seeds:
        fields = dict(prompt="p", height=32, width=32, seed=s, num_inference_steps=1)
        refs[(s, "base")] = direct(engine, **fields)
        refs[(s, "b07")] = direct(engine, **fields, lora=[("b", 0.7)])
        np.testing.assert_array_equal(ref_over_http(s), refs[(s, "base")])
        assert not np.array_equal(refs[(s, "a")], refs[(s, "base")])
    stop = threading.Event()
    admin_codes = []

    def admin_loop():
        i = 0
        while not stop.is_set():
            if i % 2 == 0:
                r = httpx.post(f"{server}/v1/set_lora", json={"lora_nickname": "a"}, timeout=60)
            else:
                r = httpx.post(f"{server}/v1/unset_lora", timeout=60)
            admin_codes.append(r.status_code)
            i += 1
            time.sleep(0.05)

    def one(i):
        body = {"prompt": "p", "size": "32x32", "seed": seeds[i % 2], "num_inference_steps": 1}
        if i % 4 == 3:
            body["lora"] = [{"name": "b", "scale": 0.7}]
        return body, httpx.post(f"{server}/v1/images/generations", json=body, timeout=300)

    admin = threading.Thread(target=admin_loop)
    admin.start()
    try:
        with ThreadPoolExecutor(max_workers=32) as pool:
            results = list(pool.map(one, range(32)))
    finally:
        stop.set()
        admin.join(timeout=60)
    assert admin_codes and set(admin_codes) == {200}
    seen = set()
    for body, r in results:
        assert r.status_code == 200, r.text
        got = pixels(r.json()["data"][0]["b64_json"])
        allowed = ["b07"] if "lora" in body else ["base", "a"]
        # Batched with others, an image may differ from its unbatched reference by the GEMMs'
        # batch-size rounding (measured: 83 dB, one level); the nearest wrong reference is
        # 44 dB away (b07 vs base), so 60 dB and one level tell them apart.
        hits = [k for k in allowed if _same_image(got, refs[(body["seed"], k)])]
        assert len(hits) == 1, (body, {k: psnr(got, refs[(body["seed"], k)]) for k in allowed})
        seen.add(hits[0])
    assert "b07" in seen
    assert httpx.post(f"{server}/v1/unset_lora").status_code == 200


def test_server_without_lora_dir_refuses_local_paths(model_path, lora_dir, tmp_path, monkeypatch):
    """``sglang serve`` without ``--lora-dir``: startup ``--lora-path`` adapters load (the
    operator's own command line), HTTP ``set_lora`` refuses every local path with one message
    that names ``--lora-dir`` and does not depend on whether the path exists, and Hub ids from the
    local cache still load."""
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    repo = hf_home / "hub" / "models--Owner--Cached-LoRA"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    write_zimage_lora(str(snap / "pytorch_lora_weights.safetensors"), model_path, seed=22)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    args = ServerArgs(
        model_path=model_path,
        lora_paths=[os.path.join(lora_dir, "a.safetensors")],
        lora_nicknames=["start"],
        device="cpu",
    )
    assert args.lora_dirs == []
    engine = DiffusionEngine.from_args(args)
    try:
        load_startup_loras(engine, args)
        with running_server(engine, args) as (url, _, _):
            before = httpx.get(f"{url}/v1/list_loras").json()
            assert [a["nickname"] for a in before["loaded"]] == ["start"]
            messages = set()
            for path in (
                os.path.join(lora_dir, "b.safetensors"),  # exists
                os.path.join(lora_dir, "missing.safetensors"),  # does not
                "b.safetensors",
                "../../b.safetensors",
                "peft_c",
            ):
                body = {"lora_nickname": "x", "lora_path": path}
                r = httpx.post(f"{url}/v1/set_lora", json=body, timeout=60)
                err = assert_envelope(r, 400, "lora_path")
                assert "--lora-dir" in err["message"], err
                messages.add(err["message"].replace(repr(path), "PATH"))
            assert len(messages) == 1, messages
            assert httpx.get(f"{url}/v1/list_loras").json() == before
            body = {"lora_nickname": "hub", "lora_path": "Owner/Cached-LoRA"}
            r = httpx.post(f"{url}/v1/set_lora", json=body, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


def test_a_long_generation_that_keeps_stepping_is_not_a_stall(engine):
    """``--health-stall-timeout`` is for a call that hangs: a generation far longer than the
    timeout keeps ``/health`` at 200 while its denoising steps end (each well under it); the
    hung call of ``test_server_api`` turns it 503 with the same timeout."""
    steps_before = engine.steps_done()
    body = {"prompt": "a long one", "size": "64x64", "num_inference_steps": 500, "seed": 1}
    with running_server(engine, ServerArgs(health_stall_timeout_s=0.3)) as (url, app, _):
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(
                httpx.post, f"{url}/v1/images/generations", json=body, timeout=300
            )
            codes, t0 = [], time.monotonic()
            while not pending.done():
                codes.append(httpx.get(f"{url}/health", timeout=10).status_code)
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert pending.result().status_code == 200
    assert engine.steps_done() - steps_before == 500
    assert took > 1.0, took  # several stall timeouts long, or the test proves nothing
    assert set(codes) == {200}, codes
