"""Two replicas of the engine on a local Ray Serve (CPU), through the openai client.

Skipped when ``ray[serve]`` is not installed (it is an optional extra; CI does not install it).
Checks: images equal to one in-process engine, requests spread over both replicas, a set_lora
reaches both (reported per replica), a refused set_lora changes none, and a replica killed while
requests run is replaced: every request gets its image or a clear error, and the replacement
serves with the adapters that were set before it started.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import os
import time

import httpx
import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip(
    "ray", reason="ray[serve] is an optional extra (pip install 'ray[serve]')"
)
serve = pytest.importorskip("ray.serve", reason="ray[serve] is an optional extra")

import openai  # noqa: E402
from fixtures.server import free_port  # noqa: E402
from sglang.multimodal_gen.configs.server_args import ServerArgs  # noqa: E402
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT, STEPS, SIZE = "a small boat at night", 2, 32


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="module")
def serve_url(tiny_zimage_dir, tiny_zimage_loras):
    from sglang.multimodal_gen.entrypoints.ray_serve import build_app

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ServerArgs(
        model_path=tiny_zimage_dir, lora_dirs=[os.path.dirname(tiny_zimage_loras[0])],
        max_queue_size=4, log_level="warning",
    )  # fmt: skip
    app = build_app(args, num_replicas=2, ray_actor_options={"num_cpus": 1})
    serve.run(app, name="default", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_zimage_dir, tiny_zimage_loras):
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as engine:
        req = lambda seed: SamplingParams(  # noqa: E731
            prompt=PROMPT, seed=seed, num_inference_steps=STEPS, height=SIZE, width=SIZE
        )
        base = {s: np.asarray(engine.generate(req(s))[0]) for s in range(4)}
        engine.set_lora("a", tiny_zimage_loras[0], strength=0.8)
        lora = {s: np.asarray(engine.generate(req(s))[0]) for s in range(4)}
    return base, lora


def _generate(url: str, seed: int) -> tuple[np.ndarray, str]:
    raw = httpx.post(
        f"{url}/v1/images/generations",
        json={
            "prompt": PROMPT,
            "size": f"{SIZE}x{SIZE}",
            "seed": seed,
            "num_inference_steps": STEPS,
            "response_format": "b64_json",
        },  # fmt: skip
        timeout=300,
    )
    raw.raise_for_status()
    return _pixels(raw.json()["data"][0]["b64_json"]), raw.headers["x-sglang-replica"]


def _replica_ids() -> list[str]:
    """Names of the replica actors alive now (no dashboard needed)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"] for a in names if a["name"].startswith("SERVE_REPLICA::default#sglang-diffusion")
    )


def test_two_replicas_serve_the_same_images_and_share_lora_changes(
    serve_url, reference, tiny_zimage_loras
):
    base, lora = reference
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
    assert httpx.get(f"{serve_url}/ready").status_code == 200
    assert httpx.head(f"{serve_url}/health").status_code == 200
    seen = set()
    with cf.ThreadPoolExecutor(4) as pool:
        for seed, (img, replica) in zip(
            range(8), pool.map(lambda s: _generate(serve_url, s % 4), range(8))
        ):
            np.testing.assert_array_equal(img, base[seed % 4])
            seen.add(replica)
    assert len(seen) == 2, seen  # Ray Serve spread the requests over both replicas
    resp = client.images.generate(
        prompt=PROMPT, size=f"{SIZE}x{SIZE}", response_format="b64_json",
        extra_body={"seed": 1, "num_inference_steps": STEPS},
    )  # fmt: skip
    np.testing.assert_array_equal(_pixels(resp.data[0].b64_json), base[1])

    # refused on the first replica: nothing logged, no replica changed
    bad = httpx.post(f"{serve_url}/v1/set_lora", json={"lora_nickname": "x", "lora_path": "/nope"})
    assert bad.status_code in (400, 404) and "error" in bad.json()

    ok = httpx.post(
        f"{serve_url}/v1/set_lora",
        json={"lora_nickname": "a", "lora_path": tiny_zimage_loras[0], "strength": 0.8},
        timeout=300,
    )
    assert ok.status_code == 200, ok.text
    reports = ok.json()["replicas"]
    assert len(reports) == 2 and all(r["status"] == 200 for r in reports.values()), reports
    seen = set()
    with cf.ThreadPoolExecutor(4) as pool:
        for seed, (img, replica) in zip(
            range(8), pool.map(lambda s: _generate(serve_url, s % 4), range(8))
        ):
            np.testing.assert_array_equal(img, lora[seed % 4])
            seen.add(replica)
    assert len(seen) == 2, seen


def test_killed_replica_is_replaced_and_no_request_is_lost_silently(serve_url, reference):
    _, lora = reference  # the previous test left adapter "a" active
    before = _replica_ids()
    assert len(before) == 2, before
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_generate, serve_url, s % 4) for s in range(16)]
        cf.wait(futures, return_when=cf.FIRST_COMPLETED)  # requests are running on both
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        outcomes = []
        for seed, fut in enumerate(futures):
            try:
                img, _ = fut.result(timeout=300)  # never hangs: an image or an error
                np.testing.assert_array_equal(img, lora[seed % 4])
                outcomes.append("image")
            except httpx.HTTPStatusError as e:
                assert e.response.status_code >= 500 and e.response.text  # a clear error
                outcomes.append("error")
    assert len(outcomes) == 16 and "image" in outcomes, outcomes
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = _replica_ids()
        if len(now) == 2 and before[0] not in now:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {_replica_ids()}")
    # the replacement replayed the log: both replicas serve with adapter "a"
    seen = set()
    deadline = time.monotonic() + 120
    while len(seen) < 2 and time.monotonic() < deadline:
        img, replica = _generate(serve_url, 2)
        np.testing.assert_array_equal(img, lora[2])
        seen.add(replica)
    assert len(seen) == 2, seen
