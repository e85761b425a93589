"""LoRA layers and ``torch.inference_mode``; per-row strengths in one forward.

Weights created under ``inference_mode`` are inference tensors: an in-place update outside the
mode raises "Inplace update to inference tensor outside InferenceMode". Merge/unmerge/commit must
work both inside and outside the mode, on layers built inside or outside it.
Tolerances: fp32 vs fp64 reference atol 2e-4 / rtol 1e-4.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from fixtures.lora_layers import (
    IN,
    build_layer,
    dense_reference,
    full_weights,
    load,
    random_adapter,
)
from sglang.multimodal_gen.layers.lora import RowMapping, wrap_with_lora

ATOL, RTOL = 2e-4, 1e-4


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
