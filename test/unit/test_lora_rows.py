"""Per-row LoRA compositions in one forward (``layers/lora/rows.py``) against the dense reference.

Each row of a batch is compared with ``F.linear`` on the full weight plus that row's own adapters
(fp64), for every wrapper kind, unmerged and merged, simulated TP 1 / 2 and real gloo TP 2: a row
that picked up another row's adapter, or missed its own, is off by the adapter's delta (order 1),
far above the tolerance (measured error below 5e-6). Rows: the layer's active composition
(``None``), no LoRA, adapter 0 alone, both at other strengths, and adapter 1 alone.
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import (
    IN,
    KINDS,
    assemble,
    build_layer,
    dense_reference,
    full_weights,
    load,
    random_adapter,
    rank_input,
)
from sglang.multimodal_gen.distributed import get_tp_rank, get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.lora import runtime_lora_scale, wrap_with_lora
from sglang.multimodal_gen.layers.lora.rows import RowPlan, lora_row_tokens, lora_rows

ATOL, RTOL = 2e-5, 1e-5
ACTIVE = [("a0", 0.7)]
ROWS = [None, [], [("a0", 0.7)], [("a0", -0.5), ("a1", 1.2)], [("a1", 2.0)]]


def _adapters(kind, seed, offset):
    return {
        "a0": random_adapter(kind, seed, ranks=(4, 2, 6), offset=offset),
        "a1": random_adapter(kind, seed + 1, ranks=(3,), fused=True, offset=offset),
    }


def _row_adapters(adapters, row):
    comp = ACTIVE if row is None else row
    return [(adapters[n], s) for n, s in comp]


def _layer(kind, seed, mode, tp_rank=None, tp_size=None, **flags):
    w, b = full_weights(kind, seed)
    layer = wrap_with_lora(load(build_layer(kind, tp_rank, tp_size, **flags), w, b))
    for name, weights in _adapters(kind, seed + 10, offset="offset" in mode).items():
        layer.add_adapter(name, weights)
    layer.set_active(ACTIVE)
    if mode.startswith("merged"):
        layer.merge()
    return layer


def _expected(kind, seed, mode, x, rows=ROWS, scale=1.0):
    w, b = full_weights(kind, seed)
    adapters = _adapters(kind, seed + 10, offset="offset" in mode)
    return torch.stack(
        [
            dense_reference(
                kind, w, b, x[i], [(a, s * scale) for a, s in _row_adapters(adapters, r)]
            )
            for i, r in enumerate(rows)
        ]
    )


MODES = ("unmerged", "merged", "unmerged_offset", "merged_offset")


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_match_each_rows_own_reference(kind, mode, tp_size):
    seed = 40 + KINDS.index(kind)
    x = torch.randn(len(ROWS), 3, IN, generator=torch.Generator().manual_seed(seed))
    layers = [_layer(kind, seed, mode, r, tp_size) for r in range(tp_size)]
    with lora_rows(RowPlan.of(ROWS)):
        outs = [layer(rank_input(kind, x, r, tp_size))[0] for r, layer in enumerate(layers)]
    got = assemble(kind, layers, outs)
    torch.testing.assert_close(got, _expected(kind, seed, mode, x), atol=ATOL, rtol=RTOL)
    # the plan ends with the block: the layer is back to its own (active) composition
    plain = assemble(
        kind, layers, [la(rank_input(kind, x, r, tp_size))[0] for r, la in enumerate(layers)]
    )
    torch.testing.assert_close(
        plain, _expected(kind, seed, mode, x, rows=[None] * len(ROWS)), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("mode", ["unmerged_offset", "merged_offset"])
def test_runtime_scale_and_flattened_rows(mode):
    """A flattened input (rows concatenated, ``lora_row_tokens``) at runtime scale 0.5."""
    kind, seed = "qkv", 5
    layer = _layer(kind, seed, mode)
    tokens = [2, 1, 3, 2, 1]
    xs = [
        torch.randn(t, IN, generator=torch.Generator().manual_seed(seed + i))
        for i, t in enumerate(tokens)
    ]
    with lora_rows(RowPlan.of(ROWS)), runtime_lora_scale(0.5), lora_row_tokens(tokens):
        got = layer(torch.cat(xs))[0]
    want = torch.cat(
        [_expected(kind, seed, mode, x[None], rows=[r], scale=0.5)[0] for x, r in zip(xs, ROWS)]
    )
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def test_uniform_plan_and_errors():
    kind, seed = "column", 9
    layer = _layer(kind, seed, "merged")
    x = torch.randn(3, 4, IN, generator=torch.Generator().manual_seed(1))
    with lora_rows(RowPlan.of([[("a1", 1.5)]])):  # one composition for every row
        got = layer(x)[0]
    want = _expected(kind, seed, "merged", x, rows=[[("a1", 1.5)]] * 3)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    with lora_rows(RowPlan.of(ROWS)), pytest.raises(ValueError, match="'column'.*5 rows"):
        layer(x)
    with lora_rows(RowPlan.of(ROWS)), pytest.raises(ValueError, match="3 token counts"):
        with lora_row_tokens([1, 2, 3]):
            pass


def _gloo_rank_fn(rank, seed):
    assert (get_tp_rank(), get_tp_world_size()) == (rank, 2)
    x = torch.randn(len(ROWS), 3, IN, generator=torch.Generator().manual_seed(seed))
    out = {}
    for kind in ("column", "qkv", "row_full_input"):
        for mode in ("unmerged_offset", "merged_offset"):
            flags = {} if kind.startswith("row") else {"gather_output": True}
            layer = _layer(kind, seed, mode, **flags)
            with lora_rows(RowPlan.of(ROWS)):
                out[(kind, mode)] = layer(x)[0].numpy()
    return out


def test_gloo_tp2_rows():
    seed = 21
    results = launch_processes(_gloo_rank_fn, 2, args=(seed,), backend="gloo")
    x = torch.randn(len(ROWS), 3, IN, generator=torch.Generator().manual_seed(seed))
    for kind, mode in results[0]:
        want = _expected(kind, seed, mode, x)
        for res in results:
            torch.testing.assert_close(
                torch.from_numpy(res[(kind, mode)]).double(), want, atol=ATOL, rtol=RTOL
            )


def test_replaced_adapter_is_not_served_from_the_union_cache():
    """An adapter removed and added again under the same name (other weights) after a mixed
    forward: the next mixed forward uses the new weights, not the union compiled from the old
    ones (a freed adapter's storage may be reused by the next one, so identity is no key)."""
    kind, seed = "column", 11
    layer = _layer(kind, seed, "unmerged")
    w, b = full_weights(kind, seed)
    x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(2))
    plan = RowPlan.of([[("a0", 1.0)], []])
    versions = [random_adapter(kind, seed + 50 + i, ranks=(3,)) for i in range(2)]
    for i in range(4):
        with lora_rows(plan):
            layer(x)
        new = versions[i % 2]
        layer.remove_adapter("a0")
        layer.add_adapter("a0", new)
        with lora_rows(plan):
            got = layer(x)[0]
        want = torch.stack(
            [dense_reference(kind, w, b, x[0], [(new, 1.0)]), dense_reference(kind, w, b, x[1], [])]
        )
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    assert layer._rows_cache is not None
    layer.remove_adapter("a1")  # removing an adapter frees the union that holds a copy of it
    assert layer._rows_cache is None
