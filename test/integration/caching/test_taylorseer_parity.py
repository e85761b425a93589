"""TaylorSeer on the tiny Flux.1 [dev] and Z-Image: our pipeline equals diffusers' pipeline with
diffusers' ``TaylorSeerCacheConfig`` hook (diffusers 0.42.1) where the two do the same
computation, and batched requests equal each alone.

The same computation: our ``target="output"`` with ``Fn = Bn = 0`` extrapolates the output
streams of the whole block sequence; diffusers with ``cache_identifiers`` naming every
transformer block (``transformer_blocks.<i>``, ``single_transformer_blocks.<i>``) extrapolates
every block's output, and on a predicted step the last block's extrapolation is what reaches
``norm_out`` (the earlier blocks' predictions are discarded). Factors in fp32 on both sides
(diffusers' ``taylor_factors_dtype=torch.float32``). Our default ``target="residual"`` (the
middle residual added to the current head output) has no diffusers counterpart: no hooked
module's output is a difference of two hidden states; it is checked against a hand-written use
of diffusers' ``TaylorSeerState`` in the unit tests.

On Z-Image the same with ``cache_identifiers`` naming its main ``layers.<i>`` (the refiners
stay outside our sequence and uncached on both sides), the hook applied directly as the FBCache
parity test does, and CFG (both branches in one forward: one state on each side).

Measured (fp32, CPU, 32x32, 8 steps, warmup 2, interval 3, order 2; steps 2, 4, 5, 7 predicted):
Flux: our image equals diffusers' (inf dB); the uncached image differs (50 dB; our default
residual target: 51 dB from the uncached image). Z-Image: the same decisions, inf dB; the
uncached image 32 dB from diffusers' cached one (residual target: 34 dB from the uncached
image); order 1 or warmup 3 on our side only: 44 / 28 dB. Bar: 70 dB.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr, reference_image, reference_pipeline
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

MIN_PSNR = 70.0
KW = dict(height=32, width=32, num_inference_steps=8, guidance_scale=3.5)
KNOBS = dict(warmup=2, interval=3, order=2)


def _generate(pipe, requests, batched=False):
    """``[(pixels, the request's cache summary)]`` per ``(prompt, seed)``, alone or batched."""
    rows = [dict(prompt=p, seed=seed) for p, seed in requests]
    out = run_requests(pipe, rows, batched, output_type="np", **KW)
    return [(px, cache.summary() if cache else None) for px, cache in out]


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir)


def test_flux_taylorseer_matches_diffusers(flux, tiny_flux_dev_dir):
    from diffusers import TaylorSeerCacheConfig

    ref = reference_flux(tiny_flux_dev_dir)
    ref.transformer.enable_cache(
        TaylorSeerCacheConfig(
            cache_interval=KNOBS["interval"],
            disable_cache_before_step=KNOBS["warmup"],
            max_order=KNOBS["order"],
            taylor_factors_dtype=torch.float32,
            cache_identifiers=[r"transformer_blocks\.\d+", r"single_transformer_blocks\.\d+"],
        )
    )
    expected = reference_flux_images(ref, "a small red fox", 42, **KW)
    flux.enable_step_cache(None)
    [(plain, _)] = _generate(flux, [("a small red fox", 42)])
    flux.enable_step_cache(StepCacheConfig.of("taylorseer", target="output", **KNOBS))
    [(got, summary)] = _generate(flux, [("a small red fox", 42)])
    assert (summary["steps_computed"], summary["steps_skipped"]) == (4, 4)
    assert summary["blocks_skipped"] == 4 * 4
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the image


def _apply_taylorseer_to_zimage(transformer):
    """diffusers' TaylorSeer on its Z-Image DiT, every main ``layers.<i>`` block hooked (the
    blocks our sequence spans; the noise / context refiners run uncached on both sides). As in
    the FBCache parity test: ``ZImageTransformerBlock.forward`` calls the hidden states ``x``
    (argument 0), which the block's metadata maps to ``hidden_states``; the model has no
    ``enable_cache``, so the hook is applied directly and one context is set for the whole call
    (the pipeline runs cond and uncond in one forward: one state, our ``joint`` row)."""
    from diffusers import TaylorSeerCacheConfig
    from diffusers.hooks import apply_taylorseer_cache
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    meta = TransformerBlockMetadata(return_hidden_states_index=0)
    meta._cached_parameter_indices = {"hidden_states": 0}
    TransformerBlockRegistry.register(ZImageTransformerBlock, meta)
    config = TaylorSeerCacheConfig(
        cache_interval=KNOBS["interval"],
        disable_cache_before_step=KNOBS["warmup"],
        max_order=KNOBS["order"],
        taylor_factors_dtype=torch.float32,
        cache_identifiers=[r"layers\.\d+"],
    )
    apply_taylorseer_cache(transformer, config)
    _set_cache_context(transformer, CacheContext("cond"))


@pytest.fixture
def diffusers_decisions(monkeypatch):
    """Every decision of diffusers' TaylorSeer hooks (True: the block ran), per hook."""
    import diffusers.hooks.taylorseer_cache as tsc

    seen: dict[int, list[bool]] = {}
    original = tsc.TaylorSeerCacheHook._measure_should_compute

    def spy(self):
        out = original(self)
        seen.setdefault(id(self), []).append(bool(out[0]))
        return out

    monkeypatch.setattr(tsc.TaylorSeerCacheHook, "_measure_should_compute", spy)
    return seen


def test_zimage_taylorseer_matches_diffusers(tiny_zimage_dir, diffusers_decisions):
    kw = dict(KW, negative_prompt="blurry, low quality")
    ref = reference_pipeline(tiny_zimage_dir)
    _apply_taylorseer_to_zimage(ref.transformer)
    expected = reference_image(ref, "a small red fox", 42, **kw)
    ours = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    [(plain, _)] = run_requests(ours, [dict(prompt="a small red fox", seed=42)], False, "np", **kw)
    ours.enable_step_cache(StepCacheConfig.of("taylorseer", target="output", **KNOBS))
    [(got, cache)] = run_requests(
        ours, [dict(prompt="a small red fox", seed=42)], False, "np", **kw
    )
    summary = cache.summary()
    computed = [True, True, False, True, False, False, True, False]  # steps 2, 4, 5, 7 predicted
    assert diffusers_decisions and all(d == computed for d in diffusers_decisions.values())
    # one diffusers hook per main layer, each computed on the 4 computed steps as ours
    assert summary["blocks_computed"] == 4 * len(diffusers_decisions)
    assert (summary["steps_computed"], summary["steps_skipped"]) == (4, 4)
    assert psnr(got[0], expected) >= MIN_PSNR
    assert psnr(plain[0], expected) < MIN_PSNR  # the cache changed the image


def test_batched_requests_equal_each_alone(flux):
    requests = [("a small red fox", 42), ("a lighthouse at dusk", 7)]
    flux.enable_step_cache(StepCacheConfig.of("taylorseer", **KNOBS))  # residual target
    alone = _generate(flux, requests)
    batch = _generate(flux, requests, batched=True)
    for i, ((a, sa), (b, sb)) in enumerate(zip(alone, batch)):
        assert sa == sb and sa["steps_skipped"] == 4, f"request {i}: {sa} alone, {sb} batched"
        assert psnr(a, b) >= MIN_PSNR, f"request {i}: {psnr(a, b):.1f} dB"
    assert psnr(alone[0][0], alone[1][0]) < 35  # the requests really differ
