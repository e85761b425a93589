"""The declared block sequence: a plain run is the plain loop, stages convert layouts, a row
subset narrows the row arguments, an interceptor replaces the run."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, intercept_blocks
from torch import nn


class Dual(nn.Module):
    def __init__(self, d, g):
        super().__init__()
        self.a = nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)
        self.b = nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)

    def forward(self, x, c, temb):
        return x + torch.tanh(x @ self.a) * temb[:, None], c + torch.tanh(c @ self.b)


class Single(nn.Module):
    def __init__(self, d, g):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)

    def forward(self, h, temb):
        return h + torch.tanh(h @ self.w) * temb[:, None]


def _model(d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.dual = nn.ModuleList(Dual(d, g) for _ in range(2))
    m.single = nn.ModuleList(Single(d, g) for _ in range(3))
    return m


def _sequence(m, temb, n_txt):
    return BlockSequence(
        owner=m,
        stages=(
            BlockStage(m.dual, lambda b, s, a: b(s[0], s[1], a["temb"])),
            BlockStage(
                m.single,
                lambda b, s, a: (b(s[0], a["temb"]),),
                enter=lambda s: (torch.cat([s[1], s[0]], 1),),
                leave=lambda s: (s[0][:, n_txt:], s[0][:, :n_txt]),
            ),
        ),
        row_args={"temb": temb},
    )


def _plain(m, x, c, temb):
    for b in m.dual:
        x, c = b(x, c, temb)
    h = torch.cat([c, x], 1)
    for b in m.single:
        h = b(h, temb)
    return h[:, c.shape[1] :], h[:, : c.shape[1]]


def _inputs(seed=1, b=3):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 5, 8, generator=g),
        torch.randn(b, 4, 8, generator=g),
        1 + torch.rand(b, 8, generator=g),
    )


def test_run_is_the_plain_loop_bit_for_bit():
    m = _model()
    x, c, temb = _inputs()
    seq = _sequence(m, temb, 4)
    assert seq.num_blocks == 5
    got = seq.run((x, c))
    want = _plain(m, x, c, temb)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # split at every block boundary, inside and across stages: the same numbers
    for cut in range(6):
        mid = seq.run_range((x, c), 0, cut)
        for a, b in zip(seq.run_range(mid, cut, 5), want):
            assert torch.equal(a, b)
    # the stage enter/leave matter: without the single stage the output differs
    assert not torch.equal(seq.run_range((x, c), 0, 2)[0], want[0])


def test_select_rows_narrows_the_row_arguments():
    m = _model()
    x, c, temb = _inputs()
    seq = _sequence(m, temb, 4)
    full = seq.run((x, c))
    idx = torch.tensor([2, 0])
    part = seq.select_rows(idx).run((x[idx], c[idx]))
    for a, b in zip(part, full):
        torch.testing.assert_close(a, b[idx], rtol=1e-6, atol=1e-6)
    # the row arguments really are narrowed (row 0's temb on row 2 gives another output)
    wrong = _sequence(m, temb[:2], 4).run((x[idx], c[idx]))  # rows 0, 1's temb
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong[0], full[0][idx])


def test_interceptor_replaces_the_run_and_bad_ranges_fail():
    m = _model()
    x, c, temb = _inputs()
    seq = _sequence(m, temb, 4)
    seen = []

    def spy(s, streams):
        seen.append(s)
        return tuple(t * 0 for t in streams)

    with intercept_blocks(spy):
        out = seq.run((x, c))
    assert seen == [seq] and float(out[0].abs().sum()) == 0
    assert not torch.equal(seq.run((x, c))[0], out[0])  # gone after the block
    with pytest.raises(ValueError, match="block range 3:6 of a sequence of 5 blocks"):
        seq.run_range((x, c), 3, 6)


def test_variant_names_flags_and_cacheable_false_runs_plainly():
    assert BlockSequence.variant("blocks") == "blocks"
    assert BlockSequence.variant("blocks", stg=(), isolate=False, mask=None) == "blocks"
    named = BlockSequence.variant("blocks", stg=(3, 1), isolate=True)
    assert named == "blocks[isolate=True,stg=(3, 1)]"
    assert named != BlockSequence.variant("blocks", stg=(3,), isolate=True)
    m = _model()
    x, c, temb = _inputs()
    seq = _sequence(m, temb, 4)
    seq.cacheable = False
    seen = []
    with intercept_blocks(lambda s, streams: seen.append(s) or streams):
        out = seq.run((x, c))
    assert seen == [] and torch.equal(out[0], _plain(m, x, c, temb)[0])
    assert seq.select_rows(torch.tensor([1])).cacheable is False
