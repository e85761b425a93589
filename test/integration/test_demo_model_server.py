"""The embedded demo model through the HTTP server at TP 2 (two gloo processes): pictures match
their prompts, and ``/v1/set_lora`` with the demo LoRA swaps the colours and only them."""

from __future__ import annotations

import base64
import io
import os

import httpx
import pytest
from PIL import Image
from server_helpers import running_server
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.models import demo_scenes as ds
from sglang.multimodal_gen.models.default_model import demo_lora_path
from sglang.multimodal_gen.runtime import DiffusionEngine, GenerationRequest
from test_demo_model import MIN, MIN_LORA, assert_accuracy, swapped

pytestmark = pytest.mark.slow


def _images(url: str, scenes: list[ds.Scene], n: int = 1) -> list[Image.Image]:
    out = []
    for i, s in enumerate(scenes):
        body = {"prompt": s.caption, "seed": i, "n": n, "size": "64x64"}
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == n
        out.extend(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in data)
    return out


def test_tp2_server_draws_prompts_and_applies_the_demo_lora():
    lora = demo_lora_path()
    engine = DiffusionEngine(tp_size=2, device="cpu")
    try:
        args = ServerArgs(tp_size=2, lora_dirs=[os.path.dirname(lora)])
        with running_server(engine, args, request_factory=GenerationRequest) as (url, _, _):
            models = httpx.get(f"{url}/v1/models").json()["data"]
            assert models[0]["id"] == "sglang-default-zimage-tiny"
            scenes = ds.random_scenes(40, seed=99)
            images = _images(url, scenes[:36]) + _images(url, scenes[36:38], n=2)[::2]
            images += _images(url, scenes[38:])
            assert all(im.size == (64, 64) for im in images)
            assert_accuracy(images, scenes, MIN)

            body = {"lora_nickname": "swap", "lora_path": lora}
            r = httpx.post(f"{url}/v1/set_lora", json=body, timeout=120)
            assert r.status_code == 200, r.text
            few = scenes[:16]
            assert_accuracy(_images(url, few), [swapped(s) for s in few], MIN_LORA)
            assert httpx.post(f"{url}/v1/unset_lora", json={}, timeout=60).status_code == 200
            assert_accuracy(_images(url, few), few, MIN)
    finally:
        engine.shutdown()
