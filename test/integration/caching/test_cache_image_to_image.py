"""Step caching of an image-to-image request: at ``strength`` < 1 the loop runs the last
``int(n * strength)`` of ``n`` steps (diffusers' ``get_timesteps``), and a policy's "last step" is
the last step run. TeaCache forces its last call: on the tiny Z-Image at 6 steps and strength 0.5
(3 steps run) with a threshold nothing reaches, call 0 (the warm-up) and call 2 (the last) compute
and call 1 is skipped; counting the request's 6 steps instead, call 5 never comes and only the
warm-up computes."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.step_cache_runs import run_requests
from PIL import Image
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline


@pytest.fixture(scope="module")
def zimage(tiny_zimage_dir):
    return ZImagePipeline.from_pretrained(tiny_zimage_dir)


def test_teacache_computes_the_last_step_run_at_strength_below_one(zimage):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    zimage.enable_step_cache(StepCacheConfig.of("teacache", threshold=1e9, warmup=1))
    try:
        [(_, cache)] = run_requests(
            zimage,
            [dict(prompt="a red circle", seed=1, image=image, strength=0.5)],
            False,
            height=32,
            width=32,
            num_inference_steps=6,
        )
    finally:
        zimage.enable_step_cache(None)
    assert cache.num_steps == 3  # the steps run, not num_inference_steps
    s = cache.summary()
    assert (s["steps_computed"], s["steps_skipped"]) == (2, 1)
