"""Step caching on the video families HunyuanVideo 1.0, HunyuanVideo 1.5 and LTX-2 (video and
audio streams): FBCache skips some steps and computes others, two requests in one batch get each
the latents and skip counts they get alone, HunyuanVideo 1.0 equals diffusers'
``FirstBlockCacheConfig`` hook, and LTX-2's guidance passes that change what its blocks compute
(STG, modality isolation) never reuse a residual of another pass.

Thresholds from the head-residual ratios measured on the tiny models (fp32, CPU, 32x32, 5 frames
(LTX-2: 9), 5 steps); request A is "a lighthouse at dusk" (seed 7), request B "a paper boat"
(seed 3) with guidance 3.0 (LTX-2: 2.0):

* HunyuanVideo 1.0 (embedded guidance, no CFG), threshold 0.56: A meets 0.500, 0.647, 0.399,
  0.452 and skips steps 1, 3, 4; B meets 0.685, 0.582, 0.545, 0.584 and skips step 3 (0.015 from
  the nearest ratio).
* HunyuanVideo 1.5 (CFG, one state per branch), threshold 0.45: both meet about 0.32, 0.33
  (against step 0), 0.53, 0.575 and skip steps 1 and 2 in each branch.
* LTX-2 (cond and uncond in one forward and one state, as diffusers' ``cache_context
  ("cond_uncond")``; STG on block 1 and modality isolation in their own passes and states),
  threshold 0.165: A skips steps 1 and 2 of the CFG and STG passes, B step 1 of each; every
  isolation pass computes (nearest ratio 0.009 away).
* LTX-2 without CFG: the STG pass's head block is the conditional pass's (STG perturbs block 1
  only), so its head residual is the same; a cache that kept one state for both would skip the
  STG pass (ratio 0) and return the conditional prediction. At a threshold below every ratio met
  (min 0.115) the cached run must equal the uncached one exactly.

Measured: HunyuanVideo 1.0 identical pixels to diffusers' cached pipeline (inf dB), the uncached
video below the 45 dB bar of its family parity test; batched outputs identical to the lone ones
(HunyuanVideo 1.0), within what batching changes without a cache (1.5, LTX-2: ``BATCH_ATOL``).
"""

from __future__ import annotations

import pytest
import torch
from fixtures.step_cache_runs import run_requests, state_names
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig

# HunyuanVideo 1.5 and LTX-2 batch their requests' rows in forwards whose sums round differently
# with the batch size, cached or not (measured uncached, batched against alone: at most 8e-7 and
# 2.4e-6 on the latents; cached: 7e-7 and 2.1e-6); a residual of the wrong request moves them
# by far more (the cache itself changes the latents by 6e-3 to 0.24 here)
BATCH_ATOL = 1e-5
REQ_A = dict(prompt="a lighthouse at dusk", seed=7)
VIDEO = dict(height=32, width=32, num_frames=5, num_inference_steps=5)
LTX2 = dict(height=32, width=32, num_frames=9, num_inference_steps=5, max_sequence_length=32,
            negative_prompt="blurry", spatio_temporal_guidance_blocks=[1])  # fmt: skip


def _batched_equals_alone(pipe, requests, skipped, atol=0.0, **kw):
    """Each request's skip counts and latents alone and in one batch (``atol``: what batching
    changes without a cache)."""
    alone = run_requests(pipe, requests, False, **kw)
    batched = run_requests(pipe, requests, True, **kw)
    assert [c.summary()["steps_skipped"] for _, c in alone] == skipped
    for (a, ca), (b, cb) in zip(alone, batched):
        assert ca.summary() == cb.summary()
        torch.testing.assert_close(b, a, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def hunyuan_video_dir(tmp_path_factory):
    from sglang.multimodal_gen.models.families.tiny.hunyuan_video import build_hunyuan_video_dir

    return build_hunyuan_video_dir(str(tmp_path_factory.mktemp("tiny_hv") / "model"))


def test_hunyuan_video_fbcache_matches_diffusers(hunyuan_video_dir):
    from diffusers import HunyuanVideoPipeline as Reference
    from diffusers.hooks import FirstBlockCacheConfig
    from sglang.multimodal_gen.pipelines.hunyuan_video import HunyuanVideoPipeline

    ref = Reference.from_pretrained(hunyuan_video_dir)
    ref.set_progress_bar_config(disable=True)
    ref.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.56))
    frames = ref(REQ_A["prompt"], generator=torch.Generator().manual_seed(REQ_A["seed"]),
                 output_type="np", **VIDEO).frames  # fmt: skip
    expected = (frames * 255).round().astype("uint8")
    pipe = HunyuanVideoPipeline.from_pretrained(hunyuan_video_dir)
    [(plain, _)] = run_requests(pipe, [REQ_A], False, output_type="np", **VIDEO)
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.56))
    [(got, cache)] = run_requests(pipe, [REQ_A], False, output_type="np", **VIDEO)
    assert cache.summary()["steps_skipped"] == 3
    assert psnr(got, expected) >= 70.0
    assert psnr(plain, expected) < 45.0  # the cache changed the video
    _batched_equals_alone(
        pipe, [REQ_A, dict(prompt="a paper boat", seed=3, guidance_scale=3.0)], [3, 1], **VIDEO
    )


def test_hunyuan_video15_batched_equals_alone(tmp_path_factory):
    from sglang.multimodal_gen.models.families.tiny.hunyuan_video15 import (
        build_hunyuan_video15_dir,
    )
    from sglang.multimodal_gen.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

    d = build_hunyuan_video15_dir(str(tmp_path_factory.mktemp("tiny_hv15") / "model"))
    pipe = HunyuanVideo15Pipeline.from_pretrained(d)
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.45))
    reqs = [REQ_A, dict(prompt="a paper boat", seed=3, guidance_scale=3.0)]
    _batched_equals_alone(pipe, reqs, [4, 4], BATCH_ATOL, negative_prompt="blurry", **VIDEO)


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir
    from sglang.multimodal_gen.pipelines.ltx2 import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(
        build_ltx2_dir(str(tmp_path_factory.mktemp("tiny_ltx2") / "model"))
    )


def test_ltx2_guidance_passes_keep_their_own_states(ltx2):
    kw = dict(LTX2, guidance_scale=1.0, audio_guidance_scale=1.0)  # STG and isolation, no CFG
    ltx2.enable_step_cache(None)
    [(plain, _)] = run_requests(ltx2, [REQ_A], False, **kw)
    ltx2.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.05))
    [(got, cache)] = run_requests(ltx2, [REQ_A], False, **kw)
    assert state_names(cache) == {
        "blocks", "blocks[stg=(1,)]", "blocks[isolate_modalities=True]"
    }  # fmt: skip
    assert cache.summary()["steps_skipped"] == 0
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_ltx2_batched_equals_alone(ltx2):
    ltx2.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.165))
    reqs = [REQ_A, dict(prompt="a paper boat", seed=3, guidance_scale=2.0)]
    _batched_equals_alone(ltx2, reqs, [4, 2], BATCH_ATOL, **LTX2)
