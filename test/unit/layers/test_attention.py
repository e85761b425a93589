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


def _inputs(masked: bool, heads: int = H):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, S, heads, D, generator=g) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 15:] = False  # item 1 is shorter: its last 8 keys are padding
    return q, k, v, mask


def _run(rank, heads_cases=(H,)):
    """Every head count and both mask cases on this rank: ``(gathered outputs, local q tokens)``.
    Under TP each rank takes its TP rank's contiguous share of the heads (as the QKV projection
    gives it)."""
    from sglang.multimodal_gen.distributed import get_tp_rank, get_tp_world_size

    outs = []
    tp, tpr = get_tp_world_size(), get_tp_rank() if get_tp_world_size() > 1 else 0
    for heads in heads_cases:
        local = heads // tp
        for masked in (False, True):
            q, k, v, mask = _inputs(masked, heads)
            split = SeqSplit.of(S)
            ql, kl, vl = (split.local(t)[:, :, tpr * local : (tpr + 1) * local] for t in (q, k, v))
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


# Heads per TP rank that the Ulysses degree does not divide: split unevenly over the Ulysses
# ranks (6 over 4: 2, 2, 1, 1; 3 over 4: one rank attends none; 3 per TP rank over 2: 2, 1).
UNEVEN = {
    "ulysses4_h6_h3": (ParallelLayout(ulysses_degree=4), (6, 3)),
    "tp2_ulysses2_h6": (ParallelLayout(tp_size=2, ulysses_degree=2), (6,)),
    "usp2x2_h3": (ParallelLayout(ulysses_degree=2, ring_degree=2), (3,)),
}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_sp_attention_uneven_heads_matches_one_process(name):
    """Each head of the gathered output equals one-process attention over the whole sequence:
    the uneven head split keeps every head in its place (a head moved to a neighbour, or a rank
    that took the wrong heads, differs by far more than the bar)."""
    layout, heads_cases = UNEVEN[name]
    tp = layout.tp_size
    refs = []
    for heads in heads_cases:
        for m in (False, True):
            ref = sdpa_bshd(*_inputs(m, heads)).unflatten(-1, (heads, D))
            refs.append([ref[:, :, t * heads // tp : (t + 1) * heads // tp] for t in range(tp)])
    results = launch_processes(_run, layout.world_size, (heads_cases,), layout=layout)
    for r, (outs, _) in enumerate(results):
        assert len(outs) == len(refs)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            want = ref[r % tp].flatten(2)
            assert out.shape == want.shape, (r, i)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"rank {r} case {i}")
    # neighbouring heads are far apart, so a shifted head would fail the bar
    ref = refs[0][0]
    assert (ref[:, :, 1:] - ref[:, :, :-1]).abs().amax() > 1e-1


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
