"""First-block cache: our pipelines with ``fbcache`` equal diffusers' pipelines with diffusers'
``FirstBlockCacheConfig`` hook (diffusers 0.42.1) on the tiny Flux.1 [dev] and Z-Image: the same
steps skipped (counted on both sides), the same image.

The thresholds come from the head-residual ratios ``mean|r - r_prev| / mean|r_prev|`` measured on
these tiny random models (fp32, CPU, 32x32 images), each at least 0.012 away from every ratio met
on the way, so that each case skips some steps and computes others:

* Flux [dev], 5 steps, guidance 3.5: ratios 0.449, 0.351, 0.364 (against step 1), 0.564 ->
  threshold 0.38: computed, computed, skipped, skipped, computed;
* Flux [dev] true CFG, 4 steps (diffusers: ``cache_context("cond")`` / ``("uncond")``, one state
  per branch), cond/uncond ratios 0.487/0.482, 0.471/0.424, 0.414/0.453 -> threshold 0.44: 2 of
  8 branch calls skipped;
* Z-Image CFG, 5 steps (one batched forward for both branches, one state): ratios 0.807, 0.781,
  0.949, 0.855 -> threshold 0.795: step 2 skipped.

Measured: identical pixels (inf dB) in every case; the uncached images differ from the cached
ones by 40-55 dB. Bar: 70 dB (as the family parity tests), which the uncached image misses.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr, reference_image, reference_pipeline
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

MIN_PSNR = 70.0


@pytest.fixture
def diffusers_decisions(monkeypatch):
    """Every decision of diffusers' FBCache head hook (True: the remaining blocks ran)."""
    import diffusers.hooks.first_block_cache as fbc

    seen: list[bool] = []
    original = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, residual):
        out = original(self, residual)
        seen.append(out)
        return out

    monkeypatch.setattr(fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks", spy)
    return seen


def _apply_fbcache_to_zimage(transformer, threshold):
    """diffusers' FBCache on its Z-Image DiT. In diffusers 0.42.1 the head hook fetches the block
    argument named ``hidden_states``, which ``ZImageTransformerBlock.forward`` calls ``x`` (its
    first argument), and ``ZImageTransformer2DModel`` has no ``enable_cache`` / ``cache_context``;
    so the block's metadata maps that name to argument 0, the hook is applied directly and one
    context is set for the whole call (the pipeline runs cond and uncond in one forward)."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    meta = TransformerBlockMetadata(return_hidden_states_index=0)
    meta._cached_parameter_indices = {"hidden_states": 0}
    TransformerBlockRegistry.register(ZImageTransformerBlock, meta)
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(transformer, CacheContext("cond"))


def _generate(pipe, prompt, seed, **kw):
    """``(pixels, the request's step-cache summary)``."""
    gens = []
    new_generation = pipe.new_generation

    def recording(*a, **k):
        gens.append(new_generation(*a, **k))
        return gens[-1]

    pipe.new_generation = recording
    try:
        out = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    finally:
        del pipe.new_generation
    return out, gens[0].cache.summary() if gens[0].cache else None


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir)


FLUX_CASES = [
    pytest.param(dict(num_inference_steps=5, guidance_scale=3.5), 0.38, id="guidance"),
    pytest.param(
        dict(num_inference_steps=4, guidance_scale=3.5, negative_prompt="blurry",
             true_cfg_scale=4.0),
        0.44, id="true-cfg",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "threshold"), FLUX_CASES)
def test_flux_fbcache_matches_diffusers(
    flux, tiny_flux_dev_dir, diffusers_decisions, kw, threshold
):
    from diffusers.hooks import FirstBlockCacheConfig

    kw = dict(kw, height=32, width=32)
    ref = reference_flux(tiny_flux_dev_dir)
    ref.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    expected = reference_flux_images(ref, "a small red fox", 42, **kw)
    flux.enable_step_cache(None)
    plain, none = _generate(flux, "a small red fox", 42, **kw)
    flux.enable_step_cache(StepCacheConfig.of("fbcache", threshold=threshold))
    got, summary = _generate(flux, "a small red fox", 42, **kw)
    assert none is None
    ref_computed = sum(diffusers_decisions)
    assert 0 < summary["steps_skipped"] and 0 < ref_computed < len(diffusers_decisions)
    assert summary["steps_computed"] == ref_computed
    assert summary["steps_skipped"] == len(diffusers_decisions) - ref_computed
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the image


def test_zimage_fbcache_matches_diffusers(tiny_zimage_dir, diffusers_decisions):
    kw = dict(height=32, width=32, num_inference_steps=5, guidance_scale=3.5,
              negative_prompt="blurry, low quality")  # fmt: skip
    ref = reference_pipeline(tiny_zimage_dir)
    _apply_fbcache_to_zimage(ref.transformer, 0.795)
    expected = reference_image(ref, "a small red fox", 42, **kw)
    ours = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    plain, _ = _generate(ours, "a small red fox", 42, **kw)
    ours.enable_step_cache(StepCacheConfig.of("fbcache", threshold=0.795))
    got, summary = _generate(ours, "a small red fox", 42, **kw)
    ref_computed = sum(diffusers_decisions)
    assert 0 < ref_computed < len(diffusers_decisions) == 5
    assert (summary["steps_computed"], summary["steps_skipped"]) == (ref_computed, 5 - ref_computed)
    assert psnr(got[0], expected) >= MIN_PSNR
    assert psnr(plain[0], expected) < MIN_PSNR
