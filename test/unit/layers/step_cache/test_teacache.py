"""TeaCache on a toy block sequence against its rule written out (ali-vilab/TeaCache,
TeaCache4FLUX: ``acc += np.poly1d(coefficients)(mean|m - m_prev| / mean|m_prev|)``, skip while
``acc < rel_l1_thresh``, compute and reset otherwise, the first and last steps forced, ``m_prev``
updated on every step, a skipped step adding the last computed residual), the polynomial
rescaling against ``np.poly1d``, the presets, the refusal of an undeclared family and the
accumulator kept only after the ranks' agreement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.configs.sampling_params import step_cache_value
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.block_sequence import ModulatedInput
from sglang.multimodal_gen.layers.step_cache import CacheRow, RequestCache, StepCacheConfig
from sglang.multimodal_gen.layers.step_cache import teacache as tc
from sglang.multimodal_gen.layers.step_cache.runner import cache_rows

COEFFS = (3.0, -1.0, 2.0, 0.05)  # a cubic: the rescaling is not the identity


def _modulated(s, a):
    return s[0] * (1 + a["temb"][:, None])


THRESH = 0.42
DECL = ModulatedInput(_modulated, COEFFS, threshold=THRESH, warmup=1)


def _seq(m, temb, decl=DECL):
    return dataclasses.replace(toy.seq(m, temb), modulated_input=decl)


def _reference(m, steps, temb, threshold, warmup, num_steps):
    """The rule written out for one request: ``(outputs, decisions, accumulated sums)``."""
    seq = _seq(m, temb)
    poly = np.poly1d(COEFFS)
    acc, prev, res = 0.0, None, None
    outs, decisions, sums = [], [], []
    for k, streams in enumerate(steps):
        cur = _modulated(streams, seq.row_args)
        if k < warmup or k == num_steps - 1:
            compute, acc = True, 0.0
        else:
            acc += poly(((cur - prev).abs().mean() / prev.abs().mean()).item())
            sums.append(acc)
            compute = not acc < threshold
            if compute:
                acc = 0.0
        prev = cur
        if compute:
            out = seq.run_range(streams, 0, seq.num_blocks)
            res = tuple(o - s for o, s in zip(out, streams))
        else:
            out = tuple(s + r for s, r in zip(streams, res))
        outs.append(out)
        decisions.append(compute)
    return outs, decisions, sums


def _ours(m, steps, temb, rows, decl=DECL):
    outs = []
    for streams in steps:
        with cache_rows(rows):
            outs.append(_seq(m, temb, decl).run(streams))
    return outs


@pytest.mark.parametrize(
    "coefficients", [COEFFS, (1.0, 0.0), (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82)]
)
def test_rescaled_is_np_poly1d(coefficients):
    for x in (0.0, 0.013, 0.2, 1.7):
        assert tc.rescaled(x, coefficients) == pytest.approx(np.poly1d(coefficients)(x), rel=1e-12)


@pytest.mark.parametrize(("warmup", "num_steps"), [(1, 8), (2, 8), (1, None)])
def test_one_request_follows_the_rule(warmup, num_steps):
    m = toy.model()
    temb = torch.tensor([[0.3] * toy.D, [0.9] * toy.D])
    steps = toy.steps(1, 2, drift=0.05)
    cfg = StepCacheConfig.of("teacache", warmup=warmup)
    want, decisions, sums = _reference(m, steps, temb, THRESH, warmup, num_steps or 0)
    assert decisions[:warmup] == [True] * warmup and not all(decisions)
    # an accumulated sum reached the threshold although that step's own change did not: the
    # accumulator (not a per-step comparison) decides
    assert any(not b < THRESH and b - a < THRESH for a, b in zip(sums, sums[1:]) if a < THRESH)
    assert all(abs(s - THRESH) > 0.05 for s in sums)
    if num_steps and warmup == 1:  # the last step computes where the rule alone skips it
        free = _reference(m, steps, temb, THRESH, warmup, 0)[1]
        assert decisions[-1] and not free[-1] and decisions[:-1] == free[:-1]
    cache = RequestCache(cfg, num_steps=num_steps)
    got = _ours(m, steps, temb, [CacheRow(cache)] * 2)
    for a, b in zip(got, want):
        for s, t in zip(a, b):
            torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-6)
    assert cache.computed == sum(decisions) and cache.skipped == len(steps) - sum(decisions)


def test_first_and_last_steps_are_forced():
    m = toy.model()
    temb = torch.ones(1, toy.D)
    steps = toy.steps(2, 1, drift=0.05, n=6)
    for num_steps, last in ((6, True), (None, False)):
        cache = RequestCache(StepCacheConfig.of("teacache", threshold=1e9), num_steps=num_steps)
        for streams in steps:
            with cache_rows([CacheRow(cache)]):
                _seq(m, temb).run(streams)
        # threshold 1e9: only the forced steps compute
        assert (cache.computed, cache.skipped) == (1 + last, 5 - last)


def test_family_threshold_and_warmup_are_the_defaults():
    cfg = StepCacheConfig.of("teacache")
    assert (cfg.threshold, cfg.warmup, cfg.fn, cfg.bn) == (None, None, 0, 0)
    assert StepCacheConfig.of("teacache", threshold=0.25, warmup=3).threshold == 0.25
    with pytest.raises(ValueError, match="--cache-fn does not apply to --cache-method teacache"):
        StepCacheConfig.of("teacache", fn=1)
    assert step_cache_value("teacache") == cfg
    assert step_cache_value({"method": "teacache", "threshold": 0.4}).threshold == 0.4
    with pytest.raises(InvalidRequestError, match="cache.threshold must be >= 0"):
        step_cache_value({"method": "teacache", "threshold": -1})
    # the declaration's threshold decides when none is given: 1e9 skips every unforced step
    m, temb = toy.model(), torch.ones(1, toy.D)
    cache = RequestCache(cfg, num_steps=None)
    high = dataclasses.replace(DECL, threshold=1e9)
    _ours(m, toy.steps(3, 1, drift=0.05, n=4), temb, [CacheRow(cache)], decl=high)
    assert (cache.computed, cache.skipped) == (1, 3)


def test_a_sequence_without_the_declaration_is_refused():
    m = toy.model()
    cache = RequestCache(StepCacheConfig.of("teacache"))
    with pytest.raises(ValueError, match="--cache-method teacache: Module declares no modulated"):
        _ours(m, toy.steps(1, 1, drift=0.05, n=1), torch.ones(1, toy.D), [CacheRow(cache)], None)


def test_the_accumulator_is_kept_after_the_agreement(monkeypatch):
    """Another rank asking to compute (the agreement's maximum) resets this rank's accumulator:
    every rank keeps the same one."""
    m, temb = toy.model(), torch.ones(1, toy.D)
    steps = toy.steps(4, 1, drift=0.05, n=3)
    cache = RequestCache(StepCacheConfig.of("teacache", threshold=1e9), num_steps=None)
    accs = []
    for streams in steps:
        with cache_rows([CacheRow(cache)]):
            _seq(m, temb).run(streams)
        accs.append(next(iter(cache.states.values())).accumulated)
    assert accs[0] == 0 and accs[2] > accs[1] > 0  # alone: skipped steps accumulate

    def others_compute(groups, flags, device):
        for g in groups:
            g.compute = True

    monkeypatch.setattr(tc, "agree_to_compute", others_compute)
    with cache_rows([CacheRow(cache)]):
        _seq(m, temb).run(steps[-1])
    assert next(iter(cache.states.values())).accumulated == 0.0
    assert cache.computed == 2
