"""FBCache / DBCache on a toy block sequence against a direct implementation of their rule
(diffusers 0.42.1 ``hooks/first_block_cache.py``; cache-dit's DBCache for ``Fn``/``Bn`` and its
step limits):
``r_prev`` kept from the last computed step, both streams cached, decisions per request in a
batch."""

from __future__ import annotations

import pytest
import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
)


def _reference(m, steps, temb, cfg: StepCacheConfig):
    """One request alone, the rule written out: ``steps`` is a list of ``(x, c)``; returns the
    outputs and the per-step decisions (True: computed)."""
    seq = toy.seq(m, temb)
    n = seq.num_blocks
    prev = res = None
    cached = continuous = 0  # cache-dit's step limits: skipped calls, in all and in a row
    limits = cfg.max_cached_steps, cfg.max_continuous_cached_steps
    outs, decisions = [], []
    for k, streams in enumerate(steps):
        head = seq.run_range(streams, 0, cfg.fn)
        r = head[0] - streams[0]
        compute = k < cfg.warmup or prev is None
        compute = compute or any(
            lim is not None and n >= lim for n, lim in zip((cached, continuous), limits)
        )
        if not compute:
            compute = ((r - prev).abs().mean() / prev.abs().mean()).item() > cfg.threshold
        cached, continuous = (cached, 0) if compute else (cached + 1, continuous + 1)
        if compute:
            mid = seq.run_range(head, cfg.fn, n - cfg.bn)
            res = tuple(a - b for a, b in zip(mid, head))
            prev = r
        else:
            mid = tuple(a + b for a, b in zip(res, head))
        outs.append(seq.run_range(mid, n - cfg.bn, n))
        decisions.append(compute)
    return outs, decisions


FB = StepCacheConfig.of("fbcache", threshold=0.1)


@pytest.mark.parametrize(
    "cfg", [FB, StepCacheConfig.of("dbcache", threshold=0.1, fn=1, bn=1, warmup=2)],
    ids=["fbcache", "dbcache-F1B1-warmup2"],
)  # fmt: skip
def test_one_request_follows_the_rule(cfg):
    m = toy.model()
    temb = torch.tensor([[1.5] * toy.D, [0.7] * toy.D])
    steps = toy.steps(1, 2, drift=0.04)
    want, decisions = _reference(m, steps, temb, cfg)
    # the case holds skipped steps AND computed steps after skipped ones (so a wrong r_prev
    # shows): r_prev stays at the last computed step until the drift adds up
    assert decisions[0] and not all(decisions)
    assert any(not a and b for a, b in zip(decisions, decisions[1:]))
    cache = RequestCache(cfg)
    got = toy.ours(m, steps, temb, [CacheRow(cache)] * 2)
    for a, b in zip(got, want):
        for s, t in zip(a, b):
            torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-6)
    assert cache.computed == sum(decisions) and cache.skipped == len(steps) - sum(decisions)
    mid = 4 - cfg.fn - cfg.bn
    assert cache.blocks_skipped == cache.skipped * mid
    assert cache.blocks_computed == cache.computed * 4 + cache.skipped * (cfg.fn + cfg.bn)
    # caching changes the output: the uncached run differs on a skipped step
    k = decisions.index(False)
    plain = toy.seq(m, temb).run(steps[k])
    assert (plain[0] - got[k][0]).abs().max() > 1e-4


def test_each_request_of_a_batch_decides_alone():
    """A steady request (skips) and a moving one (computes every step) share every call; each
    gets what it gets alone, and the calls run the middle blocks on the moving rows only."""
    m = toy.model()
    steady, moving = toy.steps(1, 2, drift=0.04), toy.steps(2, 1, drift=None)
    t_s, t_m = torch.tensor([[1.5] * toy.D, [0.7] * toy.D]), torch.tensor([[1.1] * toy.D])
    want_s, dec_s = _reference(m, steady, t_s, FB)
    want_m, dec_m = _reference(m, moving, t_m, FB)
    assert all(dec_m) and not all(dec_s)
    a, b = RequestCache(FB), RequestCache(FB)
    rows = [CacheRow(a), CacheRow(b), CacheRow(a)]  # interleaved: rows 0, 2 are the steady one
    temb = torch.cat([t_s[:1], t_m, t_s[1:]])
    batch = [
        tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y)) for x, y in zip(steady, moving)
    ]
    got = toy.ours(m, batch, temb, rows)
    for k in range(len(batch)):
        for s, w_s, w_m in zip(got[k], want_s[k], want_m[k]):
            torch.testing.assert_close(s[[0, 2]], w_s, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s[1:2], w_m, rtol=1e-5, atol=1e-6)
    assert (a.computed, b.computed) == (sum(dec_s), len(batch))


@pytest.mark.parametrize(
    "limits, pattern",
    [
        (dict(max_continuous_cached_steps=2), "CSSCSSCS"),
        (dict(max_cached_steps=3), "CSSSCCCC"),
        (dict(max_cached_steps=3, max_continuous_cached_steps=1), "CSCSCSCC"),
        (dict(max_cached_steps=-1, max_continuous_cached_steps=-1), "CSSSSSSS"),  # no limit
    ],
)
def test_step_limits(limits, pattern):
    """cache-dit's ``max_cached_steps`` / ``max_continuous_cached_steps``: with a threshold every
    step passes, the limits alone decide which steps compute (C) or are skipped (S)."""
    cfg = StepCacheConfig.of("fbcache", threshold=10.0, **limits)
    m = toy.model()
    temb = torch.tensor([[1.5] * toy.D, [0.7] * toy.D])
    steps = toy.steps(1, 2, drift=0.04)
    want, decisions = _reference(m, steps, temb, cfg)
    assert "".join("C" if d else "S" for d in decisions) == pattern
    cache = RequestCache(cfg)
    got = toy.ours(m, steps, temb, [CacheRow(cache)] * 2)
    for a, b in zip(got, want):
        for s, t in zip(a, b):
            torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-6)
    assert (cache.computed, cache.skipped) == (pattern.count("C"), pattern.count("S"))
