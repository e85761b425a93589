"""The bookkeeping every step-cache policy shares, on a toy block sequence: a request's region
ends at its own length (another request's padding changes nothing), states keyed by LoRA
composition, branch context and denoiser, the LoRA row mapping narrowed to the computing rows."""

from __future__ import annotations

import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.layers.lora.composition import Composition, LoRAContext
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
    cache_rows,
)

FB = StepCacheConfig.of("fbcache", threshold=0.1)


def test_padding_from_another_request_changes_no_decision():
    """``lengths``: a request's statistic covers its own tokens, not the batch's padding."""
    m = toy.model()
    temb = torch.ones(1, toy.D)
    steps = toy.steps(3, 1, drift=0.04)
    cache_alone, cache_batched = RequestCache(FB), RequestCache(FB)
    for x, c in steps:
        with cache_rows([CacheRow(cache_alone)]):
            toy.seq(m, temb).run((x[:, :3], c))
        padded = torch.cat([x[:, :3], torch.zeros(1, 2, toy.D) + 5.0], 1)  # 2 padding tokens
        seq = toy.seq(m, temb)
        seq.lengths = [3]
        with cache_rows([CacheRow(cache_batched)]):
            seq.run((padded, c))
    assert cache_alone.summary() == cache_batched.summary()
    assert 0 < cache_alone.skipped < len(steps)


def test_a_new_lora_composition_never_reuses_a_residual():
    m = toy.model()
    m.lora_context = LoRAContext("transformer")
    temb = torch.ones(2, toy.D)
    steps = toy.steps(1, 2, drift=0.0)  # the same input every step: would skip from step 1 on
    cache = RequestCache(FB)
    toy.ours(m, steps[:3], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (1, 2)
    m.lora_context.active = Composition.of([(1, 0.5)])
    toy.ours(m, steps[:2], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (2, 3)  # computed again under the new one
    # another branch context or another denoiser: its own state too
    toy.ours(m, steps[:1], temb, [CacheRow(cache, "uncond")] * 2)
    toy.ours(toy.model(), steps[:1], temb, [CacheRow(cache)] * 2)
    assert cache.computed == 4


def test_a_call_of_some_rows_narrows_the_lora_row_mapping(monkeypatch):
    """Requests with other adapters share a call; when only some compute, the middle blocks run
    on their rows with their rows' compositions (a LoRA layer needs one per input row)."""
    from sglang.multimodal_gen.layers.lora.composition import RowMapping

    m = toy.model()
    ctx = m.lora_context = LoRAContext("transformer")
    ca, cb = Composition.of([(1, 0.5)]), Composition.of([(2, 1.0)])
    seen = []
    forward = toy.Single.forward

    def recording(self, h, temb):
        seen.append((h.shape[0], None if ctx.mapping is None else ctx.mapping.compositions))
        return forward(self, h, temb)

    monkeypatch.setattr(toy.Single, "forward", recording)
    steady, moving = toy.steps(1, 2, drift=0.04), toy.steps(2, 1, drift=None)
    a, b = RequestCache(FB), RequestCache(FB)
    temb = torch.ones(3, toy.D)
    with ctx.rows(RowMapping.of([ca, cb, ca])):
        for x, y in zip(steady, moving):
            streams = tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y))
            with cache_rows([CacheRow(a), CacheRow(b), CacheRow(a)]):
                toy.seq(m, temb).run(streams)
    assert a.skipped > 0 and b.skipped == 0
    partial = [comps for rows, comps in seen if rows == 1]
    assert len(partial) == 2 * a.skipped  # two single blocks per call where only b computed
    assert all(comps == (cb,) for comps in partial)
    assert all(comps == (ca, cb, ca) for rows, comps in seen if rows == 3)
