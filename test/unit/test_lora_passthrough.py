"""Pass-through and bit-exact restore.

* adapters stored but disabled, or all merged: outputs are ``torch.equal`` to the base layer's
  (disabled: the unchanged layer; merged: a plain layer holding the merged weight), for every
  class, fp32 and bf16, including ``skip_bias_add`` bias handling;
* 1,000 merge/unmerge cycles in bf16 leave the base weight bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fixtures.lora_layers import (
    IN,
    KINDS,
    build_layer,
    full_weights,
    load,
    random_adapter,
    rank_input,
)
from sglang.multimodal_gen.layers.lora import wrap_with_lora


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
