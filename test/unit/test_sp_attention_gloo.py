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


def _run(rank, masked, sizes_only):
    q, k, v, mask = _inputs(masked)
    split = SeqSplit.of(S)
    ql, kl, vl = (split.local(t) for t in (q, k, v))
    ml = None if mask is None else split.local(mask)
    with sequence_split(split):
        out = attention(ql, kl, vl, ml)
    if sizes_only:
        return tuple(ql.shape)
    return split.gather(out)


LAYOUTS = {
    "ulysses2": ParallelLayout(ulysses_degree=2),
    "ring2": ParallelLayout(ring_degree=2),
    "ring3": ParallelLayout(ring_degree=3),
    "usp2x2": ParallelLayout(ulysses_degree=2, ring_degree=2),
}


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sp_attention_matches_one_process(name, masked):
    layout = LAYOUTS[name]
    q, k, v, mask = _inputs(masked)
    ref = sdpa_bshd(q, k, v, mask)
    outs = launch_processes(_run, layout.world_size, (masked, False), layout=layout)
    for r, out in enumerate(outs):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"rank {r} of {name}")
    # a wrong combination (keys of one chunk only) is far from the reference
    half = sdpa_bshd(q[:, :12], k[:, :12], v[:, :12])
    assert (half - ref[:, :12]).abs().max() > 1e-2


def test_each_rank_holds_only_its_chunk():
    layout = LAYOUTS["usp2x2"]
    shapes = launch_processes(_run, 4, (False, True), layout=layout)
    assert [s[1] for s in shapes] == list(even_split(S, 4)) == [6, 6, 6, 5]


def test_ulysses_refuses_indivisible_heads():
    layout = ParallelLayout(ulysses_degree=3)
    with pytest.raises(RuntimeError, match="not divisible by ulysses_degree=3"):
        launch_processes(_run, 3, (False, False), layout=layout)
