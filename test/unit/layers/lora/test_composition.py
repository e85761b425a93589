"""Per-row LoRA compositions in one forward: a ``RowMapping`` in the target's ``LoRAContext``.

Every wrapper kind (Column, MergedColumn, QKV with GQA sizes, Row with a parallel and a full
input, Replicated), at simulated TP 1 and 2 and real gloo TP 2, unmerged and merged, with and
without output offsets. Rows: no LoRA, one adapter, two adapters, the global composition.

* each row of a mixed batch is bit-equal to the same row run alone with its composition (the
  GEMMs are row-invariant on the CPU and a group of rows never sees another group's adapters),
  in every order of the rows, and equals the dense fp64 reference ``F.linear(x, W + sum s c B A)``
  within atol 2e-5 / rtol 1e-5 (measured below 5e-6; a row that picked up another row's adapter,
  or missed its own, is off by order 1);
* a layer merged at strength 1e4 serves other rows from the exact base weight: bit-equal to an
  unmerged layer (subtracting the merged delta back would be off by ~1e-3);
* an extreme adapter that is accepted (``max|A| x in`` just under the float32 limit) stays in its
  row: the other rows, whose inputs would overflow ``x A^T`` to Inf (and ``Inf x 0 = NaN`` in a
  union of every row's adapters), are bit-equal to themselves alone;
* what overflows the compute dtype is refused at load, naming the tensor.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F
from fixtures.lora_layers import (
    IN,
    KINDS,
    assemble,
    build_layer,
    dense_delta,
    dense_reference,
    full_weights,
    load,
    random_adapter,
    rank_input,
)
from sglang.multimodal_gen.distributed import get_tp_rank, get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.lora import (
    Composition,
    LoRAContext,
    LoRAWeights,
    RowMapping,
    lora_context_of,
    wrap_with_lora,
)
from sglang.multimodal_gen.layers.lora.compute import add_lora_delta

ATOL, RTOL = 2e-5, 1e-5
GLOBAL = [("a0", 0.7)]
ROW_COMPS = {
    "empty": [],
    "one": [("a1", 2.0)],
    "two": [("a0", -0.5), ("a1", 1.2)],
    "global": GLOBAL,
}
MODES = ("unmerged", "merged", "unmerged_offset", "merged_offset")


def _adapters(kind, seed, offset):
    return {
        "a0": random_adapter(kind, seed, ranks=(4, 2, 6), offset=offset),
        "a1": random_adapter(kind, seed + 1, ranks=(3,), fused=True, offset=offset),
    }


def _layer(kind, seed, mode, tp_rank=None, tp_size=None, active=GLOBAL, **flags):
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind, tp_rank, tp_size, **flags), w, b))
    for name, weights in _adapters(kind, seed + 10, offset="offset" in mode).items():
        layer.add_adapter(name, weights)
    layer.set_active(active)
    if mode.startswith("merged"):
        layer.merge()
    return layer


def _forward(layer, x, comps):
    """``layer(x)`` with row ``i`` of ``x`` under the named composition ``comps[i]``."""
    mapping = RowMapping.of([layer.composition(c) for c in comps])
    with layer.lora_context.rows(mapping):
        return layer(x)[0]


def _alone(layer, x_row, comp):
    """One row ``[1, ...]`` run on its own with its composition."""
    with layer.lora_context.rows(RowMapping.whole(layer.composition(comp))):
        return layer(x_row)[0][0]


def _reference(kind, seed, mode, x_row, comp):
    w, b = full_weights(kind, seed)
    adapters = _adapters(kind, seed + 10, offset="offset" in mode)
    return dense_reference(kind, w, b, x_row, [(adapters[n], s) for n, s in comp])


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_equals_itself_alone_in_every_order(kind, mode, tp_size):
    """Every order of the four compositions, plus two rows repeating the first and third (so a
    composition's rows are not consecutive)."""
    seed = 40 + KINDS.index(kind)
    x = torch.randn(6, 3, IN, generator=torch.Generator().manual_seed(seed))
    layers = [_layer(kind, seed, mode, r, tp_size) for r in range(tp_size)]
    inputs = [rank_input(kind, x, r, tp_size) for r in range(tp_size)]
    alone = {
        (r, i, name): _alone(layers[r], inputs[r][i : i + 1], comp)
        for r in range(tp_size)
        for i in range(6)
        for name, comp in ROW_COMPS.items()
    }
    want = {
        (i, name): _reference(kind, seed, mode, x[i], comp)
        for i in range(6)
        for name, comp in ROW_COMPS.items()
    }
    for order in itertools.permutations(ROW_COMPS):
        order = (*order, order[0], order[2])
        outs = [
            _forward(layers[r], inputs[r], [ROW_COMPS[n] for n in order]) for r in range(tp_size)
        ]
        for r in range(tp_size):
            for i, name in enumerate(order):
                assert torch.equal(outs[r][i], alone[(r, i, name)]), (order, r, i)
        got = assemble(kind, layers, outs)
        expected = torch.stack([want[(i, name)] for i, name in enumerate(order)])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # the mapping ends with the block: every row is back to the layer's active composition
    assert all(la.lora_context.mapping is None for la in layers)
    plain = assemble(kind, layers, [la(inp)[0] for la, inp in zip(layers, inputs)])
    expected = torch.stack([want[(i, "global")] for i in range(6)])
    torch.testing.assert_close(plain, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_merged_at_large_strength_serves_other_rows_from_the_exact_base(kind, tp_size):
    """Merged at strength 1e4: rows with another composition (or none) are bit-equal to the same
    rows on an unmerged layer without a global composition; rows with the merged composition
    are the merged layer's own GEMM."""
    seed = 70 + KINDS.index(kind)
    big = [("a0", 1e4)]
    comps = [[], [("a1", 0.9)], big, [("a0", 0.5), ("a1", -1.0)], [("a0", 1e4), ("a1", 1.0)]]
    x = torch.randn(len(comps), 3, IN, generator=torch.Generator().manual_seed(seed))
    for r in range(tp_size):
        merged = _layer(kind, seed, "merged", r, tp_size, active=big)
        plain = _layer(kind, seed, "unmerged", r, tp_size, active=[])
        assert merged.merged and not plain.active
        xr = rank_input(kind, x, r, tp_size)
        got, ref = _forward(merged, xr, comps), _forward(plain, xr, comps)
        own = merged.base_layer(xr)[0]
        for i, comp in enumerate(comps):
            assert torch.equal(got[i], own[i] if comp == big else ref[i]), (r, i)
        assert torch.equal(merged(xr)[0], own)  # no mapping: the merged composition
    if tp_size == 1 and kind in ("replicated", "column"):
        # the test is sensitive: subtracting the merged delta back (the old request overlay)
        # is far from exact at this strength
        w, b = full_weights(kind, seed)
        adapters = _adapters(kind, seed + 10, offset=False)
        d_big, _ = dense_delta(kind, [(adapters["a0"], 1e4)])
        d_row, _ = dense_delta(kind, [(adapters["a1"], 0.9)])
        overlay = own[1] + F.linear(x[1], (d_row - d_big).float())
        assert (overlay - ref[1]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["replicated", "qkv", "row_full_input", "merged"])
def test_extreme_accepted_adapter_stays_in_its_row(kind):
    seed = 90 + KINDS.index(kind)
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind), w, b))
    for name, weights in _adapters(kind, seed + 10, offset=False).items():
        layer.add_adapter(name, weights)
    fmax = torch.finfo(torch.float32).max
    c = 0.9 * fmax / IN  # max|A| x in = 0.9 x the float32 limit: accepted
    g = torch.Generator().manual_seed(seed)
    extreme = {
        None: LoRAWeights(
            torch.full((2, IN), c), torch.randn(sum(_rows(kind)), 2, generator=g) * 1e-37, 1.0
        )
    }
    layer.add_adapter("x", extreme)
    comps = [[("a0", 1.0)], [("x", 1.0)], [], [("a1", 0.5)], [("x", 0.5), ("a0", 1.0)]]
    xs = torch.rand(len(comps), 3, IN, generator=g) + 1.5  # x A^T would overflow: >= 1.5 x 0.9 max
    xs[1] = torch.rand(3, IN, generator=g) * 2 - 1  # the extreme row's own input stays in range
    xs[4] = torch.rand(3, IN, generator=g) * 2 - 1
    got = _forward(layer, xs, comps)
    for i, comp in enumerate(comps):
        assert torch.equal(got[i], _alone(layer, xs[i : i + 1], comp)), i
        assert torch.isfinite(got[i]).all(), i
    want = dense_reference(kind, w, b, xs[1], [(extreme, 1.0)])
    torch.testing.assert_close(got[1].double(), want, atol=1e-3, rtol=1e-4)
    # the test is sensitive: a union of every row's adapters with zero coefficients would
    # compute x A_x^T = Inf for the other rows, and Inf x 0 = NaN
    h = F.linear(xs[0], layer.lora_a[layer.slot_of("x")])
    assert torch.isinf(h).any() and torch.isnan(h * 0.0).any()


