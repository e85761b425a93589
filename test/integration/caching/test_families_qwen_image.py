"""Step caching on Qwen-Image: our FBCache equals diffusers' ``FirstBlockCacheConfig`` hook on
its ``QwenImageTransformer2DModel`` (diffusers 0.42.1 runs ``cache_context("cond")`` and
``("uncond")``: one state per CFG branch, as ours), and two requests in one batch get each the
latents and the skip counts they get alone.

Threshold from the head-residual ratios measured on the tiny model (fp32, CPU, 32x32, 5 steps,
true CFG 4.0): cond/uncond ratios 0.447/0.448, 0.498/0.499 (against step 0), 0.591/0.593,
0.694/0.696 -> threshold 0.55 (0.04 from every ratio met): steps 1 and 2 skipped in both
branches, 0, 3 and 4 computed.

Qwen-Image-Edit-2511 (``zero_cond_t``: the blocks take the embeddings of ``t`` and of 0 as two
row arguments), 5 steps, 32x48, true CFG 4.0, threshold 0.29: request A (two input images) skips
steps 1 and 3 of its cond branch and 1, 2, 3 of its uncond branch, request B (one image) step 4 of
each (nearest ratio 0.003 away), so the shared calls run the middle blocks on some rows only.

Measured: identical pixels to diffusers' cached pipeline (inf dB); the uncached image differs
(below the 70 dB bar); batched latents identical to the lone ones.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.input_images import scene
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_models import psnr
from fixtures.tiny_qwen_image import reference_qwen_image, reference_qwen_images
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline

MIN_PSNR = 70.0
THRESHOLD = 0.55
KW = dict(height=32, width=32, num_inference_steps=5, true_cfg_scale=4.0, negative_prompt="blurry")


@pytest.fixture(scope="module")
def pipe(tiny_qwen_image_dir):
    return QwenImagePipeline.from_pretrained(tiny_qwen_image_dir)


def test_fbcache_matches_diffusers(pipe, tiny_qwen_image_dir):
    from diffusers.hooks import FirstBlockCacheConfig

    ref = reference_qwen_image(tiny_qwen_image_dir)
    ref.transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
    expected = reference_qwen_images(ref, "a small red fox", 42, **KW)
    pipe.enable_step_cache(None)
    req = [dict(prompt="a small red fox", seed=42)]
    [(plain, none)] = run_requests(pipe, req, False, output_type="np", **KW)
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=THRESHOLD))
    [(got, cache)] = run_requests(pipe, req, False, output_type="np", **KW)
    assert none is None
    s = cache.summary()
    assert (s["steps_computed"], s["steps_skipped"]) == (6, 4)  # 3 + 2 per branch
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the image


def test_batched_requests_equal_each_alone(pipe):
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=THRESHOLD))
    reqs = [
        dict(prompt="a small red fox", seed=42),
        dict(prompt="a lighthouse at dusk", seed=7, true_cfg_scale=2.0),
    ]
    kw = {k: v for k, v in KW.items() if k != "true_cfg_scale"}
    reqs[0]["true_cfg_scale"] = 4.0
    alone = run_requests(pipe, reqs, False, **kw)
    batched = run_requests(pipe, reqs, True, **kw)
    for (a, ca), (b, cb) in zip(alone, batched):
        assert ca.summary() == cb.summary()
        assert ca.summary()["steps_skipped"] > 0
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_edit_2511_batched_requests_equal_each_alone(tmp_path_factory):
    from sglang.multimodal_gen.models.families.tiny.qwen_image_edit import (
        build_qwen_image_edit_plus_dir,
    )
    from sglang.multimodal_gen.pipelines.qwen_image_edit import QwenImageEditPlusPipeline

    d = build_qwen_image_edit_plus_dir(str(tmp_path_factory.mktemp("edit_2511")), zero_cond_t=True)
    pipe = QwenImageEditPlusPipeline.from_pretrained(d)
    assert pipe.transformer.cfg.zero_cond_t
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.29))
    images = [scene(64, 48, 3), scene(40, 56, 4)]
    reqs = [
        dict(prompt="put the square of picture 2 into picture 1", seed=9, image=images),
        dict(prompt="a red fox", seed=3, image=images[1:]),
    ]
    kw = dict(
        height=32, width=48, num_inference_steps=5, true_cfg_scale=4.0, negative_prompt="blur"
    )
    alone = run_requests(pipe, reqs, False, **kw)
    batched = run_requests(pipe, reqs, True, **kw)
    assert [c.summary()["steps_skipped"] for _, c in alone] == [5, 2]
    for (a, ca), (b, cb) in zip(alone, batched):
        assert ca.summary() == cb.summary()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
