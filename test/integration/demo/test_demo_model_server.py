"""The embedded demo model through the HTTP server at TP 2 (two gloo processes): pictures match
their prompts, and ``/v1/set_lora`` with the demo LoRA swaps the colours and only them. The
prompts are sent concurrently, so the server batches them (``--max-batch-size``). Also the
engine under Ulysses sequence parallelism (two gloo processes)."""

from __future__ import annotations

import base64
import io
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fixtures.demo_model import MIN, MIN_LORA, MIN_SHAPE, assert_accuracy, generate, swapped
from fixtures.server import running_server
from PIL import Image
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.models import demo_scenes as ds
from sglang.multimodal_gen.models.default_model import demo_lora_path
from sglang.multimodal_gen.runtime import DiffusionEngine

pytestmark = pytest.mark.slow


def _image(url: str, i: int, scene: ds.Scene, n: int = 1) -> list[Image.Image]:
    body = {"prompt": scene.caption, "seed": i, "n": n}  # no size: the model's own 64x64
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == n
    return [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in data]


def _images(url: str, scenes: list[ds.Scene]) -> list[Image.Image]:
    """One picture per scene, all requests in flight at once (the server batches them); the
    scene at index 1 is asked with ``n`` 2 (its first picture is kept)."""
    with ThreadPoolExecutor(len(scenes)) as pool:
        futs = [pool.submit(_image, url, i, s, 2 if i == 1 else 1) for i, s in enumerate(scenes)]
        return [f.result()[0] for f in futs]


def test_tp2_server_draws_prompts_and_applies_the_demo_lora():
    lora = demo_lora_path()
    roots = [os.path.dirname(lora)]
    # the engine enforces the LoRA roots: it must get the server's --lora-dir (as `sglang serve`
    # does), else a relative lora_path is looked up in the working directory
    engine = DiffusionEngine(tp_size=2, device="cpu", lora_dirs=roots)
    try:
        args = ServerArgs(tp_size=2, lora_dirs=roots, max_batch_size=40, batch_wait_ms=200)
        with running_server(engine, args) as (url, _, _):
            models = httpx.get(f"{url}/v1/models").json()["data"]
            assert models[0]["id"] == "sglang-default-zimage-tiny"
            scenes = ds.random_scenes(40, seed=99)
            images = _images(url, scenes)
            assert all(im.size == (64, 64) for im in images)
            assert_accuracy(images, scenes, dict(MIN, shape=MIN_SHAPE))

            # a path relative to the --lora-dir root
            body = {"lora_nickname": "swap", "lora_path": os.path.basename(lora)}
            r = httpx.post(f"{url}/v1/set_lora", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert_accuracy(_images(url, scenes), [swapped(s) for s in scenes], MIN_LORA)
            assert httpx.post(f"{url}/v1/unset_lora", json={}, timeout=60).status_code == 200
            assert_accuracy(_images(url, scenes[:10]), scenes[:10], MIN)
    finally:
        engine.shutdown()


def test_ulysses2_engine_draws_prompts():
    scenes = ds.random_scenes(16, seed=321)
    with DiffusionEngine(ulysses_degree=2, device="cpu") as engine:
        assert engine.world_size == 2
        assert_accuracy(generate(engine, scenes), scenes, dict(MIN, shape=MIN_SHAPE))