def _rows(kind):
    return {"qkv": (48,), "merged": (48,)}.get(kind, (32,))


@pytest.mark.parametrize(
    "dtype,weights,what",
    [
        # A of 1e37 over 64 inputs: x A^T reaches 6.4e38 > 3.4e38
        (torch.float32, dict(lora_A=torch.full((2, 64), 1e37), lora_B=torch.ones(32, 2)), "lora_A"),
        # alpha / r of 5e38 is not finite in float32
        (torch.float32, dict(scale=1e39 / 2), "alpha"),
        # scale x B x rank: 4 x 1e38 x 2
        (torch.float32, dict(lora_B=torch.full((32, 2), 1e38), scale=4.0), "lora_B"),
        (torch.float32, dict(offset=torch.full((32,), 1e38), offset_scale=10.0), "offset"),
        # finite in float32, Inf once cast to float16
        (torch.float16, dict(lora_A=torch.full((2, 64), 1e5)), "lora_A"),
        (torch.float16, dict(lora_B=torch.full((32, 2), 7e4)), "lora_B"),
        (torch.bfloat16, dict(lora_A=torch.full((2, 64), 1e37)), "lora_A"),
    ],
)
def test_overflowing_adapters_are_refused_at_load(dtype, weights, what):
    base = ReplicatedLinear(64, 32, params_dtype=dtype, prefix="layers.0.proj")
    layer = wrap_with_lora(base)
    layer.add_adapter("ok", {None: LoRAWeights(torch.randn(2, 64), torch.randn(32, 2))})
    before = layer.lora_a.clone()
    fields = dict(lora_A=torch.randn(2, 64), lora_B=torch.randn(32, 2), scale=1.0) | weights
    with pytest.raises(ValueError, match=rf"module 'layers\.0\.proj', shard None: {what}\b"):
        layer.add_adapter("bad", {None: LoRAWeights(**fields)})
    assert layer.adapter_names == ["ok"] and torch.equal(layer.lora_a, before)
    # just under the limit is accepted
    edge = 0.99 * torch.finfo(dtype).max / 64
    layer.add_adapter("edge", {None: LoRAWeights(torch.full((2, 64), edge), torch.ones(32, 2))})


