"""Whole-block ``torch.compile`` of every family with LoRA: one graph, no graph break, no
recompile when adapters change, and the compiled output equals eager.

For each family (tiny DiTs of ``fixtures/compile_blocks.py``: Z-Image, Flux, Qwen-Image, Wan,
HunyuanVideo, LTX-2) every linear layer is wrapped for LoRA and holds three random adapters; the
first block of each block class is compiled with ``fullgraph=True`` (a graph break is an error)
and the ``CompileCounter`` backend (dynamo's tracing and guards, the frames it compiles counted,
no code generation). After one warm-up call (nothing active) the block serves the 20 LoRA states
of ``CHANGES``: set / unset / switch adapters, strengths, merged and unmerged, a mapping for every
row, two rows with different compositions. Asserted: one frame per block class in all (zero
recompiles after the warm-up) and each compiled output within 45 dB of the eager block under the
same state, while the states themselves are far apart (each non-empty state moves the output
below 45 dB of the no-LoRA output), so a compiled block that kept an old state fails.

Measured (fp32, torch 2.13 CPU): one frame per block class for every family; the worst compiled
vs eager PSNR over the 20 states is 139 dB (Z-Image) .. 154 dB; the states are 20-45 dB from the
no-LoRA output. With inductor (extended tier) the compiled block is >= 100 dB from eager.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.compile_blocks import (
    CHANGES,
    FAMILIES,
    block_inputs,
    first_tensor,
    lora_model,
    mapping,
    psnr,
    set_active,
)
from torch._dynamo.testing import CompileCounter

MIN_PSNR = 45.0


def _state(layers, ctx, pairs, merged, rows):
    set_active(layers, pairs, merged)
    return ctx.rows(None if rows is None else mapping(layers, *rows))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_changes_do_not_recompile(family):
    model, run, layers, ctx = lora_model(family)
    blocks = block_inputs(model, run)
    assert blocks, family
    for name, (block, args, kwargs) in blocks.items():
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(block, backend=counter, fullgraph=True)
        set_active(layers, [])
        with torch.no_grad():
            plain = first_tensor(block(*args, **kwargs))
            compiled(*args, **kwargs)  # warm-up
        assert counter.frame_count == 1, (family, name, counter.frame_count)
        for pairs, merged, rows in CHANGES:
            with torch.no_grad(), _state(layers, ctx, pairs, merged, rows):
                got = first_tensor(compiled(*args, **kwargs))
                want = first_tensor(block(*args, **kwargs))
            what = f"{family} {name} {pairs} merged={merged} rows={rows}"
            assert psnr(got, want) >= MIN_PSNR, f"{what}: {psnr(got, want):.1f} dB"
            if pairs or rows:  # the state matters: it moves the output
                assert psnr(want, plain) < MIN_PSNR, f"{what}: no LoRA effect"
        assert counter.frame_count == 1, (family, name, counter.frame_count)
        set_active(layers, [])
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inductor_block_equals_eager(family):
    """Inductor's code for the traced block (merged, two rows of other compositions, offsets)."""
    model, run, layers, ctx = lora_model(family)
    torch._dynamo.reset()
    for name, (block, args, kwargs) in block_inputs(model, run).items():
        compiled = torch.compile(block, fullgraph=True)
        for pairs, merged, rows in (CHANGES[12], CHANGES[16]):
            with torch.no_grad(), _state(layers, ctx, pairs, merged, rows):
                got = first_tensor(compiled(*args, **kwargs))
                want = first_tensor(block(*args, **kwargs))
            assert psnr(got, want) >= MIN_PSNR, f"{family} {name}: {psnr(got, want):.1f} dB"
        set_active(layers, [])
    torch._dynamo.reset()


def _tp_rank_fn(rank):
    from sglang.multimodal_gen.distributed import get_tp_world_size

    model, run, layers, ctx = lora_model("flux", tp_rank=rank, tp_size=2)
    out = {}
    for name, (block, args, kwargs) in block_inputs(model, run).items():
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(block, backend=counter, fullgraph=True)
        set_active(layers, [])
        worst = float("inf")
        with torch.no_grad():
            compiled(*args, **kwargs)
        for pairs, merged, rows in CHANGES[5:13]:
            with torch.no_grad(), _state(layers, ctx, pairs, merged, rows):
                got = first_tensor(compiled(*args, **kwargs))
                want = first_tensor(block(*args, **kwargs))
            worst = min(worst, psnr(got, want))
        set_active(layers, [])
        out[name] = (counter.frame_count, worst)
    return out, get_tp_world_size()


def test_tp2_collectives_trace_in_the_block():
    """TP 2 (gloo processes): the row-parallel all-reduce and the LoRA delta before it trace in
    one graph; 8 LoRA states after the warm-up, no recompile, compiled = eager on each rank."""
    from sglang.multimodal_gen.distributed import launch_processes

    for out, world in launch_processes(_tp_rank_fn, 2, backend="gloo"):
        assert world == 2
        for name, (frames, worst) in out.items():
            assert frames == 1, (name, frames)
            assert worst >= MIN_PSNR, (name, worst)
