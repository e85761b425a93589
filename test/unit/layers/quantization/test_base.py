"""The quantization seam (``layers/quantization/base.py``): the unquantized method, the default
weight-only GEMM of a method, safetensors dtypes, and replacing a layer's method before loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures import quantized_layers as ql
from safetensors import safe_open
from safetensors.torch import save_file
from sglang.multimodal_gen.layers.quantization import (
    Fp8LinearMethod,
    Nvfp4LinearMethod,
    QuantizationMethod,
    UnquantizedLinearMethod,
    tensor_dtype,
)


def test_tensor_dtype_of_lazy_slices(tmp_path):
    dtypes = [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32, torch.int64]
    path = str(tmp_path / "t.safetensors")
    save_file({str(i): torch.zeros(2, dtype=d) for i, d in enumerate(dtypes)}, path)
    with safe_open(path, "pt") as f:
        assert [tensor_dtype(f.get_slice(str(i))) for i in range(len(dtypes))] == dtypes
    assert tensor_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float16


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.int32])
def test_unquantized_refuses_a_quantized_weight(dtype):
    layer = ql.build("column", 0, 1)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    with pytest.raises(
        ValueError,
        match=r"ColumnParallelLinear\(column\): weight has dtype .*"
        r"expected a floating-point dtype.*'ignore'",
    ):
        layer.weight_loader(layer.weight, torch.zeros(96, ql.IN).to(dtype))


def test_unquantized_dtype_and_gemm():
    layer = ql.build("row", 1, 2)
    w = torch.randn(48, 128)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, torch.zeros(48))
    m = layer.quant_method
    assert m.dequantize(layer, torch.float32) is layer.weight
    assert m.compute_dtype(layer) == layer.dtype == torch.float32
    assert m.weight_nbytes(layer) == 48 * 64 * 4  # the local weight, not the bias
    x = torch.randn(3, 64)
    torch.testing.assert_close(m.apply(layer, x, None), F.linear(x, w[:, 64:]))


class _Doubled(UnquantizedLinearMethod):
    """A method with only ``dequantize`` (twice the stored weight): the base ``apply`` runs
    the GEMM on the dequantized weight."""

    name = "doubled"
    apply = QuantizationMethod.apply

    def dequantize(self, layer, dtype):
        return (layer.weight * 2).to(dtype)


def test_default_apply_is_dequantize_then_gemm():
    layer = ql.build("column", 0, 1, _Doubled())
    w, b = torch.randn(96, ql.IN), torch.randn(96)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    x = torch.randn(4, ql.IN)
    torch.testing.assert_close(layer(x)[0], F.linear(x, 2 * w, b))


@pytest.mark.parametrize("method", [Fp8LinearMethod, Nvfp4LinearMethod])
def test_set_quant_method_replaces_the_storage_and_keeps_the_bias(method):
    layer = ql.build("qkv", 0, 2)
    bias = layer.bias
    layer.set_quant_method(method())
    assert layer.bias is bias and layer.quant_method.name == method.name
    params = dict(layer.named_parameters())
    assert set(params) == {"bias", *layer.quant_method.checkpoint_params}
    assert layer.checkpoint_params == (*layer.quant_method.checkpoint_params, "bias")
    assert layer.dtype == torch.float32  # the compute dtype stays the layer's
    assert not layer.quant_method.supports_lora_merge