@pytest.mark.parametrize("kind", KINDS)
def test_pass_through_is_the_base_layer_itself(kind):
    """No composition, nothing of it stored here, strength 0, or exactly the merged one: the
    forward is ``base_layer(x)`` itself (the base's own forward runs, once). On a merged layer the
    rows without LoRA are bit-equal to the unmerged base layer."""
    seed = 3 + KINDS.index(kind)
    x = rank_input(kind, torch.randn(3, 4, IN, generator=torch.Generator().manual_seed(seed)), 1, 2)
    base_out = _layer(kind, seed, "unmerged", 1, 2, active=[]).base_layer(x)[0]
    for mode in ("unmerged", "merged"):
        layer = _layer(kind, seed, mode, 1, 2)
        calls = []
        layer.base_layer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        nothing = [RowMapping.whole(Composition.EMPTY), RowMapping.whole(Composition([(9, 1.0)]))]
        nothing.append(RowMapping.of([layer.composition([("a0", 0.0)])] * 3))  # strength 0
        if mode == "unmerged":
            layer.set_active([])
            nothing.append(None)
        for mapping in nothing:
            calls.clear()
            with layer.lora_context.rows(mapping):
                got, _ = layer(x)
            assert torch.equal(got, base_out), (mode, mapping)
            assert calls == ([1] if mode == "unmerged" else []), (mode, mapping)
        if mode == "merged":
            own = layer.base_layer(x)[0]
            for mapping in (None, RowMapping.of([layer.active_composition] * 3)):
                calls.clear()
                with layer.lora_context.rows(mapping):
                    got, _ = layer(x)
                assert calls == [1] and torch.equal(got, own), mapping


