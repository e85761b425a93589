"""A request's own step caching (its ``cache`` field) and the counts it reports, on the real engine
(tiny Z-Image, CPU) behind real uvicorn.

* ``/v1/images/generations`` with ``cache`` skips steps and answers ``step_cache`` with the
  counts; its image is the Python API's for the same request (``engine.generate(cache=...)``,
  whose output carries the same counts). The same request without ``cache`` computes every step
  (no ``step_cache``), and its image is the uncached one.
* ``/v1/videos`` (tiny Wan2.2 TI2V): a form's ``cache`` (JSON text) runs, the completed job
  reports the Python API's counts, a job without it ``null``.
* ``--cache-request-policy deny`` refuses a request that sets ``cache`` (400 naming it) before
  anything runs; a request without it is served.
* Invalid values (method, knobs, ``fn + bn`` over the model's blocks) are 400 naming ``cache``.
* One denoising loop with a cached request, another cached with another threshold and an
  uncached one: each gets its image and counts alone. The two cached requests share the DiT
  calls (their batch keys agree; on the steps one skips, the middle blocks run for the other's
  rows only); the uncached one runs its own calls (its batch key differs, so the server never
  puts it in their batch).

Measured (fp32, CPU, 32x32, 6 steps; the tiny Z-Image has 2 main blocks, FBCache caches the
second): threshold 0.68 skips 2 of 6 steps for seeds 1-3 and both prompts below (0.6 skips none,
0.75 three or four); 0.05 skips none. The skipped steps move the image by 7 levels of 255 at
most (bar: 4).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fixtures.server import assert_envelope, running_server
from PIL import Image
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.layers.block_sequence import BlockSequence
from sglang.multimodal_gen.outputs import STEP_CACHE_INFO
from sglang.multimodal_gen.runtime import DiffusionEngine

STEPS = 6
BODY = dict(prompt="a small red fox", size="32x32", num_inference_steps=STEPS, seed=1)
FIELDS = dict(prompt="a small red fox", height=32, width=32, num_inference_steps=STEPS, seed=1)
SKIPPING = {"method": "fbcache", "threshold": 0.68}  # skips 2 of the 6 steps
COUNTS = {  # 2 blocks; a skipped step runs the first (Fn = 1) only
    "method": "fbcache",
    "steps_computed": 4,
    "steps_skipped": 2,
    "blocks_computed": 4 * 2 + 2 * 1,
    "blocks_skipped": 2,
}


@pytest.fixture(scope="module")
def engine(tiny_zimage_dir):
    eng = DiffusionEngine(model_path=tiny_zimage_dir, device="cpu")  # --cache-method none
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, tiny_zimage_dir):
    """The default policy: a request may choose its step caching."""
    with running_server(engine, ServerArgs(model_path=tiny_zimage_dir)) as (url, _, _):
        yield url


def _post(url: str, body: dict):
    import httpx

    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=60)


def _pixels(response) -> np.ndarray:
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _direct(engine, **fields):
    """``(pixels, step-cache counts or None)`` of the Python API."""
    image = engine.generate(**FIELDS, **fields)[0]
    return np.asarray(image.convert("RGB")), image.info.get(STEP_CACHE_INFO)


def test_a_request_with_cache_skips_steps_and_reports_them(engine, server):
    cached = _post(server, {**BODY, "cache": SKIPPING})
    plain = _post(server, BODY)
    cached_again = _post(server, {**BODY, "cache": '{"method": "fbcache", "threshold": 0.68}'})
    assert cached.status_code == 200, cached.text
    assert cached.json()["step_cache"] == COUNTS
    ref, counts = _direct(engine, cache=SKIPPING)
    assert counts == COUNTS
    assert np.array_equal(_pixels(cached), ref)
    # a form field's JSON text is the object
    assert cached_again.json()["step_cache"] == COUNTS
    assert np.array_equal(_pixels(cached_again), ref)
    # without the field: the server's default (none), every step computed, nothing reported
    assert plain.status_code == 200, plain.text
    assert "step_cache" not in plain.json()
    uncached, none = _direct(engine)
    assert none is None
    assert np.array_equal(_pixels(plain), uncached)
    assert np.abs(ref.astype(int) - uncached).max() >= 4  # the skipped steps changed the image


def test_the_server_may_forbid_a_request_cache(engine, tiny_zimage_dir):
    args = ServerArgs(model_path=tiny_zimage_dir, cache_request_policy="deny")
    with running_server(engine, args) as (url, _, _):
        steps = engine.steps_done()
        for value in (SKIPPING, "fbcache", "none"):
            err = assert_envelope(_post(url, {**BODY, "cache": value}), 400, "cache")
            assert "--cache-request-policy deny" in err["message"]
        assert engine.steps_done() == steps  # refused before anything ran
        served = _post(url, BODY)
    assert served.status_code == 200 and "step_cache" not in served.json()


@pytest.mark.parametrize(
    "value,words",
    [
        ({"method": "teacache", "fn": 1}, "cache.fn does not apply to cache.method teacache"),
        ({"method": "fbcache", "threshold": -0.5}, "cache.threshold must be >= 0"),
        ({"method": "fbcache", "threshold": "high"}, "cache.threshold must be a finite number"),
        ({"method": "fbcache", "warmup": 1.5}, "cache.warmup must be an integer"),
        ({"threshold": 0.1}, "cache.method is required"),
        ({"method": "fbcache", "speed": 2}, "cache has no key 'speed'"),
        ({"method": "none", "fn": 1}, "cache: method 'none' takes no fn"),
        ({"method": "fbcache", "fn": 2}, "fn 2 + bn 0 leave none of this model's 2 blocks"),
        # the dbcache preset's Fn scales to the model (here 1); a given Fn 8 is refused
        ({"method": "dbcache", "fn": 8}, "fn 8 + bn 0 leave none of this model's 2 blocks"),
        ({"method": 3}, "cache.method must be a string, one of none, fbcache"),
        (
            {"method": "fbcache", "max_cached_steps": "2"},
            "cache.max_cached_steps must be an integer",
        ),
        (
            {"method": "dbcache", "max_continuous_cached_steps": -2},
            "cache.max_continuous_cached_steps must be >= -1, got -2",
        ),
        ({"method": "taylorseer", "max_cached_steps": 2}, "cache.max_cached_steps does not apply"),
        ("{not json", "cache must be a method name or a JSON object"),
    ],
)
def test_an_invalid_cache_is_400_naming_it(server, value, words):
    err = assert_envelope(_post(server, {**BODY, "cache": value}), 400, "cache")
    assert err["message"].startswith("cache"), err["message"]
    assert words in err["message"], err["message"]


@pytest.mark.parametrize(
    "value,kind",
    [(3, "an integer"), (0.5, "a number"), (True, "true"), (["fbcache"], "a list"), ([], "a list")],
)
def test_a_cache_of_another_json_type_is_422_naming_it(server, value, kind):
    """Neither a method name nor an object: a schema error (422) that says what ``cache``
    takes."""
    err = assert_envelope(_post(server, {**BODY, "cache": value}), 422, "cache")
    assert (
        f'cache must be a method name (a string) or an object {{"method": string, <knob>: '
        f"value, ...}}, got {kind}" in err["message"]
    ), err["message"]


def test_a_batch_mixing_cached_and_uncached_requests_each_equals_alone(engine, monkeypatch):
    spec = engine.spec
    reqs = [
        spec.resolve(spec.params(**FIELDS, cache=SKIPPING)),
        spec.resolve(spec.params(**{**FIELDS, "seed": 3}, cache={**SKIPPING, "threshold": 0.05})),
        spec.resolve(spec.params(**{**FIELDS, "prompt": "a lighthouse at dusk", "seed": 2})),
    ]
    # the scheduler's rule: the cached requests may share a loop, the uncached one may not
    keys = [r.batch_key() for r in reqs]
    assert keys[0] == keys[1] != keys[2]
    alone = [engine.generate(r)[0] for r in reqs]
    partial = []  # DiT calls whose middle blocks ran for some rows only
    select_rows = BlockSequence.select_rows

    def counting(self, index):
        partial.append(index.tolist())
        return select_rows(self, index)

    monkeypatch.setattr(BlockSequence, "select_rows", counting)
    batch = engine.generate_batch(reqs)
    for i, (a, b) in enumerate(zip(alone, batch)):
        b = b[0]
        assert a.info.get(STEP_CACHE_INFO) == b.info.get(STEP_CACHE_INFO), i
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"request {i}"
    assert alone[0].info[STEP_CACHE_INFO] == COUNTS
    assert alone[1].info[STEP_CACHE_INFO]["steps_skipped"] == 0
    assert STEP_CACHE_INFO not in alone[2].info
    # request 0 skipped 2 steps in calls it shared with request 1, which computed them
    assert len(partial) == 2


def test_a_video_job_with_cache_in_a_form_reports_its_counts(tiny_wan_ti2v_dir):
    """``/v1/videos`` (tiny Wan2.2 TI2V, one expert, CFG: each branch decides alone): the
    form's ``cache`` (JSON text) runs, and the completed job reports the Python API's counts;
    a job without it reports ``null``."""
    import time

    import httpx

    body = dict(prompt="a paper boat", size="32x32", num_frames=5, fps=8, seed=11)
    body.update(num_inference_steps=3, guidance_scale=3.0)
    cache = {"method": "fbcache", "threshold": 100.0}  # every step after the first skipped

    def finished(url, job):
        assert job["step_cache"] is None  # not known while queued
        deadline = time.monotonic() + 120
        while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            job = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()
        assert job["status"] == "completed", job
        return job

    with DiffusionEngine(model_path=tiny_wan_ti2v_dir, device="cpu") as engine:
        fields = dict(body, height=32, width=32)
        del fields["size"]
        counts = engine.generate(**fields, cache=cache)[0].info[STEP_CACHE_INFO]
        with running_server(engine, ServerArgs(model_path=tiny_wan_ti2v_dir)) as (url, _, _):
            form = {k: (None, str(v)) for k, v in body.items()}
            form["cache"] = (None, '{"method": "fbcache", "threshold": 100.0}')
            cached = httpx.post(f"{url}/v1/videos", files=form, timeout=30)
            assert cached.status_code == 200, cached.text
            plain = httpx.post(f"{url}/v1/videos", json=body, timeout=30)
            cached, plain = finished(url, cached.json()), finished(url, plain.json())
    # cond and uncond are two states: 3 steps x 2 calls, the first of each computed
    assert counts == {
        "method": "fbcache",
        "steps_computed": 2,
        "steps_skipped": 4,
        "blocks_computed": 2 * 2 + 4 * 1,
        "blocks_skipped": 4,
    }
    assert cached["step_cache"] == counts
    assert plain["step_cache"] is None
