"""Fused compose: N adapters of different ranks, each in its slot, run as ONE pair of GEMMs over
the gathered slots and equal the sum of the per-adapter references (dense ``F.linear`` and peft's
LoRA ``Linear`` with several active adapters).

q/k/v sections with GQA sizes (q 32 rows, k/v 8 rows) and unequal ranks compose block-diagonally:
an adapter's columns hold each shard's ``B`` at that shard's rows, zeros elsewhere.
Merged equals unmerged. Tolerances: fp32 atol 2e-4 / rtol 1e-4 vs an fp64 reference; bf16 atol 5e-2.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.lora_layers import (
    IN,
    build_layer,
    dense_delta,
    dense_reference,
    full_weights,
    load,
    random_adapter,
)
from sglang.multimodal_gen.layers.lora import LoRAWeights, wrap_with_lora

ATOL, RTOL = 2e-4, 1e-4
RANKS = ((4,), (2, 6, 3), (8, 1, 5))
STRENGTHS = (1.0, 0.6, -0.8)


def _setup(kind, n, seed, dtype=torch.float32):
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind, dtype=dtype), w.to(dtype), b.to(dtype)))
    adapters = []
    for i in range(n):
        weights = random_adapter(kind, seed + 100 + i, ranks=RANKS[i])
        layer.add_adapter(f"ad{i}", weights)
        adapters.append((weights, STRENGTHS[i]))
    layer.set_active([(f"ad{i}", STRENGTHS[i]) for i in range(n)])
    return layer, w.to(dtype), b.to(dtype), adapters


@pytest.mark.parametrize("kind", ["qkv", "merged", "column", "row", "replicated"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_n_adapters_equal_sum_of_references(kind, n):
    seed = 10 * n + len(kind)
    layer, w, b, adapters = _setup(kind, n, seed)
    x = torch.randn(2, 7, IN, generator=torch.Generator().manual_seed(seed))
    got = layer(x)[0]
    # the sum of per-adapter deltas, each computed on its own
    base = dense_reference(kind, w, b, x, [])
    want = base + sum(dense_reference(kind, w, b, x, [a]) - base for a in adapters)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    # one slot per adapter, R columns each: the widest adapter's rank summed over its shards
    widths = [sum(w.rank for w in weights.values()) for weights, _ in adapters]
    out_local = layer.base_layer.output_size_per_partition
    assert layer.lora_a.shape[0] >= n and layer.lora_a.shape[1:] == (max(widths), IN)
    assert layer.lora_b.shape[1:] == (max(widths), out_local)
    for i, width in enumerate(widths):  # padding columns: zero A rows, B columns and scales
        slot = layer.slot_of(f"ad{i}")
        assert torch.count_nonzero(layer.lora_a[slot, width:]) == 0
        assert torch.count_nonzero(layer.lora_b[slot, width:]) == 0
        assert torch.count_nonzero(layer.col_scale[slot, width:]) == 0


def test_qkv_block_diagonal_with_gqa_and_fused_key():
    """Unequal q/k/v ranks plus one adapter keyed by the fused ``None`` shard."""
    seed = 5
    layer, w, b, adapters = _setup("qkv", 2, seed)
    fused = random_adapter("qkv", seed + 50, ranks=(3,), fused=True)
    layer.add_adapter("fused", fused)
    layer.set_active([("ad0", 1.0), ("ad1", 0.6), ("fused", 1.5)])
    adapters.append((fused, 1.5))
    # block structure: adapter ad1's k columns (after its q columns) only touch k rows (32..40)
    b_t = layer.lora_b[layer.slot_of("ad1")]  # [R, out]: B transposed
    k_cols = slice(RANKS[1][0], RANKS[1][0] + RANKS[1][1])
    assert torch.count_nonzero(b_t[k_cols, :32]) == 0
    assert torch.count_nonzero(b_t[k_cols, 40:]) == 0
    assert torch.count_nonzero(b_t[k_cols, 32:40]) > 0
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        layer(x)[0].double(), dense_reference("qkv", w, b, x, adapters), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qkv", "merged", "row"])
def test_merged_equals_unmerged(kind, dtype):
    seed = 77
    layer, w, b, adapters = _setup(kind, 3, seed, dtype)
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    unmerged = layer(x)[0]
    layer.merge()
    merged = layer(x)[0]
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(merged.float(), unmerged.float(), **tol)
    want = dense_reference(kind, w.float(), b.float(), x.float(), adapters)
    torch.testing.assert_close(merged.double(), want, **tol)
    # merged weight = W + sum s_i c_i B_i A_i in fp32, rounded once to the weight dtype
    dw, _ = dense_delta(kind, adapters)
    want_w = (w.float() + dw.float()).to(dtype)
    diff = (layer.base_layer.weight.float() - want_w.float()).abs().max().item()
    assert diff <= (1e-6 if dtype == torch.float32 else 2**-7), diff


def test_matches_peft_with_several_active_adapters():
    """Same adapters through peft's LoRA ``Linear`` (``set_adapter([...])``) on an ``nn.Linear``."""
    peft_lora = pytest.importorskip("peft.tuners.lora.layer")
    torch.manual_seed(0)
    out_f, ranks, alphas = 32, (4, 7, 2), (8.0, 7.0, 1.0)
    lin = torch.nn.Linear(IN, out_f)
    layer = wrap_with_lora(load(build_layer("replicated"), lin.weight.data, lin.bias.data))
    from peft import LoraConfig

    cfg = lambda r, a: LoraConfig(r=r, lora_alpha=a)  # noqa: E731
    ref = peft_lora.Linear(lin, "p0", cfg(ranks[0], alphas[0]), r=ranks[0], lora_alpha=alphas[0])
    for i, (r, alpha) in enumerate(zip(ranks, alphas)):
        if i:
            ref.update_layer(f"p{i}", r, lora_alpha=alpha, config=cfg(r, alpha))
        a = torch.randn(r, IN) / IN**0.5
        bm = torch.randn(out_f, r) / r**0.5
        ref.lora_A[f"p{i}"].weight.data.copy_(a)
        ref.lora_B[f"p{i}"].weight.data.copy_(bm)
        layer.add_adapter(f"p{i}", {None: LoRAWeights(a, bm, scale=alpha / r)})
    ref.set_adapter(["p0", "p1", "p2"])
    layer.set_active([("p0", 1.0), ("p1", 1.0), ("p2", 1.0)])
    x = torch.randn(3, 11, IN)
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(layer(x)[0], want, atol=2e-5, rtol=1e-5)
    assert layer.lora_a.shape[1] == max(ranks)
    for i, (r, alpha) in enumerate(zip(ranks, alphas)):  # each column's alpha / r
        want_scale = torch.zeros(max(ranks))
        want_scale[:r] = alpha / r
        assert torch.equal(layer.col_scale[layer.slot_of(f"p{i}")], want_scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qkv", "merged", "row_full_input"])
def test_cuda_bf16_unmerged_and_merged_match_reference(kind):
    """The same fused compose on a GPU in bf16 (tolerance atol 6e-2 / rtol 3e-2 vs fp64)."""
    seed = 31
    w, b = full_weights(kind, seed)
    base = load(build_layer(kind, dtype=torch.bfloat16, device="cuda"), w.bfloat16(), b.bfloat16())
    layer = wrap_with_lora(base)
    adapters = []
    for i in range(3):
        weights = random_adapter(kind, seed + i, ranks=RANKS[i], offset=True, dtype=torch.bfloat16)
        layer.add_adapter(f"a{i}", weights)
        adapters.append((weights, STRENGTHS[i]))
    layer.set_active([(f"a{i}", STRENGTHS[i]) for i in range(3)])
    x = torch.randn(4, 64, IN, generator=torch.Generator().manual_seed(seed)).bfloat16()
    want = dense_reference(kind, w.bfloat16().float(), b.bfloat16().float(), x.float(), adapters)
    tol = dict(atol=6e-2, rtol=3e-2)
    original = base.weight.clone()
    with torch.inference_mode():
        got = layer(x.cuda())[0]
        torch.testing.assert_close(got.cpu().double(), want, **tol)
        layer.merge()
        torch.testing.assert_close(layer(x.cuda())[0].cpu().double(), want, **tol)
    layer.unmerge()
    assert torch.equal(base.weight, original)


# ---------------------------------------------------------------------- per-row form
def _slot_tensors(gen, s=4, r=3, n_in=12, n_out=10, dtype=torch.float64):
    a = torch.randn(s, r, n_in, generator=gen, dtype=dtype)
    b = torch.randn(s, r, n_out, generator=gen, dtype=dtype)
    c = torch.rand(s, r, generator=gen, dtype=dtype) + 0.5
    c[1, 2] = 0.0  # a padding column
    return a, b, c


def test_delta_rows_equals_the_gathered_delta_of_each_row():
    """``add_lora_delta_rows`` with a coefficient per row and slot equals, row by row,
    ``add_lora_delta`` of that row's composition (the gathered form the eager forward uses);
    a ``[1, S]`` coefficient applies to every row."""
    from sglang.multimodal_gen.layers.lora.compute import add_lora_delta, add_lora_delta_rows

    gen = torch.Generator().manual_seed(7)
    a, b, c = _slot_tensors(gen)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 5, 10, generator=gen, dtype=torch.float64)
    rows = [((0, 1.5), (2, -0.7)), ((3, 0.4),)]
    coef = torch.zeros(2, 4, dtype=torch.float64)
    for i, comp in enumerate(rows):
        for slot, v in comp:
            coef[i, slot] = v
    got = add_lora_delta_rows(y, x, a, b, c, coef)
    for i, comp in enumerate(rows):
        slots = torch.tensor([s for s, _ in comp])
        strengths = torch.tensor([v for _, v in comp], dtype=torch.float64)
        want = add_lora_delta(y[i].clone(), x[i], a, b, c, slots, strengths)
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
        assert (want - y[i]).abs().max() > 0.1  # a real delta
    uniform = add_lora_delta_rows(y, x, a, b, c, coef[:1])  # row 0's composition for all
    slots, strengths = torch.tensor([0, 2]), torch.tensor([1.5, -0.7], dtype=torch.float64)
    want = add_lora_delta(y[1].clone(), x[1], a, b, c, slots, strengths)
    torch.testing.assert_close(uniform[1], want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(uniform[1], got[1])  # the rows really differ


def test_offset_delta_rows_equals_the_offset_delta_of_each_row():
    from sglang.multimodal_gen.layers.lora.compute import add_offset_delta, add_offset_delta_rows

    gen = torch.Generator().manual_seed(8)
    off = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    scale = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    y = torch.randn(2, 3, 10, generator=gen, dtype=torch.float64)
    coef = torch.tensor([[0.5, 2.0, 0.0, -1.0], [0.0, 0.0, 1.25, 0.0]], dtype=torch.float64)
    got = add_offset_delta_rows(y, off, scale, coef)
    for i in range(2):
        slots = torch.arange(4)
        want = add_offset_delta(y[i].clone(), off, scale, slots, coef[i])
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[0] - y[0], got[1] - y[1])