def test_mapping_errors_and_values():
    layer = _layer("column", 9, "merged")
    x = torch.randn(3, 4, IN, generator=torch.Generator().manual_seed(1))
    five = RowMapping.of([layer.composition(c) for c in ([], GLOBAL, [], GLOBAL, [("a1", 1.0)])])
    with layer.lora_context.rows(five), pytest.raises(ValueError, match="'column'.*5 rows"):
        layer(x)
    # one composition for every row: any leading dimension
    one = RowMapping.whole(layer.composition([("a1", 1.5)]))
    with layer.lora_context.rows(one):
        got = layer(x)[0]
    torch.testing.assert_close(
        got.double(),
        torch.stack([_reference("column", 9, "merged", xi, [("a1", 1.5)]) for xi in x]),
        atol=ATOL,
        rtol=RTOL,
    )
    assert one.select(0, 1) is one and five.select(1, 3) == RowMapping.of(five.compositions[1:3])
    assert [g.rows for g in five.groups] == [(0, 2), (1, 3), (4,)]
    assert five.groups[0].index().tolist() == [0, 2] and not five.uniform and one.uniform
    # the context restores the previous mapping, also on an error
    with pytest.raises(RuntimeError), layer.lora_context.rows(one):
        raise RuntimeError("boom")
    assert layer.lora_context.mapping is None
    with pytest.raises(TypeError):
        with layer.lora_context.rows([Composition.EMPTY]):
            pass
    # compositions are values
    c = Composition([(1, 0.5), (0, 2.0)])
    assert c == Composition(((1, 0.5), (0, 2.0))) and hash(c) == hash(Composition(c.entries))
    assert c != Composition([(0, 2.0), (1, 0.5)]) and Composition(()) == Composition.EMPTY
    assert pickle.loads(pickle.dumps(c)) == c and pickle.loads(pickle.dumps(five)) == five
    assert c.slot_tensor().dtype == torch.int64 and c.strength_tensor().dtype == torch.float32
    for bad in ([(0, float("nan"))], [(0, 1.0), (0, 2.0)], [(-1, 1.0)], [("a", 1.0)]):
        with pytest.raises(ValueError):
            Composition(bad)
    with pytest.raises(AttributeError):
        c.x = 1


