"""Step caching on Wan2.2: the two-expert A14B with FBCache equals diffusers'
``FirstBlockCacheConfig`` hook on both of its ``WanTransformer3DModel`` experts (diffusers 0.42.1
runs ``cache_context("cond")`` / ``("uncond")`` on the current expert: one state per expert and
branch), and an expert's states never serve the other: the low-noise expert's first step computes
although the high-noise expert's last step was skipped. Batched requests equal each alone (TI2V-5B,
per-token timesteps: extended tier).

TI2V-5B (5 steps, 32x32), threshold 0.105: request A (guidance 4) meets ratios 0.078, 0.093,
0.127, 0.100 and skips steps 1, 2 and 4; request B (guidance 2) meets 0.098, 0.119, 0.109, 0.137
and skips step 1 (0.004 from the nearest ratio), so the shared calls of steps 2 and 4 mix
computing and skipping rows.

Threshold from the head-residual ratios measured on the tiny A14B (fp32, CPU, 32x32, 5 frames,
6 steps, guidance 3.0 / 2.0; the boundary switches experts after step 1): cond/uncond ratios
0.066 (step 1), fresh at step 2, then 0.101, 0.114 (against step 2), 0.208 -> threshold 0.15
(0.036 from every ratio met): steps 1, 3, 4 skipped and 0, 2, 5 computed in each branch.

Measured: identical pixels to diffusers' cached pipeline (inf dB); the uncached video misses the
70 dB bar.
"""

from __future__ import annotations

import torch
from fixtures.step_cache_runs import run_requests, state_owners
from fixtures.tiny_models import psnr
from fixtures.tiny_wan import reference_frames, reference_wan
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.wan import WanPipeline

MIN_PSNR = 70.0
THRESHOLD = 0.15
KW = dict(height=32, width=32, num_frames=5, num_inference_steps=6, negative_prompt="blurry",
          guidance_scale=3.0, guidance_scale_2=2.0)  # fmt: skip


def test_a14b_fbcache_matches_diffusers_per_expert(tiny_wan_a14b_dir):
    from diffusers.hooks import FirstBlockCacheConfig

    ref = reference_wan(tiny_wan_a14b_dir)
    for expert in (ref.transformer, ref.transformer_2):
        expert.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
    expected = reference_frames(ref, "a paper boat", 3, **KW)
    pipe = WanPipeline.from_pretrained(tiny_wan_a14b_dir)
    req = [dict(prompt="a paper boat", seed=3)]
    [(plain, _)] = run_requests(pipe, req, False, output_type="np", **KW)
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=THRESHOLD))
    [(got, cache)] = run_requests(pipe, req, False, output_type="np", **KW)
    experts = {id(pipe.denoisers[k]) for k in ("transformer", "transformer_2")}
    assert state_owners(cache) == experts and len(cache.states) == 4  # 2 experts x 2 branches
    s = cache.summary()
    assert (s["steps_computed"], s["steps_skipped"]) == (6, 6)
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the video


TI2V_REQUESTS = [
    dict(prompt="a red fox", seed=7, guidance_scale=4.0),
    dict(prompt="a paper boat", seed=3, guidance_scale=2.0),
]


def test_ti2v_batched_requests_equal_each_alone(tiny_wan_ti2v_dir):
    pipe = WanPipeline.from_pretrained(tiny_wan_ti2v_dir)
    pipe.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.105))
    kw = dict(height=32, width=32, num_frames=5, num_inference_steps=5, negative_prompt="blurry")
    alone = run_requests(pipe, TI2V_REQUESTS, False, **kw)
    batched = run_requests(pipe, TI2V_REQUESTS, True, **kw)
    skipped = [ca.summary()["steps_skipped"] for _, ca in alone]
    assert skipped == [6, 2]  # A skips steps 1, 2, 4 in both branches, B step 1
    for (a, ca), (b, cb) in zip(alone, batched):
        assert ca.summary() == cb.summary()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
