"""TaylorSeer on toy block sequences: the schedule is diffusers' (0.42.1
``TaylorSeerCacheHook``), the expansion is diffusers' ``TaylorSeerState`` (fed the same values),
a polynomial trajectory of the cached quantity is extrapolated exactly to the order the rule is
exact for (order 0: constants, order 1: lines), and requests of one call with different methods
each get what they get alone."""

from __future__ import annotations

import pytest
import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
    cache_rows,
)
from sglang.multimodal_gen.layers.step_cache.taylorseer import taylor_computes
from torch import nn

D = 6


class Poly(nn.Module):
    """``x + c_0 + c_1 t + c_2 t**2`` (``t``: the row's step index ``[B]``)."""

    def __init__(self, g, degree):
        super().__init__()
        self.c = nn.Parameter(torch.randn(3, D, generator=g))
        self.c.data[degree + 1 :] = 0

    def forward(self, x, t):
        t = t[:, None, None]
        return x + self.c[0] + self.c[1] * t + self.c[2] * t**2


def _poly_model(degree):
    g = torch.Generator().manual_seed(degree)
    owner = nn.Module()
    owner.blocks = nn.ModuleList([Poly(g, degree), Poly(g, degree), nn.Tanh()])
    return owner


def _poly_seq(owner, t):
    """The sequence of ``owner``'s blocks at step indices ``t`` (``[B]``)."""

    def call(b, s, a):
        return (b(s[0], a["t"]) if isinstance(b, Poly) else b(s[0]),)

    return BlockSequence(owner, (BlockStage(owner.blocks, call),), row_args={"t": t})


def _run(seq_of, inputs, cfg):
    """Ours over the steps (``seq_of(k)``: the sequence of step ``k``): outputs, computed flags."""
    cache = RequestCache(cfg)
    outs, flags = [], []
    for k, x in enumerate(inputs):
        before = cache.computed
        with cache_rows([CacheRow(cache)] * x[0].shape[0]):
            outs.append(seq_of(k).run(x))
        flags.append(cache.computed > before)
    return outs, flags


def test_schedule_is_diffusers():
    from diffusers.hooks.hooks import CacheContext, StateManager
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState

    for interval, before, after in ((5, 3, None), (3, 1, 11), (1, 0, None), (2, 4, 6)):
        sm = StateManager(TaylorSeerState, init_kwargs=dict(max_order=1))
        sm.set_context(CacheContext("cond"))
        hook = TaylorSeerCacheHook(interval, before, torch.float32, sm, after)
        want = [hook._measure_should_compute()[0] for _ in range(20)]
        cfg = StepCacheConfig.of("taylorseer", warmup=before, interval=interval, stop=after)
        assert [taylor_computes(t, cfg) for t in range(20)] == want
        # the runner follows it (the middle tanh makes the sequence nonlinear)
        seq = _poly_seq(_poly_model(1), torch.zeros(2))
        _, flags = _run(lambda k, seq=seq: seq, [(torch.randn(2, 4, D),)] * 20, cfg)
        assert flags == want


@pytest.mark.parametrize(
    "degree, order, target",
    [(0, 0, "residual"), (1, 1, "residual"), (1, 1, "output"), (1, 2, "residual")],
)
def test_a_polynomial_trajectory_is_extrapolated_exactly(degree, order, target):
    """The middle blocks (two ``Poly``) add a polynomial of the step index of degree ``degree``;
    Bn = 1 (a tanh) runs on the prediction. Residual target: new inputs every step; output target:
    one input (then the middle output is the polynomial)."""
    g = torch.Generator().manual_seed(5)
    n = 14
    x = [(torch.randn(2, 4, D, generator=g),) for _ in range(n)]
    if target == "output":
        x = [x[0]] * n
    owner = _poly_model(degree)
    seqs = [_poly_seq(owner, torch.full((2,), float(k))) for k in range(n)]
    cfg = StepCacheConfig.of("taylorseer", bn=1, warmup=2, interval=3, order=order, target=target)
    got, flags = _run(lambda k: seqs[k], x, cfg)
    assert 0 < sum(flags) < n
    for k in range(n):
        want = seqs[k].run(x[k])
        torch.testing.assert_close(got[k][0], want[0], rtol=1e-5, atol=1e-5)
    # an order below the degree is not exact: the cache does change the output
    if degree > 0:
        low = StepCacheConfig.of("taylorseer", bn=1, warmup=2, interval=3, order=degree - 1)
        got_low, _ = _run(lambda k: seqs[k], x, low)
        k = flags.index(False)
        assert (got_low[k][0] - seqs[k].run(x[k])[0]).abs().max() > 1e-2


@pytest.mark.parametrize("target", ["residual", "output"])
def test_the_expansion_is_diffusers_taylorseer_state(target):
    """Order 2 on the nonlinear two-stream toy (Flux's layout), Fn = 1: every prediction equals
    diffusers' ``TaylorSeerState`` (fp32 factors) fed the same per-stream values (middle output
    - head output, or middle output) at the same steps, plus the head output for a residual."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    m = toy.model()
    temb = torch.tensor([[1.5] * toy.D, [0.7] * toy.D])
    steps = toy.steps(1, 2, drift=0.05, n=12)
    cfg = StepCacheConfig.of("taylorseer", fn=1, warmup=3, interval=4, order=2, target=target)
    got, flags = _run(lambda k: toy.seq(m, temb), steps, cfg)
    ref = TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=2)
    seq = toy.seq(m, temb)
    for k, streams in enumerate(steps):
        ref.current_step = k
        head = seq.run_range(streams, 0, 1)
        if flags[k]:
            mid = seq.run_range(head, 1, 4)
            ref.update(tuple((a - b) if target == "residual" else a for a, b in zip(mid, head)))
        else:
            pred = ref.predict()
            mid = tuple((p + h) if target == "residual" else p for p, h in zip(pred, head))
        for a, b in zip(got[k], mid):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert flags.count(False) >= 3


def test_requests_with_different_methods_share_a_call():
    """A TaylorSeer request (rows 0, 2) and an FBCache one (row 1) in every call: each gets its
    outputs alone."""
    m = toy.model()
    a_steps, b_steps = toy.steps(1, 2, drift=0.04), toy.steps(2, 1, drift=0.04)
    t_a, t_b = torch.tensor([[1.5] * toy.D, [0.7] * toy.D]), torch.tensor([[1.1] * toy.D])
    ta = StepCacheConfig.of("taylorseer", fn=1, warmup=1, interval=3)
    fb = StepCacheConfig.of("fbcache", threshold=0.1)
    want_a, flags_a = _run(lambda k: toy.seq(m, t_a), a_steps, ta)
    want_b, flags_b = _run(lambda k: toy.seq(m, t_b), b_steps, fb)
    assert flags_a != flags_b and not all(flags_a) and not all(flags_b)
    a, b = RequestCache(ta), RequestCache(fb)
    temb = torch.cat([t_a[:1], t_b, t_a[1:]])
    for k, (x, y) in enumerate(zip(a_steps, b_steps)):
        streams = tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y))
        with cache_rows([CacheRow(a), CacheRow(b), CacheRow(a)]):
            out = toy.seq(m, temb).run(streams)
        for s, w_a, w_b in zip(out, want_a[k], want_b[k]):
            torch.testing.assert_close(s[[0, 2]], w_a, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s[1:2], w_b, rtol=1e-5, atol=1e-6)
    assert (a.computed, b.computed) == (sum(flags_a), sum(flags_b))
