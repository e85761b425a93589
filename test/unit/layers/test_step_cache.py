"""FBCache / DBCache on a toy block sequence against a direct implementation of their rule
(diffusers 0.42.1 ``hooks/first_block_cache.py``; cache-dit's DBCache for ``Fn``/``Bn``):
decisions per request in a batch, ``r_prev`` kept from the last computed step, residuals never
shared across LoRA compositions, the flag's refusals."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage
from sglang.multimodal_gen.layers.lora.composition import Composition, LoRAContext
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
    cache_rows,
)
from torch import nn

D, S_IMG, S_TXT = 8, 5, 3


class Dual(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.a = nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)
        self.b = nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)

    def forward(self, x, c):
        return x + torch.tanh(x @ self.a + c.mean(1, keepdim=True)), c + torch.tanh(c @ self.b)


class Single(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)

    def forward(self, h, temb):
        return h + torch.tanh(h @ self.w) * temb[:, None]


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.dual = nn.ModuleList(Dual(g) for _ in range(2))
    m.single = nn.ModuleList(Single(g) for _ in range(2))
    return m


def _seq(m, temb):
    return BlockSequence(
        owner=m,
        stages=(
            BlockStage(m.dual, lambda b, s, a: b(s[0], s[1])),
            BlockStage(
                m.single,
                lambda b, s, a: (b(s[0], a["temb"]),),
                enter=lambda s: (torch.cat([s[1], s[0]], 1),),
                leave=lambda s: (s[0][:, S_TXT:], s[0][:, :S_TXT]),
            ),
        ),
        row_args={"temb": temb},
    )


def _reference(m, steps, temb, cfg: StepCacheConfig):
    """One request alone, the rule written out: ``steps`` is a list of ``(x, c)``; returns the
    outputs and the per-step decisions (True: computed)."""
    seq = _seq(m, temb)
    n = seq.num_blocks
    prev = res = None
    outs, decisions = [], []
    for k, streams in enumerate(steps):
        head = seq.run_range(streams, 0, cfg.fn)
        r = head[0] - streams[0]
        compute = k < cfg.warmup or prev is None
        if not compute:
            compute = ((r - prev).abs().mean() / prev.abs().mean()).item() > cfg.threshold
        if compute:
            mid = seq.run_range(head, cfg.fn, n - cfg.bn)
            res = tuple(a - b for a, b in zip(mid, head))
            prev = r
        else:
            mid = tuple(a + b for a, b in zip(res, head))
        outs.append(seq.run_range(mid, n - cfg.bn, n))
        decisions.append(compute)
    return outs, decisions


def _steps(seed, rows, drift, n=8):
    """Inputs of ``n`` steps drifting linearly by ``drift`` per step (``None``: new random
    inputs every step)."""
    g = torch.Generator().manual_seed(seed)
    if drift is None:
        return [
            (torch.randn(rows, S_IMG, D, generator=g), torch.randn(rows, S_TXT, D, generator=g))
            for _ in range(n)
        ]
    x, c = torch.randn(rows, S_IMG, D, generator=g), torch.randn(rows, S_TXT, D, generator=g)
    dx, dc = torch.randn(x.shape, generator=g), torch.randn(c.shape, generator=g)
    return [(x + drift * k * dx, c + drift * k * dc) for k in range(n)]


def _ours(m, steps, temb, rows):
    outs = []
    for streams in steps:
        with cache_rows(rows):
            outs.append(_seq(m, temb).run(streams))
    return outs


FB = StepCacheConfig.of("fbcache", threshold=0.1)


@pytest.mark.parametrize(
    "cfg", [FB, StepCacheConfig.of("dbcache", threshold=0.1, fn=1, bn=1, warmup=2)],
    ids=["fbcache", "dbcache-F1B1-warmup2"],
)  # fmt: skip
def test_one_request_follows_the_rule(cfg):
    m = _model()
    temb = torch.tensor([[1.5] * D, [0.7] * D])
    steps = _steps(1, 2, drift=0.04)
    want, decisions = _reference(m, steps, temb, cfg)
    # the case holds skipped steps AND computed steps after skipped ones (so a wrong r_prev
    # shows): r_prev stays at the last computed step until the drift adds up
    assert decisions[0] and not all(decisions)
    assert any(not a and b for a, b in zip(decisions, decisions[1:]))
    cache = RequestCache(cfg)
    got = _ours(m, steps, temb, [CacheRow(cache)] * 2)
    for a, b in zip(got, want):
        for s, t in zip(a, b):
            torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-6)
    assert cache.computed == sum(decisions) and cache.skipped == len(steps) - sum(decisions)
    mid = 4 - cfg.fn - cfg.bn
    assert cache.blocks_skipped == cache.skipped * mid
    assert cache.blocks_computed == cache.computed * 4 + cache.skipped * (cfg.fn + cfg.bn)
    # caching changes the output: the uncached run differs on a skipped step
    k = decisions.index(False)
    plain = _seq(m, temb).run(steps[k])
    assert (plain[0] - got[k][0]).abs().max() > 1e-4


def test_each_request_of_a_batch_decides_alone():
    """A steady request (skips) and a moving one (computes every step) share every call; each
    gets what it gets alone, and the calls run the middle blocks on the moving rows only."""
    m = _model()
    steady, moving = _steps(1, 2, drift=0.04), _steps(2, 1, drift=None)
    t_s, t_m = torch.tensor([[1.5] * D, [0.7] * D]), torch.tensor([[1.1] * D])
    want_s, dec_s = _reference(m, steady, t_s, FB)
    want_m, dec_m = _reference(m, moving, t_m, FB)
    assert all(dec_m) and not all(dec_s)
    a, b = RequestCache(FB), RequestCache(FB)
    rows = [CacheRow(a), CacheRow(b), CacheRow(a)]  # interleaved: rows 0, 2 are the steady one
    temb = torch.cat([t_s[:1], t_m, t_s[1:]])
    batch = [
        tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y)) for x, y in zip(steady, moving)
    ]
    got = _ours(m, batch, temb, rows)
    for k in range(len(batch)):
        for s, w_s, w_m in zip(got[k], want_s[k], want_m[k]):
            torch.testing.assert_close(s[[0, 2]], w_s, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s[1:2], w_m, rtol=1e-5, atol=1e-6)
    assert (a.computed, b.computed) == (sum(dec_s), len(batch))


def test_padding_from_another_request_changes_no_decision():
    """``lengths``: a request's statistic covers its own tokens, not the batch's padding."""
    m = _model()
    temb = torch.ones(1, D)
    steps = _steps(3, 1, drift=0.04)
    cache_alone, cache_batched = RequestCache(FB), RequestCache(FB)
    for x, c in steps:
        with cache_rows([CacheRow(cache_alone)]):
            _seq(m, temb).run((x[:, :3], c))
        padded = torch.cat([x[:, :3], torch.zeros(1, 2, D) + 5.0], 1)  # 2 padding tokens
        seq = _seq(m, temb)
        seq.lengths = [3]
        with cache_rows([CacheRow(cache_batched)]):
            seq.run((padded, c))
    assert cache_alone.summary() == cache_batched.summary()
    assert 0 < cache_alone.skipped < len(steps)


def test_a_new_lora_composition_never_reuses_a_residual():
    m = _model()
    m.lora_context = LoRAContext("transformer")
    temb = torch.ones(2, D)
    steps = _steps(1, 2, drift=0.0)  # the same input every step: would skip from step 1 on
    cache = RequestCache(FB)
    _ours(m, steps[:3], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (1, 2)
    m.lora_context.active = Composition.of([(1, 0.5)])
    _ours(m, steps[:2], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (2, 3)  # computed again under the new one
    # another branch context or another denoiser: its own state too
    _ours(m, steps[:1], temb, [CacheRow(cache, "uncond")] * 2)
    _ours(_model(), steps[:1], temb, [CacheRow(cache)] * 2)
    assert cache.computed == 4


def test_config_presets_and_refusals():
    assert StepCacheConfig.of("fbcache") == StepCacheConfig("fbcache", 0.05, 1, 0, 0)
    assert StepCacheConfig.of("dbcache") == StepCacheConfig("dbcache", 0.08, 8, 0, 8)
    assert not StepCacheConfig.of("none").enabled
    for name in ("teacache", "magcache", "taylorseer"):
        with pytest.raises(ValueError, match=f"--cache-method '{name}' is not implemented yet"):
            StepCacheConfig.of(name)
    with pytest.raises(ValueError, match="--cache-method 'fastcache' is unknown"):
        StepCacheConfig.of("fastcache")
    with pytest.raises(ValueError, match="--cache-fn must be >= 1, got 0"):
        StepCacheConfig.of("dbcache", fn=0)
    m = _model()
    with pytest.raises(
        ValueError, match="Fn=3 \\+ Bn=1 leaves no block to cache in a sequence of 4"
    ):
        _ours(m, _steps(1, 1, 0.1, n=1), torch.ones(1, D),
              [CacheRow(RequestCache(StepCacheConfig.of("dbcache", fn=3, bn=1)))])  # fmt: skip


def test_a_call_of_some_rows_narrows_the_lora_row_mapping(monkeypatch):
    """Requests with other adapters share a call; when only some compute, the middle blocks run
    on their rows with their rows' compositions (a LoRA layer needs one per input row)."""
    from sglang.multimodal_gen.layers.lora.composition import RowMapping

    m = _model()
    ctx = m.lora_context = LoRAContext("transformer")
    ca, cb = Composition.of([(1, 0.5)]), Composition.of([(2, 1.0)])
    seen = []
    forward = Single.forward

    def recording(self, h, temb):
        seen.append((h.shape[0], None if ctx.mapping is None else ctx.mapping.compositions))
        return forward(self, h, temb)

    monkeypatch.setattr(Single, "forward", recording)
    steady, moving = _steps(1, 2, drift=0.04), _steps(2, 1, drift=None)
    a, b = RequestCache(FB), RequestCache(FB)
    temb = torch.ones(3, D)
    with ctx.rows(RowMapping.of([ca, cb, ca])):
        for x, y in zip(steady, moving):
            streams = tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y))
            with cache_rows([CacheRow(a), CacheRow(b), CacheRow(a)]):
                _seq(m, temb).run(streams)
    assert a.skipped > 0 and b.skipped == 0
    partial = [comps for rows, comps in seen if rows == 1]
    assert len(partial) == 2 * a.skipped  # two single blocks per call where only b computed
    assert all(comps == (cb,) for comps in partial)
    assert all(comps == (ca, cb, ca) for rows, comps in seen if rows == 3)
