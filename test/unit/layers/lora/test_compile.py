"""A compiled block with LoRA layers: switching adapters, strengths and compositions does not
recompile it (adapters and strengths reach the graph as tensors; only the number of adapters
in a composition is a shape), and the compiled output equals eager.

A small DiT-like block (a column-parallel projection, a GELU, a row-parallel projection) is
wrapped for LoRA, compiled with ``torch.compile`` (the ``eager`` backend: dynamo's tracing and
guards, no code generation), warmed up once per structure (one adapter, two adapters, merged),
then driven through 20 changes of the active adapter, its strength and the per-call row mapping.
"""

from __future__ import annotations

import torch
from sglang.multimodal_gen.layers.linear import ColumnParallelLinear, RowParallelLinear
from sglang.multimodal_gen.layers.lora import LoRAContext, RowMapping, wrap_with_lora
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights


class Block(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        ctx = LoRAContext("block")
        self.up = wrap_with_lora(
            ColumnParallelLinear(dim, hidden, tp_rank=0, tp_size=1), lora_context=ctx
        )
        self.down = wrap_with_lora(
            RowParallelLinear(hidden, dim, tp_rank=0, tp_size=1), lora_context=ctx
        )
        self.ctx = ctx

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)[0]))[0]


def _block() -> Block:
    torch.manual_seed(0)
    block = Block()
    gen = torch.Generator().manual_seed(1)
    for layer in (block.up, block.down):
        with torch.no_grad():  # parameters are created empty (loaded from a checkpoint)
            layer.base_layer.weight.copy_(torch.randn(layer.base_layer.weight.shape, generator=gen))
            layer.base_layer.weight.mul_(0.1)
            if layer.base_layer.bias is not None:
                layer.base_layer.bias.zero_()
        for slot, name in enumerate("abcd"):
            a = torch.randn(4, layer.base_layer.input_size, generator=gen) * 0.1
            b = torch.randn(layer.base_layer.output_size, 4, generator=gen) * 0.1
            layer.add_adapter(name, {None: LoRAWeights(a, b, 0.5)}, slot=slot)
    return block


def _rows(block, *pairs_per_row):
    return RowMapping.of([block.up.composition(p) for p in pairs_per_row])


def test_adapter_and_strength_changes_do_not_recompile():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    block = _block()
    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter)
    x = torch.randn(2, 8, 32)

    def run(mapping):
        with torch.no_grad(), block.ctx.rows(mapping):
            got, want = compiled(x), block(x)
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()

    # warm-up: one adapter, two adapters, nothing (the structures)
    run(_rows(block, [("a", 1.0)], [("a", 1.0)]))
    run(_rows(block, [("a", 1.0), ("b", 1.0)], [("a", 1.0), ("b", 1.0)]))
    run(None)
    warm = counter.frame_count
    gen = torch.Generator().manual_seed(2)
    for i in range(20):
        names = ["a", "b", "c", "d"]
        first = names[i % 4]
        s = float(torch.rand((), generator=gen) * 4 - 2)
        if i % 2:
            pairs = [(first, s)]
        else:
            pairs = [(first, s), (names[(i + 1) % 4], -s / 2)]
        run(_rows(block, pairs, pairs))
    assert counter.frame_count == warm, (warm, counter.frame_count)
    torch._dynamo.reset()
