"""A row's output does not depend on how many rows share the GEMM (CPU).

The CPU BLAS computes short inputs with other kernels than tall ones, and their rows round
differently (measured on an AMD EPYC VM: 1-3, 5-7 and 9-11 rows differ from the same rows of a
64-row GEMM by up to 1e-5, for K = 32..1024). Conditioning vectors (timestep embedding, adaLN
modulation) have one row per image, so without care an image would change when its request joins
a batch. ``ParallelLinear.apply_gemm`` runs inputs shorter than ``MIN_CPU_GEMM_ROWS`` as that
many rows; this test pins that every short input equals the same rows of ``F.linear`` on
``MIN_CPU_GEMM_ROWS`` rows bit for bit (the reference is a plain GEMM of that height, so the test
holds on any CPU; that taller GEMMs agree with it is the BLAS's property, true where measured).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sglang.multimodal_gen.layers.linear import (
    MIN_CPU_GEMM_ROWS,
    ColumnParallelLinear,
    ReplicatedLinear,
)


@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear])
@pytest.mark.parametrize("k,n", [(32, 96), (256, 1024), (1024, 384)])
def test_short_inputs_equal_the_rows_of_a_tall_gemm(cls, k, n):
    g = torch.Generator().manual_seed(k + n)
    layer = cls(k, n, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(MIN_CPU_GEMM_ROWS, k, generator=g)
    tall = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        for rows in (1, 2, 3, 5, 9, MIN_CPU_GEMM_ROWS - 1):
            out, _ = layer(x[:rows])
            assert torch.equal(out, tall[:rows]), (rows, float((out - tall[:rows]).abs().max()))
            out3, _ = layer(x[:rows].unsqueeze(1))  # [B, 1, k]: the adaLN shape
            assert out3.shape == (rows, 1, n) and torch.equal(out3[:, 0], tall[:rows])


def test_lora_terms_of_short_inputs_equal_the_rows_of_a_tall_batch():
    """The LoRA GEMMs get the same padding: a layer fed one vector per image (Flux LoRAs often
    target the adaLN ``norm1.linear``) gives each image the same bits alone and in a batch,
    with one composition for all rows and with a different composition per row."""
    from lora_helpers import IN, build_layer, full_weights, load, random_adapter
    from sglang.multimodal_gen.layers.lora import wrap_with_lora
    from sglang.multimodal_gen.layers.lora.rows import RowPlan, lora_rows

    w, b = full_weights("replicated", 3)
    layer = wrap_with_lora(load(build_layer("replicated"), w, b))
    layer.add_adapter("a", random_adapter("replicated", 4, ranks=(5,)))
    layer.add_adapter("b", random_adapter("replicated", 5, ranks=(3,)))
    x = torch.randn(MIN_CPU_GEMM_ROWS, IN, generator=torch.Generator().manual_seed(6))
    comps = [[("a", 0.8)], [("b", 1.3)], [], [("a", 0.5), ("b", 0.5)]]
    with torch.no_grad():
        layer.set_active([("a", 0.8), ("b", -0.4)])
        tall, _ = layer(x)
        for rows in (1, 2, 3, 7):
            out, _ = layer(x[:rows])
            assert torch.equal(out, tall[:rows]), rows
        layer.set_active([])
        plan = [comps[i % len(comps)] for i in range(MIN_CPU_GEMM_ROWS)]
        with lora_rows(RowPlan.of(plan)):
            tall_rows, _ = layer(x)
        assert not torch.equal(tall_rows, tall)  # the per-row compositions matter
        for rows in (1, 2, 3, 7):
            with lora_rows(RowPlan.of(plan[:rows])):
                out, _ = layer(x[:rows])
            assert torch.equal(out, tall_rows[:rows]), rows
