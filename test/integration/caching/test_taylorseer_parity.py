"""TaylorSeer on the tiny Flux.1 [dev]: our pipeline equals diffusers' pipeline with diffusers'
``TaylorSeerCacheConfig`` hook (diffusers 0.42.1) where the two do the same computation, and
batched requests equal each alone.

The same computation: our ``target="output"`` with ``Fn = Bn = 0`` extrapolates the output
streams of the whole block sequence; diffusers with ``cache_identifiers`` naming every
transformer block (``transformer_blocks.<i>``, ``single_transformer_blocks.<i>``) extrapolates
every block's output, and on a predicted step the last block's extrapolation is what reaches
``norm_out`` (the earlier blocks' predictions are discarded). Factors in fp32 on both sides
(diffusers' ``taylor_factors_dtype=torch.float32``). Our default ``target="residual"`` (the
middle residual added to the current head output) has no diffusers counterpart: no hooked
module's output is a difference of two hidden states; it is checked against a hand-written use
of diffusers' ``TaylorSeerState`` in the unit tests.

Measured (fp32, CPU, 32x32, 8 steps, warmup 2, interval 3, order 2; steps 2, 4, 5, 7 predicted):
our image equals diffusers' (inf dB); the uncached image differs (50 dB; our default residual
target: 51 dB from the uncached image). Bar: 70 dB.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.flux import FluxPipeline

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


def test_batched_requests_equal_each_alone(flux):
    requests = [("a small red fox", 42), ("a lighthouse at dusk", 7)]
    flux.enable_step_cache(StepCacheConfig.of("taylorseer", **KNOBS))  # residual target
    alone = _generate(flux, requests)
    batch = _generate(flux, requests, batched=True)
    for i, ((a, sa), (b, sb)) in enumerate(zip(alone, batch)):
        assert sa == sb and sa["steps_skipped"] == 4, f"request {i}: {sa} alone, {sb} batched"
        assert psnr(a, b) >= MIN_PSNR, f"request {i}: {psnr(a, b):.1f} dB"
    assert psnr(alone[0][0], alone[1][0]) < 35  # the requests really differ
