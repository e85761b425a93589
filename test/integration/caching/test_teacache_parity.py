"""TeaCache: our Flux pipeline with ``teacache`` equals diffusers' ``FluxPipeline`` whose
``FluxTransformer2DModel`` runs TeaCache's published rule, written here (ali-vilab/TeaCache,
TeaCache4FLUX: block 0's ``norm1(hidden_states, emb=temb)[0]`` compared with the previous call's,
``np.poly1d`` of the Flux coefficients accumulated, the blocks skipped while the sum stays below
``rel_l1_thresh``, the first and last steps always computed, a skipped call adding the image
residual of the last computed one): the same decisions, the same image. A batch of requests
equals each request alone, and TP 2 equals one process (the ranks agree).

The thresholds come from the rescaled changes measured on the tiny random Flux.1 [dev] (fp32,
CPU, 32x32 images, 6 steps, guidance 3.5): ``poly(change)`` of steps 1-4 = 0.183, 0.184, 0.193,
0.202 (running sums 0.183, 0.367, 0.560, 0.762):

* threshold 0.7: steps 1-3 skipped, step 4 computed (0.762), step 5 forced (the last step);
* threshold 0.45: steps 1, 2 skipped, step 3 computed (0.560), step 4 skipped (0.202), step 5
  forced although its sum (about 0.41) stays below 0.45: this case guards the last-step rule.

Every sum is at least 0.06 from its threshold. Measured: identical pixels (inf dB); bar 70 dB,
which the uncached image misses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.models.dits.flux import FLUX_TEACACHE_COEFFICIENTS
from sglang.multimodal_gen.pipelines.flux import FluxPipeline

MIN_PSNR = 70.0
STEPS = 6
KW = dict(height=32, width=32, num_inference_steps=STEPS)
FOX = dict(prompt="a small red fox", seed=42, guidance_scale=3.5)
REQUESTS = [FOX, dict(prompt="a lighthouse at dusk", seed=7, guidance_scale=5.0)]
CASES = [
    pytest.param(0.7, [True, False, False, False, True, True], id="thresh-0.7"),
    pytest.param(0.45, [True, False, False, True, False, True], id="thresh-0.45-last-step"),
]


def apply_reference_teacache(transformer, threshold: float, num_steps: int) -> list[bool]:
    """TeaCache4FLUX's rule on diffusers' Flux DiT (its blocks wrapped, the forward untouched):
    returns the list its decisions are appended to (``True``: the blocks ran)."""
    doubles = list(transformer.transformer_blocks)
    singles = list(transformer.single_transformer_blocks)
    poly = np.poly1d(FLUX_TEACACHE_COEFFICIENTS)
    st = dict(cnt=0, acc=0.0, prev=None, residual=None, skip=False, ori=None)
    decisions: list[bool] = []

    def first(block, forward):
        def run(hidden_states, encoder_hidden_states, temb, **kw):
            m = block.norm1(hidden_states, emb=temb)[0]
            if st["cnt"] == 0 or st["cnt"] == num_steps - 1:
                calc, st["acc"] = True, 0.0
            else:
                prev = st["prev"]
                st["acc"] += poly(((m - prev).abs().mean() / prev.abs().mean()).item())
                calc = not st["acc"] < threshold
                if calc:
                    st["acc"] = 0.0
            st["prev"] = m
            st["cnt"] = (st["cnt"] + 1) % num_steps
            decisions.append(calc)
            st["skip"] = not calc
            if not calc:
                return encoder_hidden_states, hidden_states + st["residual"]
            st["ori"] = hidden_states.clone()
            return forward(hidden_states, encoder_hidden_states, temb, **kw)

        return run

    def passthrough(forward, last=False):
        def run(hidden_states, encoder_hidden_states, temb, **kw):
            if st["skip"]:
                return encoder_hidden_states, hidden_states
            ctx, out = forward(hidden_states, encoder_hidden_states, temb, **kw)
            if last:
                st["residual"] = out - st["ori"]
            return ctx, out

        return run

    doubles[0].forward = first(doubles[0], doubles[0].forward)
    for b in doubles[1:] + singles:
        b.forward = passthrough(b.forward, last=b is singles[-1])
    return decisions


def _run(pipe, requests, batched, cache):
    """``[(pixels, cache summary)]`` per request, alone or as one batch."""
    pipe.enable_step_cache(cache)
    try:
        out = run_requests(pipe, requests, batched, output_type="np", **KW)
    finally:
        pipe.enable_step_cache(None)
    return [(px, None if c is None else c.summary()) for px, c in out]


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir)


@pytest.mark.parametrize(("threshold", "decisions"), CASES)
def test_flux_teacache_matches_reference(flux, tiny_flux_dev_dir, threshold, decisions):
    ref = reference_flux(tiny_flux_dev_dir)
    seen = apply_reference_teacache(ref.transformer, threshold, STEPS)
    expected = reference_flux_images(ref, FOX["prompt"], FOX["seed"], **KW, guidance_scale=3.5)
    [(got, s)] = _run(flux, [FOX], False, StepCacheConfig.of("teacache", threshold=threshold))
    [(plain, _)] = _run(flux, [FOX], False, None)
    assert seen == decisions
    assert (s["steps_computed"], s["steps_skipped"]) == (sum(seen), len(seen) - sum(seen))
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the image


def test_flux_modulated_input_is_block0_norm1(flux, tiny_flux_dev_dir):
    """The Flux declaration computes what TeaCache4FLUX compares: diffusers' dual-stream block
    0 ``norm1(hidden_states, emb=temb)[0]`` (same weights, random inputs)."""
    from diffusers import FluxTransformer2DModel

    ref = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    dit = flux.denoisers["transformer"]
    d = ref.inner_dim
    g = torch.Generator().manual_seed(5)
    x, ctx, temb = (torch.randn(*shape, generator=g) for shape in ((2, 6, d), (2, 3, d), (2, d)))
    got = dit.block_sequence().modulated_input.compute((x, ctx), {"temb": temb})
    want = ref.transformer_blocks[0].norm1(x, emb=temb)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - x).abs().max() > 0.1  # the modulation changes the input


CACHE = StepCacheConfig.of("teacache", threshold=0.45)


@pytest.fixture(scope="module")
def alone(flux):
    return _run(flux, REQUESTS, False, CACHE)


def test_batched_requests_equal_each_alone(flux, alone):
    batch = _run(flux, REQUESTS, True, CACHE)
    for i, ((a, sa), (b, sb)) in enumerate(zip(alone, batch)):
        assert sa == sb, f"request {i}: {sa} alone, {sb} batched"
        assert psnr(a, b) >= MIN_PSNR, f"request {i}: {psnr(a, b):.1f} dB"
    assert all(s["steps_skipped"] > 0 for _, s in alone)
    assert psnr(alone[0][0], alone[1][0]) < 35  # the requests really differ


def _rank_fn(rank, model_dir):
    [out] = _run(FluxPipeline.from_pretrained(model_dir), REQUESTS[:1], False, CACHE)
    return out, get_tp_world_size()


def test_tp2_equals_tp1(alone, tiny_flux_dev_dir):
    results = launch_processes(_rank_fn, 2, args=(tiny_flux_dev_dir,), backend="gloo")
    for rank, ((px, summary), world) in enumerate(results):
        assert world == 2
        assert summary == alone[0][1], f"rank {rank}: {summary} vs TP 1 {alone[0][1]}"
        assert psnr(px, alone[0][0]) >= MIN_PSNR


def test_enable_refuses_a_family_without_the_declaration(flux, monkeypatch):
    from sglang.multimodal_gen.layers.block_sequence import BlockSequence

    dit = flux.denoisers["transformer"]
    plain = dit.block_sequence

    def undeclared(*a, **k):
        seq = plain(*a, **k)
        return BlockSequence(seq.owner, seq.stages, seq.row_args, seq.lengths, seq.name)

    monkeypatch.setattr(dit, "block_sequence", undeclared)
    with pytest.raises(ValueError, match="--cache-method teacache: .*FluxTransformer"):
        flux.enable_step_cache(CACHE)
    assert flux.step_cache is None  # unchanged


def _family(name, root):
    """``(pipeline, request fields)`` of a tiny family model built under ``root``."""
    video = dict(height=32, width=32, num_frames=5, num_inference_steps=6)
    if name == "zimage":
        from fixtures.tiny_models import build_tiny_zimage
        from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

        pipe = ZImagePipeline.from_pretrained(build_tiny_zimage(root, seed=0))
        return pipe, dict(height=32, width=32, num_inference_steps=6, negative_prompt="blurry")
    if name == "qwen-image":
        from fixtures.tiny_qwen_image import build_tiny_qwen_image
        from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline

        pipe = QwenImagePipeline.from_pretrained(build_tiny_qwen_image(root))
        return pipe, dict(height=32, width=32, num_inference_steps=6)
    if name == "wan-a14b":
        from fixtures.tiny_wan import build_tiny_wan
        from sglang.multimodal_gen.pipelines.wan import WanPipeline

        return WanPipeline.from_pretrained(build_tiny_wan(root, layout="a14b")), video
    if name == "hunyuan-video":
        from sglang.multimodal_gen.models.families.tiny.hunyuan_video import (
            build_hunyuan_video_dir,
        )
        from sglang.multimodal_gen.pipelines.hunyuan_video import HunyuanVideoPipeline

        return HunyuanVideoPipeline.from_pretrained(build_hunyuan_video_dir(root)), video
    if name == "hunyuan-video15":
        from sglang.multimodal_gen.models.families.tiny.hunyuan_video15 import (
            build_hunyuan_video15_dir,
        )
        from sglang.multimodal_gen.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

        pipe = HunyuanVideo15Pipeline.from_pretrained(build_hunyuan_video15_dir(root))
        return pipe, dict(video, negative_prompt="blurry")
    from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir
    from sglang.multimodal_gen.pipelines.ltx2 import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(build_ltx2_dir(root)), dict(video, num_frames=9)


@pytest.mark.parametrize(
    "name", ["zimage", "qwen-image", "wan-a14b", "hunyuan-video", "hunyuan-video15", "ltx2"]
)
def test_families_declare_their_modulated_input(name, tmp_path):
    """Each family's declaration runs under its pipeline: at threshold 0.3 (warm-up 1) some
    steps are skipped and some computed (measured on the tiny models: 2-8 of 6-12 branch calls
    skipped), the output moves but stays finite; at threshold 0 every step computes and the
    output is the uncached one."""
    pipe, kw = _family(name, str(tmp_path / "model"))
    req = [dict(prompt="a lighthouse at dusk", seed=7)]
    [(plain, _)] = run_requests(pipe, req, False, **kw)
    pipe.enable_step_cache(StepCacheConfig.of("teacache", threshold=0.3, warmup=1))
    [(got, cache)] = run_requests(pipe, req, False, **kw)
    pipe.enable_step_cache(StepCacheConfig.of("teacache", threshold=0.0, warmup=1))
    [(exact, every)] = run_requests(pipe, req, False, **kw)
    s = cache.summary()
    assert s["steps_skipped"] > 0 and s["steps_computed"] > 0, s
    assert bool((got - plain).abs().max() > 0) and bool(got.isfinite().all())
    assert every.summary()["steps_skipped"] == 0
    assert torch.equal(exact, plain)
