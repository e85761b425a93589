"""The row mapping as fixed-shape tensors (``RowStrengths``): values for uniform, mixed and no
mapping; in-place rewrites (the same tensor objects, so a compiled graph keeps reading them);
growth of the row capacity and the width only when needed; the context keeps it in step with
``LoRAContext.rows`` (restored on exit)."""

from __future__ import annotations

import torch
from sglang.multimodal_gen.layers.lora import Composition, LoRAContext, RowMapping
from sglang.multimodal_gen.layers.lora.row_strengths import ROWS_CAP, RowStrengths


def test_values_of_uniform_mixed_and_no_mapping():
    rs = RowStrengths()
    rs.set(RowMapping.whole([(1, 0.5), (3, -2.0)]))  # before reserve: remembered only
    assert rs.strengths is None
    rs.reserve(4, torch.device("cpu"), torch.float32)
    t, use = rs.strengths, rs.use_rows
    assert t.shape == (ROWS_CAP, 4) and use.item() == 1.0
    assert torch.equal(t, torch.tensor([[0.0, 0.5, 0.0, -2.0]]).expand(ROWS_CAP, 4))
    rs.set(RowMapping.of([[(0, 1.5)], [], [(2, 0.25), (9, 1.0)]]))  # slot 9: beyond the width
    assert rs.strengths is t and rs.use_rows is use  # rewritten in place
    want = torch.zeros(ROWS_CAP, 4)
    want[0, 0], want[2, 2] = 1.5, 0.25
    assert torch.equal(t, want) and use.item() == 1.0
    rs.set(None)
    assert torch.equal(t, torch.zeros(ROWS_CAP, 4)) and use.item() == 0.0


def test_rewrites_only_on_change_and_grows_only_when_needed():
    rs = RowStrengths()
    rs.reserve(2, torch.device("cpu"), torch.float32)
    m = RowMapping.of([[(0, 1.0)], [(1, 1.0)]])
    rs.set(m)
    n = rs.updates
    rs.set(m)
    assert rs.updates == n  # the same mapping: nothing written
    t = rs.strengths
    rs.reserve(2, torch.device("cpu"), torch.float32)
    assert rs.strengths is t  # nothing to grow
    rs.reserve(5, torch.device("cpu"), torch.float32)  # wider: reallocated, refilled
    assert rs.strengths.shape == (ROWS_CAP, 5) and rs.strengths[1, 1] == 1.0
    many = RowMapping.of([[(0, float(i))] for i in range(ROWS_CAP + 3)])
    rs.set(many)
    assert rs.strengths.shape[0] >= ROWS_CAP + 3 and rs.strengths[ROWS_CAP + 2, 0] == ROWS_CAP + 2
    rs.reserve(5, torch.device("cpu"), torch.float64)  # a float64 layer: more precise
    assert rs.strengths.dtype == torch.float64 and rs.strengths[3, 0] == 3.0


def test_the_context_keeps_it_in_step_with_rows():
    ctx = LoRAContext("t")
    ctx.row_strengths.reserve(3, torch.device("cpu"), torch.float32)
    outer = RowMapping.whole(Composition([(2, 0.75)]))
    with ctx.rows(outer):
        assert ctx.row_strengths.strengths[5, 2] == 0.75
        with ctx.rows(RowMapping.of([[(0, 1.0)], [(1, 2.0)]])):
            assert ctx.row_strengths.strengths[1, 1] == 2.0
            assert ctx.row_strengths.strengths[5].abs().sum() == 0
        assert ctx.row_strengths.strengths[5, 2] == 0.75  # restored
    assert ctx.row_strengths.use_rows.item() == 0.0
