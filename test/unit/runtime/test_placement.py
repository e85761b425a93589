"""``compile_blocks``: the blocks of a model's ``ModuleList`` s (class names ending in ``Block``)
are compiled, nothing else; with ``fullgraph=True`` (the default) a graph break is an error, not
a silent split of the block into pieces; dynamo's recompile limit is raised (reaching it under
``fullgraph=True`` is an error)."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.runtime.placement import RECOMPILE_LIMIT, compile_blocks
from torch._dynamo.testing import CompileCounter


class ToyBlock(torch.nn.Module):
    def __init__(self, breaks: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.breaks = breaks

    def forward(self, x):
        y = self.lin(x)
        if self.breaks:
            torch._dynamo.graph_break()
        return torch.relu(y)


class Other(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _model(breaks: bool = False):
    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList([ToyBlock(breaks), ToyBlock(breaks), Other()])
    m.head = ToyBlock(breaks)  # not in a ModuleList: left alone
    return m


def test_blocks_only_and_one_graph_for_equal_blocks():
    torch._dynamo.reset()
    counter = CompileCounter()
    m = _model()
    assert compile_blocks(m, backend=counter) == 2
    assert m.blocks[0]._compiled_call_impl is not None
    assert m.blocks[2]._compiled_call_impl is None and m.head._compiled_call_impl is None
    x = torch.randn(3, 4)
    with torch.no_grad():
        for b in m.blocks[:2]:
            torch.testing.assert_close(b(x), b.forward(x))
    assert counter.frame_count == 1  # both blocks: one graph
    # a server compiles many shape / LoRA variants: more than dynamo's default limit of 8
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    torch._dynamo.reset()


def test_fullgraph_refuses_a_graph_break():
    torch._dynamo.reset()
    m = _model(breaks=True)
    compile_blocks(m, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported):
        m.blocks[0](torch.randn(3, 4))
    torch._dynamo.reset()
    m = _model(breaks=True)
    compile_blocks(m, fullgraph=False, backend="eager")
    m.blocks[0](torch.randn(3, 4))  # split into pieces, silently
    torch._dynamo.reset()
