"""MagCache on a toy block sequence: the same decisions and outputs as diffusers' own
``apply_mag_cache`` hooks (0.42.1) on the same blocks, for knobs that exercise each part of the
rule (the retention of the first steps, the accumulated error against the threshold, the cap of
consecutive skips, ratios resampled to the step count); the calibration mode measures diffusers'
ratios; requests of one call each get what they get alone."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
    cache_rows,
)
from sglang.multimodal_gen.layers.step_cache.mag_ratios import MagRatios
from torch import nn

D, S, N = 8, 6, 10


class Block(nn.Module):
    """``x + tanh(x @ w) * s``: one block (``hidden_states [B, S, D]``), random weights."""

    def __init__(self, g):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)

    def forward(self, hidden_states):
        return hidden_states + torch.tanh(hidden_states @ self.w)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.transformer_blocks = nn.ModuleList(Block(g) for _ in range(3))
    return m


def _inputs(seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    x, dx = torch.randn(rows, S, D, generator=g), torch.randn(rows, S, D, generator=g)
    return [x + 0.3 * k * dx for k in range(N)]


def _diffusers(m, xs, ratios, **knobs):
    """diffusers' hooks on ``m``'s blocks: outputs and whether each step computed."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.hooks.mag_cache import MagCacheConfig, apply_mag_cache

    TransformerBlockRegistry.register(Block, TransformerBlockMetadata(_cls=Block))
    apply_mag_cache(
        m, MagCacheConfig(num_inference_steps=N, mag_ratios=torch.tensor(ratios), **knobs)
    )
    outs, flags = [], []
    try:
        for x in xs:
            h = x
            for b in m.transformer_blocks:
                h = b(h)
            head = m.transformer_blocks[0]._diffusers_hook.get_hook("mag_cache_leader_block_hook")
            state = head.state_manager.get_state()
            flags.append(bool(state.should_compute))
            outs.append(h)
    finally:
        for b in m.transformer_blocks:
            reg = b._diffusers_hook
            for name in ("mag_cache_leader_block_hook", "mag_cache_block_hook"):
                if reg.get_hook(name) is not None:
                    reg.remove_hook(name)
    return outs, flags


def _seq(m):
    return BlockSequence(m, (BlockStage(m.transformer_blocks, lambda b, s, a: (b(s[0]),)),))


def _ours(m, xs, cache, rows=None):
    outs, flags = [], []
    for x in xs:
        before = cache.computed
        with cache_rows(rows or [CacheRow(cache)] * x.shape[0]):
            outs.append(_seq(m).run((x,))[0])
        flags.append(cache.computed > before)
    return outs, flags


def _cache(ratios, steps=N, calibrated_steps=None, **knobs):
    cfg = StepCacheConfig.of("magcache", **knobs)
    cal = MagRatios(calibrated_steps or len(ratios), {"blocks/0/cond": tuple(ratios)})
    return RequestCache(cfg, num_steps=steps, calibration=cal)


CASES = [  # (ratios, knobs, diffusers' knobs, computed steps)
    pytest.param(
        [1.0] * N, dict(max_skip_steps=2), dict(max_skip_steps=2),
        [True, True, False, False, True, False, False, True, False, False], id="max-skip",
    ),
    pytest.param(
        [1.0, 0.99, 0.98, 0.97, 0.97, 1.05, 0.96, 0.95, 0.9, 0.85], dict(threshold=0.08),
        dict(threshold=0.08),
        [True, True, False, False, True, False, False, True, True, True], id="accumulated-error",
    ),
    pytest.param(
        [1.0] * N, dict(retention_ratio=0.25, max_skip_steps=3),
        dict(retention_ratio=0.25, max_skip_steps=3),
        [True] * 3 + [False, False, False, True, False, False, False], id="retention",
    ),
    pytest.param(  # 4 calibrated ratios resampled to 10 steps (diffusers' nearest_interp)
        [1.0, 0.99, 0.9, 0.99], dict(threshold=0.05),
        dict(threshold=0.05),
        [True, True, False, False, True, True, True, True, False, False], id="resampled",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("ratios", "knobs", "ref_knobs", "expected"), CASES)
def test_decisions_and_outputs_match_diffusers(ratios, knobs, ref_knobs, expected):
    m, xs = _model(), _inputs(1)
    ref, ref_flags = _diffusers(m, xs, ratios, **ref_knobs)
    got, flags = _ours(m, xs, _cache(ratios, **knobs))
    assert ref_flags == expected  # the case exercises what its name says
    assert flags == ref_flags
    for k, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {k}")
    plain = [_seq(m).run((x,))[0] for x in xs]
    assert not all(map(torch.equal, got, plain))  # skipping changed the outputs


def test_calibration_measures_diffusers_ratios():
    from diffusers.hooks import mag_cache as mc

    m, xs = _model(2), _inputs(3, rows=2)
    seen: list[float] = []
    orig = mc.MagCacheBlockHook._perform_calibration_step

    def spy(self, state, residual):
        orig(self, state, residual)
        seen.append(state.calibration_ratios[-1])

    mc.MagCacheBlockHook._perform_calibration_step = spy
    try:
        from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

        TransformerBlockRegistry.register(Block, TransformerBlockMetadata(_cls=Block))
        mc.apply_mag_cache(m, mc.MagCacheConfig(calibrate=True, num_inference_steps=N))
        for x in xs:
            h = x
            for b in m.transformer_blocks:
                h = b(h)
    finally:
        mc.MagCacheBlockHook._perform_calibration_step = orig
        for b in m.transformer_blocks:
            for name in ("mag_cache_leader_block_hook", "mag_cache_block_hook"):
                if b._diffusers_hook.get_hook(name) is not None:
                    b._diffusers_hook.remove_hook(name)
    cache = RequestCache(StepCacheConfig.of("magcache", calibrate=True), num_steps=N)
    _, flags = _ours(m, xs, cache)
    assert all(flags)
    got = cache.summary()["mag_ratios"]["blocks/0/cond"]
    assert len(seen) == N and seen[0] == 1.0 and len(set(seen)) > 3
    assert got == pytest.approx(seen, rel=1e-6)


def test_requests_in_one_call_each_get_what_they_get_alone():
    m = _model()
    a_in, b_in = _inputs(1), _inputs(5)
    ra, rb = [1.0] * N, [1.0, 0.9, 0.95, 1.0, 1.0, 0.97, 1.0, 1.0, 1.0, 1.0]
    alone_a, fa = _ours(m, a_in, _cache(ra, max_skip_steps=2))
    alone_b, fb = _ours(m, b_in, _cache(rb, threshold=0.05))
    ca, cb = _cache(ra, max_skip_steps=2), _cache(rb, threshold=0.05)
    rows = [CacheRow(ca), CacheRow(cb)]
    both, _ = _ours(m, [torch.cat([a, b]) for a, b in zip(a_in, b_in)], ca, rows)
    assert fa != fb  # the two requests decide differently
    for k, o in enumerate(both):
        torch.testing.assert_close(o[:1], alone_a[k], rtol=0, atol=1e-6, msg=f"a, step {k}")
        torch.testing.assert_close(o[1:], alone_b[k], rtol=0, atol=1e-6, msg=f"b, step {k}")
    assert (ca.skipped, cb.skipped) == (fa.count(False), fb.count(False))


def test_without_ratios_a_request_fails_naming_the_flag():
    cache = RequestCache(StepCacheConfig.of("magcache"), num_steps=N)
    with pytest.raises(ValueError, match="--cache-mag-ratios FILE, or sglang calibrate-cache"):
        _ours(_model(), _inputs(1)[:1], cache)
