"""Sequence-parallel attention (Ulysses, ring, USP) on real gloo processes against one process.

Every layout gets the same random ``q``/``k``/``v`` (uneven chunks, some items with masked keys);
each rank attends its chunk and the gathered result must equal ``sdpa`` over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.distributed import ParallelLayout, launch_processes
from sglang.multimodal_gen.distributed.sequence import SeqSplit, even_split, sequence_split
from sglang.multimodal_gen.layers.attention import attention, sdpa_bshd

B, S, H, D = 2, 23, 4, 8  # 23 tokens: no SP degree divides it


def _inputs(masked: bool):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 15:] = False  # item 1 is shorter: its last 8 keys are padding
    return q, k, v, mask


def _run(rank):
    """Both mask cases on this rank: ``(gathered outputs, local q tokens)``."""
    outs = []
    for masked in (False, True):
        q, k, v, mask = _inputs(masked)
        split = SeqSplit.of(S)
        ql, kl, vl = (split.local(t) for t in (q, k, v))
        ml = None if mask is None else split.local(mask)
        with sequence_split(split):
            out = attention(ql, kl, vl, ml)
        assert out.shape[1] == ql.shape[1] == split.sizes[split.rank]
        outs.append(split.gather(out))
    return outs, ql.shape[1]


LAYOUTS = {
    "ulysses2": ParallelLayout(ulysses_degree=2),
    "ring3": ParallelLayout(ring_degree=3),
    "usp2x2": ParallelLayout(ulysses_degree=2, ring_degree=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sp_attention_matches_one_process(name):
    layout = LAYOUTS[name]
    refs = [sdpa_bshd(*_inputs(m)) for m in (False, True)]
    results = launch_processes(_run, layout.world_size, layout=layout)
    for r, (outs, local) in enumerate(results):
        # each rank held only its chunk of the 23 tokens
        assert local == even_split(S, layout.sp_degree)[r % layout.sp_degree] < S
        for out, ref, case in zip(outs, refs, ("nomask", "mask")):
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"rank {r} {case}")
    # a wrong combination (keys of one chunk only) is far from the reference
    q, k, v, _ = _inputs(False)
    half = sdpa_bshd(q[:, :12], k[:, :12], v[:, :12])
    assert (half - refs[0][:, :12]).abs().max() > 1e-2


def test_ulysses_refuses_indivisible_heads():
    with pytest.raises(RuntimeError, match="not divisible by ulysses_degree=3"):
        launch_processes(_run, 3, layout=ParallelLayout(ulysses_degree=3))


def test_block_kernel_with_lse_equals_explicit_softmax():
    """The fused CPU kernel's log-sum-exp path (ring blocks) equals the fp32 math fallback,
    including a batch item whose block has no valid key (lse -inf, weight 0 in the merge)."""
    from sglang.multimodal_gen.layers.attention import _block_attention, _math_block, _merge

    q, k, v, _ = _inputs(False)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1] = False
    out, lse = _block_attention(qh, kh, vh, mask)
    out_m, lse_m = _math_block(qh, kh, vh, mask)
    torch.testing.assert_close(out[0], out_m[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0], lse_m[0], rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[1]).all() and torch.isinf(lse_m[1]).all()
    # merging two halves of the keys = attention over all of them
    a = _block_attention(qh, kh[:, :, :10], vh[:, :, :10], None)
    b = _block_attention(qh, kh[:, :, 10:], vh[:, :, 10:], None)
    merged, _ = _merge(*a, *b)
    full = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)
