"""The CPU GEMM backend of linear layers (``layers.cpu_gemm``, ``--cpu-gemm-backend``).

oneDNN's fp32 GEMM must stay exact fp32 (inputs, products and accumulation in fp32): its error
against a float64 product is fp32 rounding, as the BLAS's is, never bf16/TF32 rounding. The
packed copy must follow every change of the weight (an in-place write, a swapped storage, a
reload), or a LoRA merge would silently run on the old weight. Compiled graphs call the same
kernel (bit-identical to eager) without graph breaks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from sglang.multimodal_gen.layers import cpu_gemm
from sglang.multimodal_gen.layers.cpu_gemm import (
    PackedWeight,
    check_cpu_gemm_backend,
    cpu_linear,
    set_cpu_gemm_backend,
)
from sglang.multimodal_gen.layers.linear import ColumnParallelLinear, ReplicatedLinear

needs_onednn = pytest.mark.skipif(
    not cpu_gemm.onednn_available(), reason="PyTorch without oneDNN on x86-64"
)


@pytest.fixture
def backend():
    """Set a backend for one test; the process default comes back afterwards."""
    before = cpu_gemm.cpu_gemm_backend()
    yield set_cpu_gemm_backend
    set_cpu_gemm_backend(before)


def _rel_err(y: torch.Tensor, ref64: torch.Tensor) -> float:
    return float((y.double() - ref64).abs().max() / ref64.abs().max())


@needs_onednn
@pytest.mark.parametrize("name", ["onednn", "onednn-packed", "blas"])
@pytest.mark.parametrize("k,n", [(96, 160), (768, 512)])
def test_every_backend_is_exact_fp32(backend, name, k, n):
    """Error against float64 at fp32 rounding (bf16 inputs would be ~1e-3, TF32 ~1e-4) and
    within fp32 rounding of ``F.linear``; 3-D inputs keep their leading dims."""
    backend(name)
    g = torch.Generator().manual_seed(k + n)
    layer = ReplicatedLinear(k, n, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        layer.bias.copy_(torch.randn(n, generator=g))
        x = torch.randn(3, 37, k, generator=g)
        y, _ = layer(x)
    ref64 = x.double() @ layer.weight.double().T + layer.bias.double()
    assert y.shape == (3, 37, n)
    assert _rel_err(y, ref64) < 5e-6
    assert _rel_err(F.linear(x, layer.weight, layer.bias), ref64) < 5e-6


@needs_onednn
def test_onednn_is_the_default_and_differs_from_the_blas_in_rounding_only(backend):
    """``auto`` resolves to ``onednn`` here; its output is not the BLAS's bit for bit (a
    different kernel runs) but agrees to fp32 rounding."""
    assert check_cpu_gemm_backend("auto") == "onednn"
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 768, generator=g), torch.randn(512, 768, generator=g)
    backend("onednn")
    y_dnn = cpu_linear(x, w)
    backend("blas")
    y_blas = cpu_linear(x, w)
    assert torch.equal(y_blas, F.linear(x, w))
    assert not torch.equal(y_dnn, y_blas)
    torch.testing.assert_close(y_dnn, y_blas, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_gemms_that_record_gradients_or_are_not_fp32_run_f_linear(backend):
    backend("onednn")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g)
    y = cpu_linear(x, w)
    assert torch.equal(y, F.linear(x, w))
    y.sum().backward()  # autograd works
    assert x.grad is not None
    xb, wb = x.detach().bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear(xb, wb), F.linear(xb, wb))


@needs_onednn
def test_the_packed_copy_follows_every_change_of_the_weight(backend):
    """In-place writes (``copy_``, ``add_``: a LoRA merge into the parameter), a swapped storage
    (``.data =``: a merge swapping its result in), another weight, and a reload."""
    backend("onednn-packed")
    g = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(64, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=g))
    packed = layer.quant_method.packed
    x = torch.randn(12, 64, generator=g)

    def check():
        with torch.no_grad():
            y, _ = layer(x)
        ref = x.double() @ layer.weight.double().T
        assert _rel_err(y, ref) < 5e-6
        assert packed.packed

    check()
    with torch.no_grad():
        layer.weight.add_(torch.randn(96, 64, generator=g))
    check()
    with torch.no_grad():
        layer.weight.data = torch.randn(96, 64, generator=g)
    check()
    layer.weight_loader(layer.weight, torch.randn(96, 64, generator=g))
    assert not packed.packed  # a load drops the copy (writes through .data move no counter)
    check()
    copied = copy.deepcopy(layer)  # a copy starts without one
    assert not copied.quant_method.packed.packed
    with torch.no_grad():
        torch.testing.assert_close(copied(x)[0], layer(x)[0], rtol=0, atol=0)


@needs_onednn
def test_a_packed_weight_is_never_pickled():
    import pickle

    p = PackedWeight()
    p.get(torch.randn(8, 4))
    assert p.packed and not pickle.loads(pickle.dumps(p)).packed


@needs_onednn
@pytest.mark.parametrize("name", ["onednn", "onednn-packed"])
def test_compiled_layers_run_the_same_kernel_without_graph_breaks(backend, name):
    """``fullgraph=True`` succeeds and the compiled output equals eager bit for bit."""
    backend(name)
    g = torch.Generator().manual_seed(4)
    layer = ReplicatedLinear(64, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=g))
        layer.bias.copy_(torch.randn(96, generator=g))

    def f(x):
        return layer(x)[0].relu()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        for rows in (1, 5, 33):
            x = torch.randn(rows, 64, generator=g)
            assert torch.equal(compiled(x), f(x)), rows


def test_unknown_backends_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--cpu-gemm-backend 'mkl'"):
        check_cpu_gemm_backend("mkl")


def test_the_flag_reaches_server_args_and_refuses_bad_values():
    import argparse

    from sglang.multimodal_gen.configs.parallel import add_kernel_args

    parser = argparse.ArgumentParser()
    add_kernel_args(parser)
    assert parser.parse_args([]).cpu_gemm_backend == "auto"
    assert parser.parse_args(["--cpu-gemm-backend", "blas"]).cpu_gemm_backend == "blas"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-gemm-backend", "mkl"])


@needs_onednn
def test_lora_merges_and_switches_drop_the_packed_copy(backend):
    """A merge points the weight at the merged tensor through ``.data`` (no version counter
    moves, and the merged tensor may reuse the address of one freed just before): the layer is
    told (``ParallelLinear.weight_changed``), so every forward after a merge, an unmerge or a
    switch to another merged adapter runs on the weight it holds (fp64 reference)."""
    from fixtures.lora_layers import (
        IN,
        build_layer,
        dense_reference,
        full_weights,
        load,
        random_adapter,
    )
    from sglang.multimodal_gen.layers.lora import wrap_with_lora

    backend("onednn-packed")
    w, b = full_weights("replicated", 8)
    layer = wrap_with_lora(load(build_layer("replicated"), w, b))
    adapters = {n: random_adapter("replicated", s, ranks=(4,)) for n, s in (("a", 9), ("b", 10))}
    for name, weights in adapters.items():
        layer.add_adapter(name, weights)
    told = []
    changed = layer.base_layer.weight_changed
    layer.base_layer.weight_changed = lambda: (told.append(1), changed())
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(11))
    for active in ([("a", 0.8)], [("b", 1.2)], [], [("a", -0.5), ("b", 0.7)], [("a", 0.8)]):
        with torch.no_grad():
            layer.set_active(active)
            before = len(told)
            layer.merge()
            y, _ = layer(x)
            layer.unmerge()
            y_unmerged, _ = layer(x)
        if active:  # a merge and an unmerge swapped storage: the layer was told each time
            assert len(told) - before == 2, active
        ref = dense_reference("replicated", w, b, x, [(adapters[n], s) for n, s in active])
        assert _rel_err(y, ref) < 1e-5, active
        assert _rel_err(y_unmerged, ref) < 1e-5, active


@needs_onednn
def test_a_weight_swapped_in_at_the_old_address_is_packed_again(backend):
    """``weight_changed`` after a ``.data`` swap: the new tensor here is the old storage
    rewritten through another alias (what a merged weight allocated where the previous one was
    freed looks like: same address, the parameter's version counter unchanged)."""
    backend("onednn-packed")
    g = torch.Generator().manual_seed(12)
    layer = ReplicatedLinear(32, 48, bias=False)
    buf = torch.randn(48, 32, generator=g)
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        layer.weight.data = buf
        layer.weight_changed()
        layer(x)  # packs buf
        buf.copy_(torch.randn(48, 32, generator=g))  # the parameter's counter does not move
        layer.weight.data = buf
        layer.weight_changed()
        y, _ = layer(x)
    assert _rel_err(y, x.double() @ buf.double().T) < 5e-6


@needs_onednn
@pytest.mark.parametrize("name", ["onednn", "onednn-packed"])
def test_odd_layouts_equal_f_linear(backend, name):
    """Whatever oneDNN cannot take as it is runs ``F.linear``: a strided, 0-d or expanded bias,
    a weight with no output rows; inference-tensor weights (no version counter) run unpacked."""
    backend(name)
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(7, 24, generator=g), torch.randn(10, 24, generator=g)
    b2 = torch.randn(20, generator=g)
    for bias in (b2[::2], torch.tensor(0.5), torch.tensor([0.25]).expand(10)):
        torch.testing.assert_close(cpu_linear(x, w, bias), F.linear(x, w, bias))
    assert cpu_linear(x, w[:0]).shape == (7, 0)
    with torch.inference_mode():
        w_inf = torch.randn(10, 24, generator=g)
    p = PackedWeight()
    assert p.get(w_inf) is w_inf and not p.packed
    with torch.inference_mode():
        layer = ReplicatedLinear(24, 10, bias=True)
        y, _ = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