def test_slots_grow_replace_and_free():
    kind, seed = "qkv", 11
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind), w, b))
    x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(2))
    assert layer.lora_a is None and layer.slot_nbytes() == 0
    small = random_adapter(kind, 1, ranks=(1,))
    wide = random_adapter(kind, 2, ranks=(5, 4, 3))
    assert layer.add_adapter("small", small) == 0
    assert layer.lora_a.shape == (1, 3, IN)
    assert layer.add_adapter("wide", wide, slot=3) == 3  # the manager's target-wide slot
    assert layer.lora_a.shape == (4, 12, IN) and layer.occupied_slots == {0, 3}
    assert layer.adapter_nbytes("wide") > layer.adapter_nbytes("small") > 0
    with pytest.raises(ValueError, match="slot 3 holds adapter 'wide'"):
        layer.add_adapter("other", small, slot=3)
    comps = [[("small", 1.0)], [("wide", -0.5)]]
    want = [[(small, 1.0)], [(wide, -0.5)]]
    got = _forward(layer, x, comps)
    for i in range(2):
        torch.testing.assert_close(
            got[i].double(), dense_reference(kind, w, b, x[i], want[i]), atol=ATOL, rtol=RTOL
        )
    # replaced under the same name: the same slot, the new weights
    new = random_adapter(kind, 3, ranks=(2,))
    layer.set_active([("small", 0.8)])
    layer.merge()
    assert layer.add_adapter("small", new) == 0
    torch.testing.assert_close(  # re-merged with the new weights
        layer(x)[0].double(), dense_reference(kind, w, b, x, [(new, 0.8)]), atol=ATOL, rtol=RTOL
    )
    layer.remove_adapter("small")  # active: it leaves the composition, the weight is the base
    assert not layer.merged and not layer.active
    assert torch.equal(layer(x)[0], layer.base_layer(x)[0])
    assert layer.add_adapter("again", small) == 0  # the lowest free slot
    assert layer.add_adapter("again", new, slot=5) == 5  # moved: slot 0 is emptied
    assert layer.occupied_slots == {3, 5} and layer.slot_of("again") == 5
    assert torch.count_nonzero(layer.lora_a[0]) == 0
    layer.remove_adapter("again")
    layer.remove_adapter("wide")
    assert layer.lora_a is None and layer.slot_nbytes() == 0  # nothing left: freed


def test_context_is_found_from_the_module():
    layer = wrap_with_lora(build_layer("column"))
    assert isinstance(layer.lora_context, LoRAContext) and lora_context_of(layer) is not None
    shared = LoRAContext("transformer")
    other = wrap_with_lora(build_layer("row"), lora_context=shared)
    assert other.lora_context is shared and lora_context_of(torch.nn.Linear(2, 2)) is None


def test_delta_takes_adapters_and_strengths_as_tensor_values():
    """``add_lora_delta`` under ``torch.compile``: other slots and strengths are other tensor
    values, not other code (one trace; only K and R are shapes)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(add_lora_delta, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    lora_a, lora_b = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 5, generator=g)
    scale = torch.rand(4, 3, generator=g)
    x = torch.randn(6, 8, generator=g)
    for slots, strengths in (([0, 2], [1.0, 0.5]), ([3, 1], [-2.0, 7.0]), ([2, 2], [0.0, 1.0])):
        s, v = torch.tensor(slots), torch.tensor(strengths)
        got = fn(torch.zeros(6, 5), x, lora_a, lora_b, scale, s, v)
        want = sum(v[k] * (x @ (lora_a[j].T * scale[j]) @ lora_b[j]) for k, j in enumerate(slots))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- real gloo
def _gloo_rank_fn(rank, seed):
    assert (get_tp_rank(), get_tp_world_size()) == (rank, 2)
    x = torch.randn(4, 3, IN, generator=torch.Generator().manual_seed(seed))
    order = ["two", "global", "empty", "one"]
    comps = [ROW_COMPS[n] for n in order]
    out = {}
    for kind in ("column", "qkv", "row_full_input", "merged"):
        for mode in ("unmerged_offset", "merged_offset"):
            flags = {} if kind.startswith("row") else {"gather_output": True}
            layer = _layer(kind, seed, mode, **flags)
            got = _forward(layer, x, comps)
            alone = all(
                torch.equal(got[i], _alone(layer, x[i : i + 1], c)) for i, c in enumerate(comps)
            )
            out[(kind, mode)] = (got.numpy(), alone)
    return out


def test_gloo_tp2_rows():
    seed = 21
    results = launch_processes(_gloo_rank_fn, 2, args=(seed,), backend="gloo")
    x = torch.randn(4, 3, IN, generator=torch.Generator().manual_seed(seed))
    order = ["two", "global", "empty", "one"]
    for kind, mode in results[0]:
        want = torch.stack(
            [_reference(kind, seed, mode, x[i], ROW_COMPS[n]) for i, n in enumerate(order)]
        )
        for res in results:
            got, alone = res[(kind, mode)]
            assert alone, (kind, mode)
            torch.testing.assert_close(torch.from_numpy(got).double(), want, atol=ATOL, rtol=RTOL)
