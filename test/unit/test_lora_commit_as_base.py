"""``commit_as_base``: the merged weight becomes the new base that ``unmerge`` restores.

* later adapters stack on top of the committed weight;
* base + dynamic ``s2`` after committing ``s1`` equals one merge at ``s1 + s2``;
* re-merging the same adapter at ``-s`` and committing restores the original within fp32 rounding.
Tolerances: fp32 weights atol 1e-5; outputs vs fp64 reference atol 2e-4 / rtol 1e-4.
"""

from __future__ import annotations

import torch
from fixtures.lora_layers import (
    IN,
    build_layer,
    dense_reference,
    full_weights,
    load,
    random_adapter,
)
from sglang.multimodal_gen.layers.lora import Composition, wrap_with_lora

ATOL, RTOL = 2e-4, 1e-4


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
