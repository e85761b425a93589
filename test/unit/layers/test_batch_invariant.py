"""A row's output does not depend on how many rows share the GEMM (CPU), under both CPU GEMM
backends (oneDNN, the default, rounds a single row differently; the BLAS as below).

The CPU BLAS rounds a row differently depending on the GEMM's row count (measured on an AMD EPYC
VM at 2 threads: 1-3, 5-7 and 9-11 rows differ from the same rows of a 64-row GEMM by up to
1e-5; at 16+ threads more counts, never a multiple of 4 from 16 rows on). Conditioning vectors
(timestep embedding, adaLN modulation) have one row per image, so without care an image would
change when its request joins a batch. ``layers.batch_invariant.linear_rows_invariant`` (used by
``ParallelLinear.apply_gemm`` and the LoRA paths) runs an input as its largest multiple of 4
rows plus a zero-padded remainder (short inputs: padded whole to a multiple of 4, at least
``MIN_CPU_GEMM_ROWS``). Reference: the backend's GEMM on 40 rows (a multiple of 4, the form
every input is reduced to), compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.layers import cpu_gemm
from sglang.multimodal_gen.layers.batch_invariant import MIN_CPU_GEMM_ROWS
from sglang.multimodal_gen.layers.cpu_gemm import cpu_linear
from sglang.multimodal_gen.layers.linear import ColumnParallelLinear, ReplicatedLinear

BACKENDS = ["onednn", "blas"] if cpu_gemm.onednn_available() else ["blas"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    before = cpu_gemm.cpu_gemm_backend()
    cpu_gemm.set_cpu_gemm_backend(request.param)
    yield request.param
    cpu_gemm.set_cpu_gemm_backend(before)


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear])
@pytest.mark.parametrize("k,n", [(32, 96), (256, 1024), (1024, 384)])
def test_short_inputs_equal_the_rows_of_a_tall_gemm(cls, k, n):
    g = torch.Generator().manual_seed(k + n)
    layer = cls(k, n, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(40, k, generator=g)
    with torch.no_grad():
        tall = cpu_linear(x, layer.weight, layer.bias)
        for rows in (1, 2, 3, 5, 9, 15, 17, 18, 19, 21, 27):
            out, _ = layer(x[:rows])
            assert torch.equal(out, tall[:rows]), (rows, float((out - tall[:rows]).abs().max()))
            out3, _ = layer(x[:rows].unsqueeze(1))  # [B, 1, k]: the adaLN shape
            assert out3.shape == (rows, 1, n) and torch.equal(out3[:, 0], tall[:rows])


@pytest.mark.usefixtures("backend")
def test_lora_terms_of_short_inputs_equal_the_rows_of_a_tall_batch():
    """The LoRA GEMMs get the same padding: a layer fed one vector per image (Flux LoRAs often
    target the adaLN ``norm1.linear``) gives each image the same bits alone and in a batch,
    with one composition for all rows and with a different composition per row."""
    from fixtures.lora_layers import IN, build_layer, full_weights, load, random_adapter
    from sglang.multimodal_gen.layers.lora import RowMapping, wrap_with_lora

    w, b = full_weights("replicated", 3)
    layer = wrap_with_lora(load(build_layer("replicated"), w, b))
    layer.add_adapter("a", random_adapter("replicated", 4, ranks=(5,)))
    layer.add_adapter("b", random_adapter("replicated", 5, ranks=(3,)))
    tall_rows = 4 * MIN_CPU_GEMM_ROWS + 4  # taller than any padded short input
    x = torch.randn(tall_rows, IN, generator=torch.Generator().manual_seed(6))
    comps = [[("a", 0.8)], [("b", 1.3)], [], [("a", 0.5), ("b", 0.5)]]
    with torch.no_grad():
        layer.set_active([("a", 0.8), ("b", -0.4)])
        tall, _ = layer(x)
        for rows in (1, 2, 3, 7):
            out, _ = layer(x[:rows])
            assert torch.equal(out, tall[:rows]), rows
        layer.set_active([])
        plan = [layer.composition(comps[i % len(comps)]) for i in range(tall_rows)]
        with layer.lora_context.rows(RowMapping.of(plan)):
            tall_rows, _ = layer(x)
        assert not torch.equal(tall_rows, tall)  # the per-row compositions matter
        for rows in (1, 2, 3, 7):
            with layer.lora_context.rows(RowMapping.of(plan[:rows])):
                out, _ = layer(x[:rows])
            assert torch.equal(out, tall_rows[:rows]), rows


@pytest.mark.usefixtures("backend")
def test_rows_stay_invariant_when_the_blas_splits_rows_over_many_threads():
    """At 16 threads the BLAS also rounds 17-19 and 25-27 rows differently (measured); the
    multiple-of-4 split keeps them equal to the rows of a taller GEMM (oneDNN: from 2 rows on
    at any thread count, measured)."""
    layer = ReplicatedLinear(256, 1536, bias=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1536, 256, generator=g))
        layer.bias.copy_(torch.randn(1536, generator=g))
    x = torch.randn(64, 256, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        with torch.no_grad():
            tall = cpu_linear(x, layer.weight, layer.bias)
            for rows in (1, 2, 3, 6, 17, 18, 19, 25, 26, 27, 37):
                out, _ = layer(x[:rows])
                assert torch.equal(out, tall[:rows]), rows
    finally:
        torch.set_num_threads(threads)
