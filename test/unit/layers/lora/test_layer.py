"""The LoRA layer (``BaseLayerWithLoRA``): pass-through, ``commit_as_base``, ``inference_mode``,
per-row strengths, and its errors.

Pass-through and bit-exact restore:

* adapters stored but disabled, or all merged: outputs are ``torch.equal`` to the base layer's
  (disabled: the unchanged layer; merged: a plain layer holding the merged weight), for every
  class, fp32 and bf16, including ``skip_bias_add`` bias handling;
* 1,000 merge/unmerge cycles in bf16 leave the base weight bit-identical.

``commit_as_base``: the merged weight becomes the new base that ``unmerge`` restores.

* later adapters stack on top of the committed weight;
* base + dynamic ``s2`` after committing ``s1`` equals one merge at ``s1 + s2``;
* re-merging the same adapter at ``-s`` and committing restores the original within fp32 rounding.

``torch.inference_mode``: weights created under ``inference_mode`` are inference tensors: an
in-place update outside the mode raises "Inplace update to inference tensor outside
InferenceMode". Merge/unmerge/commit must work both inside and outside the mode, on layers built
inside or outside it. Per-row strengths in one forward.

Errors: shapes (module and both shapes named), rank 0, NaN/Inf, unknown shard ids, merge on a
layer that cannot merge. Nothing is stored when ``add_adapter`` fails.

Tolerances: fp32 weights atol 1e-5; fp32 outputs vs fp64 reference atol 2e-4 / rtol 1e-4.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from fixtures.lora_layers import (
    IN,
    KINDS,
    build_layer,
    dense_reference,
    full_weights,
    load,
    random_adapter,
    rank_input,
)
from sglang.multimodal_gen.layers.linear import ColumnParallelLinear, RowParallelLinear
from sglang.multimodal_gen.layers.lora import (
    Composition,
    LoRAContext,
    LoRAWeights,
    RowMapping,
    wrap_with_lora,
)

ATOL, RTOL = 2e-4, 1e-4  # fp32 outputs vs the fp64 reference


# ------------------------------------------------------------ pass-through and bit-exact restore


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_disabled_and_merged_are_bit_identical(kind, dtype, skip_bias_add):
    seed = KINDS.index(kind)
    w, b = full_weights(kind, seed, dtype)
    tp_rank, tp_size = 1, 2  # a non-zero rank of a split layer (Row: no bias on this rank)
    base = load(build_layer(kind, tp_rank, tp_size, dtype, skip_bias_add=skip_bias_add), w, b)
    plain = copy.deepcopy(base)
    x = torch.randn(4, 3, IN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x = rank_input(kind, x, tp_rank, tp_size)
    want, want_bias = plain(x)

    layer = wrap_with_lora(base)
    layer.add_adapter("a", random_adapter(kind, seed + 1, ranks=(3, 2, 4), dtype=dtype))
    layer.add_adapter("b", random_adapter(kind, seed + 2, ranks=(5,), fused=True))
    for composition in ([], [("a", 0.0)], [("missing", 1.0)]):
        layer.set_active(composition)
        got, got_bias = layer(x)
        assert torch.equal(got, want)
        assert (got_bias is None and want_bias is None) or torch.equal(got_bias, want_bias)

    layer.set_active([("a", 0.9), ("b", -0.5)])
    layer.merge()
    plain.weight.data.copy_(base.weight.data)
    got, got_bias = layer(x)
    want, want_bias = plain(x)
    assert not torch.equal(
        plain.weight, load(build_layer(kind, tp_rank, tp_size, dtype), w, b).weight
    )
    assert torch.equal(got, want)
    assert (got_bias is None and want_bias is None) or torch.equal(got_bias, want_bias)


def test_1000_merge_unmerge_cycles_bf16_bit_exact():
    w, b = full_weights("qkv", 9, torch.bfloat16)
    layer = wrap_with_lora(load(build_layer("qkv", dtype=torch.bfloat16), w, b))
    layer.add_adapter("a", random_adapter("qkv", 10, ranks=(4, 2, 3), dtype=torch.bfloat16))
    layer.add_adapter("b", random_adapter("qkv", 11, ranks=(2,), fused=True))
    layer.set_active([("a", 0.7), ("b", 1.3)])
    original = layer.base_layer.weight.detach().clone()
    first = None
    for _ in range(1000):
        merged = layer.merge()
        if first is None:
            first = merged.clone()
            assert not torch.equal(merged, original)
        layer.unmerge()
    assert torch.equal(layer.base_layer.weight, original)
    assert torch.equal(merged, first)  # every merge gives the same bits


# -------------------------------------------------------------------------------- commit_as_base


def _layer(kind, seed):
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind), w, b))
    a1 = random_adapter(kind, seed + 1, ranks=(4, 2, 3))
    a2 = random_adapter(kind, seed + 2, ranks=(5,))
    layer.add_adapter("a1", a1)
    layer.add_adapter("a2", a2)
    return layer, w, b, a1, a2


def test_commit_then_stack_and_unmerge_restores_committed():
    layer, w, b, a1, a2 = _layer("qkv", 1)
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(1))
    layer.set_active([("a1", 0.7)])
    layer.merge()
    layer.commit_as_base()
    assert not layer.merged and layer.active_composition == Composition.EMPTY
    committed = layer.base_layer.weight.detach().clone()
    torch.testing.assert_close(
        layer(x)[0].double(), dense_reference("qkv", w, b, x, [(a1, 0.7)]), atol=ATOL, rtol=RTOL
    )
    # a later adapter stacks on the committed weight, merged or not
    layer.set_active([("a2", -1.1)])
    want = dense_reference("qkv", w, b, x, [(a1, 0.7), (a2, -1.1)])
    torch.testing.assert_close(layer(x)[0].double(), want, atol=ATOL, rtol=RTOL)
    layer.merge()
    torch.testing.assert_close(layer(x)[0].double(), want, atol=ATOL, rtol=RTOL)
    layer.unmerge()
    assert torch.equal(layer.base_layer.weight, committed)


def test_commit_s1_plus_dynamic_s2_equals_merge_s1_plus_s2():
    s1, s2 = 0.6, 0.9
    layer, w, b, a1, _ = _layer("merged", 2)
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(2))
    layer.set_active([("a1", s1)])
    layer.commit_as_base()  # merges first when not merged
    layer.set_active([("a1", s2)])
    assert not layer.merged
    got = layer(x)[0]
    other, *_ = _layer("merged", 2)
    other.set_active([("a1", s1 + s2)])
    other.merge()
    torch.testing.assert_close(got, other(x)[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(
        got.double(), dense_reference("merged", w, b, x, [(a1, s1 + s2)]), atol=ATOL, rtol=RTOL
    )


def test_commit_minus_s_restores_original():
    layer, w, b, a1, a2 = _layer("row", 3)
    original = layer.base_layer.weight.detach().clone()
    layer.set_active([("a1", 1.3), ("a2", 0.4)])
    layer.merge()
    layer.commit_as_base()
    assert (layer.base_layer.weight - original).abs().max() > 1e-2  # really changed
    layer.set_active([("a1", -1.3), ("a2", -0.4)])
    layer.merge()
    layer.commit_as_base()
    torch.testing.assert_close(layer.base_layer.weight, original, atol=1e-5, rtol=0)


def test_commit_folds_offsets_into_bias():
    w, b = full_weights("column", 4)
    layer = wrap_with_lora(load(build_layer("column"), w, b))
    a = random_adapter("column", 5, offset=True)
    layer.add_adapter("a", a)
    layer.set_active([("a", 0.5)])
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(4))
    want = dense_reference("column", w, b, x, [(a, 0.5)])
    layer.commit_as_base()
    assert not layer.active
    torch.testing.assert_close(layer(x)[0].double(), want, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------- torch.inference_mode and per-row strengths


def _build(kind, seed, build_in_inference):
    ctx = torch.inference_mode() if build_in_inference else contextlib.nullcontext()
    w, b = full_weights(kind, seed)
    adapter = random_adapter(kind, seed + 1, ranks=(3, 5, 2), offset=True)
    with ctx:
        layer = wrap_with_lora(load(build_layer(kind), w, b))
        layer.add_adapter("a", adapter)
        layer.set_active([("a", 0.8)])
    assert layer.base_layer.weight.is_inference() == build_in_inference
    return layer, w, b, [(adapter, 0.8)]


@pytest.mark.parametrize("kind", ["qkv", "row_full_input"])
@pytest.mark.parametrize("build_in_inference", [True, False])
@pytest.mark.parametrize("run_in_inference", [True, False])
def test_merge_unmerge_any_mode(kind, build_in_inference, run_in_inference):
    seed = 3 + int(build_in_inference) + 2 * int(run_in_inference)
    layer, w, b, adapters = _build(kind, seed, build_in_inference)
    original = layer.base_layer.weight.detach().clone()
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(seed))
    want = dense_reference(kind, w, b, x, adapters)
    ctx = torch.inference_mode() if run_in_inference else torch.no_grad()
    with ctx:
        unmerged = layer(x)[0]
        layer.merge()
        merged = layer(x)[0]
        layer.unmerge()
        assert torch.equal(layer.base_layer.weight, original)
        layer.merge()
    torch.testing.assert_close(unmerged.double(), want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(merged.double(), want, atol=ATOL, rtol=RTOL)
    # unmerge outside any mode, then commit in the other mode
    layer.unmerge()
    assert torch.equal(layer.base_layer.weight, original)
    with torch.inference_mode() if not run_in_inference else contextlib.nullcontext():
        layer.commit_as_base()
    assert not layer.merged and not layer.active
    torch.testing.assert_close(layer(x)[0].double(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("merged", [False, True])
def test_row_strengths_scale_the_delta_and_leave_state(merged):
    """Rows asking for the active adapter at ``s`` times its strength (a row mapping under
    ``inference_mode``) get ``base + s * delta``; the weight, the slot tensors and the merge
    state are untouched."""
    layer, w, b, adapters = _build("merged", 21, build_in_inference=True)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(22))
    base = dense_reference("merged", w, b, x, [])
    delta = dense_reference("merged", w, b, x, adapters) - base
    if merged:
        layer.merge()
    weight_before = layer.base_layer.weight.detach().clone()
    a_before, b_before = layer.lora_a.clone(), layer.lora_b.clone()
    scales = (0.0, 0.5, 1.0, 2.0, 0.0)
    mapping = RowMapping.of([layer.composition([("a", 0.8 * s)]) for s in scales])
    with torch.inference_mode(), layer.lora_context.rows(mapping):
        got = layer(x)[0].double()
    want = base + torch.tensor(scales, dtype=torch.float64)[:, None] * delta
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(layer.base_layer.weight, weight_before)
    assert torch.equal(layer.lora_a, a_before) and torch.equal(layer.lora_b, b_before)
    assert layer.merged == merged and layer.lora_context.mapping is None


# ---------------------------------------------------------------------------------------- errors


def _qkv():
    w, b = full_weights("qkv", 0)
    return wrap_with_lora(load(build_layer("qkv", prefix="layers.0.attention.to_qkv"), w, b))


def test_shape_errors_name_module_and_shapes():
    layer = _qkv()
    bad_b = LoRAWeights(torch.randn(4, IN), torch.randn(32, 4))  # q rows given for k
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.to_qkv.*\[32, 4\].*\[8, 4\]"):
        layer.add_adapter("bad", {"k": bad_b})
    bad_a = LoRAWeights(torch.randn(4, IN + 1), torch.randn(32, 4))
    with pytest.raises(ValueError, match=r"lora_A \[4, 49\].*expected lora_A \[4, 48\]"):
        layer.add_adapter("bad", {"q": bad_a})
    mismatch = LoRAWeights(torch.randn(4, IN), torch.randn(32, 3))
    with pytest.raises(ValueError, match=r"\[32, 3\]"):
        layer.add_adapter("bad", {"q": mismatch})
    with pytest.raises(ValueError, match="unknown shard_id 'x'"):
        layer.add_adapter("bad", {"x": LoRAWeights(torch.randn(4, IN), torch.randn(8, 4))})
    with pytest.raises(ValueError, match="offset"):
        layer.add_adapter(
            "bad", {"q": LoRAWeights(torch.randn(4, IN), torch.randn(32, 4), 1.0, torch.randn(8))}
        )
    assert layer.adapter_names == []


def test_rank_zero_and_non_finite():
    layer = _qkv()
    with pytest.raises(ValueError, match="rank 0"):
        layer.add_adapter("z", {"q": LoRAWeights(torch.randn(0, IN), torch.randn(32, 0))})
    good = random_adapter("qkv", 1)
    for field in ("lora_A", "lora_B"):
        bad = dict(good)
        t = getattr(good["v"], field).clone()
        t[0, 0] = float("nan") if field == "lora_A" else float("inf")
        bad["v"] = LoRAWeights(**{**good["v"].__dict__, field: t})
        with pytest.raises(ValueError, match=f"{field} for module .*NaN or Inf"):
            layer.add_adapter("nan", bad)
    with pytest.raises(ValueError, match="scale"):
        layer.add_adapter("s", {"q": LoRAWeights(good["q"].lora_A, good["q"].lora_B, float("inf"))})
    assert layer.adapter_names == []
    layer.add_adapter("ok", good)
    with pytest.raises(ValueError, match="not finite"):
        layer.set_active([("ok", float("nan"))])


def test_safe_merge_rejects_overflow_and_keeps_weight():
    w, b = full_weights("column", 0, torch.float16)
    layer = wrap_with_lora(load(build_layer("column", dtype=torch.float16), w, b))
    big = random_adapter("column", 2)  # accepted at load (scale x B fits float16)...
    layer.add_adapter("big", big)
    layer.set_active([("big", 1e5)])  # ... the strength makes the merged weight overflow
    before = layer.base_layer.weight.clone()
    with pytest.raises(ValueError, match="NaN or Inf; not merged"):
        layer.merge(safe=True)
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


def test_merge_on_layer_that_cannot():
    w, b = full_weights("row", 0)
    layer = wrap_with_lora(load(build_layer("row", prefix="layers.1.attention.to_out.0"), w, b))
    layer.base_layer.lora_merge_unsupported = True  # e.g. a quantized GEMM
    layer.add_adapter("a", random_adapter("row", 3))
    layer.set_active([("a", 1.0)])
    assert not layer.can_merge
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.to_out\.0.*cannot merge"):
        layer.merge()
    x = torch.randn(2, IN)
    assert not torch.equal(layer(x)[0], layer.base_layer(x)[0])  # dynamic still works
    with pytest.raises(ValueError, match="cached merged weight"):
        del layer.base_layer.lora_merge_unsupported
        layer.merge(cached=torch.zeros(3, 3))


# ---------------------------------------------------------------------- under torch.compile
# A compiled block with LoRA layers: switching adapters, strengths, merges and compositions does
# not recompile it (adapters and strengths reach the graph as tensors of fixed shapes), and the
# compiled output equals eager.
#
# A small DiT-like block (a column-parallel projection, a GELU, a row-parallel projection) is
# wrapped for LoRA, compiled with ``torch.compile(fullgraph=True)`` (the ``CompileCounter``
# backend: dynamo's tracing and guards, no code generation), warmed up once (nothing active),
# then driven through 20 changes of the active adapter, its strength, merged or not, and the
# per-call row mapping (uniform and mixed rows): one frame in all.


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
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        plain = block(x)

    def run(mapping):
        with torch.no_grad(), block.ctx.rows(mapping):
            got, want = compiled(x), block(x)
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
        return want

    run(None)  # warm-up: nothing active
    assert counter.frame_count == 1
    gen = torch.Generator().manual_seed(2)
    names = ["a", "b", "c", "d"]
    for i in range(20):
        first = names[i % 4]
        s = float(torch.rand((), generator=gen) * 4 - 2)
        if i % 2:
            pairs = [(first, s)]
        else:
            pairs = [(first, s), (names[(i + 1) % 4], -s / 2)]
        merge = i % 5 == 3
        for layer in (block.up, block.down):
            layer.set_active(block.up.composition(pairs if i % 3 else []))
            if merge and layer.active:
                layer.merge()
            elif not merge and layer.merged:
                layer.unmerge()
        if i % 4 == 0:
            mapping = None  # the layers' active composition
        elif i % 4 == 1:
            mapping = _rows(block, pairs, pairs)  # uniform
        else:
            mapping = _rows(block, pairs, [(names[(i + 2) % 4], 1.5)])  # mixed rows
        want = run(mapping)
        if mapping is not None or i % 3:
            assert (want - plain).abs().max() > 1e-3  # the state matters
    assert counter.frame_count == 1, counter.frame_count
    torch._dynamo.reset()
