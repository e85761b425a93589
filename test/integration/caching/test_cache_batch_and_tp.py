"""Step caching in a batch and under tensor parallelism: each request decides for itself.

* Two Flux [dev] requests in one denoising loop (their DiT calls batched) give each the image and
  the skip counts it gets alone, although they skip different steps (the shared calls run the
  middle blocks on the computing request's rows only).
* TP 2 (two gloo processes) gives the TP 1 image and skip counts: the ranks agree on every
  decision.

Measured (fp32, CPU, 32x32, 5 steps, threshold 0.38): request A computes steps 0, 1, 4 and skips
2, 3; request B computes 0, 3, 4 and skips 1, 2 (so 2 of the 5 shared calls were mixed); every
batched and TP 2 image identical to its single-process image (inf dB); bar 70 dB, which the
uncached image misses (55 dB, ``test_fbcache_parity``).
"""

from __future__ import annotations

import pytest
import torch
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.block_sequence import BlockSequence
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.pipelines.flux import FluxPipeline

MIN_PSNR = 70.0
CACHE = StepCacheConfig.of("fbcache", threshold=0.38)
KW = dict(height=32, width=32, num_inference_steps=5)
REQUESTS = [
    dict(prompt="a small red fox", seed=42, guidance_scale=3.5),
    dict(prompt="a lighthouse at dusk", seed=7, guidance_scale=5.0),
]


def _pipe(model_dir):
    pipe = FluxPipeline.from_pretrained(model_dir)
    pipe.enable_step_cache(CACHE)
    return pipe


def _run(pipe, requests, batched):
    """``[(pixels, cache summary)]`` per request, alone or as one batch."""
    out = run_requests(pipe, requests, batched, output_type="np", **KW)
    return [(px, cache.summary()) for px, cache in out]


@pytest.fixture(scope="module")
def alone(tiny_flux_dev_dir):
    pipe = _pipe(tiny_flux_dev_dir)
    return pipe, _run(pipe, REQUESTS, batched=False)


def test_batched_requests_equal_each_alone(alone, monkeypatch):
    pipe, single = alone
    mixed = []
    select_rows = BlockSequence.select_rows

    def counting(self, index):
        mixed.append(index.tolist())
        return select_rows(self, index)

    monkeypatch.setattr(BlockSequence, "select_rows", counting)
    batch = _run(pipe, REQUESTS, batched=True)
    for i, ((a, sa), (b, sb)) in enumerate(zip(single, batch)):
        assert sa == sb, f"request {i}: {sa} alone, {sb} batched"
        assert psnr(a, b) >= MIN_PSNR, f"request {i}: {psnr(a, b):.1f} dB"
    assert [s["steps_skipped"] for _, s in single] == [2, 2]
    assert len(mixed) == 2  # 2 shared calls ran the middle blocks for one request only
    assert psnr(single[0][0], single[1][0]) < 35  # the requests really differ


def _rank_fn(rank, model_dir):
    out = _run(_pipe(model_dir), REQUESTS[:1], batched=False)
    return out[0], get_tp_world_size()


def test_tp2_equals_tp1(alone, tiny_flux_dev_dir):
    _, single = alone
    results = launch_processes(_rank_fn, 2, args=(tiny_flux_dev_dir,), backend="gloo")
    for rank, ((px, summary), world) in enumerate(results):
        assert world == 2
        assert summary == single[0][1], f"rank {rank}: {summary} vs TP 1 {single[0][1]}"
        assert psnr(px, single[0][0]) >= MIN_PSNR


def test_enable_refuses_what_cannot_be_cached(alone):
    from types import SimpleNamespace

    pipe, _ = alone
    with pytest.raises(ValueError, match="--cache-fn 8 \\+ --cache-bn 0 leave none of the 4"):
        pipe.enable_step_cache(StepCacheConfig.of("dbcache", fn=8))  # cache-dit's F8B0
    assert pipe.step_cache == CACHE  # unchanged
    other = SimpleNamespace(
        denoisers={"transformer": torch.nn.Linear(2, 2)},
        family=SimpleNamespace(display_name="Wan"),
        model_path=None,
    )
    with pytest.raises(ValueError, match="the Wan denoiser 'transformer' does not support step"):
        FluxPipeline.enable_step_cache(other, CACHE)
