"""Quantized storage of :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear` under module
casts and ``torch.compile``: ``.to(dtype)`` / ``.half()`` only move an FP8 weight, its fp32
scales and a packed FP4 weight (``float8_e4m3fn`` counts as floating point, so a plain
``nn.Module`` cast would convert them), the compute dtype and the bias follow the cast; and a
quantized layer's forward traces as one graph."""

from __future__ import annotations

import pytest
import torch
from fixtures import quantized_layers as ql
from sglang.multimodal_gen.layers.quantization import Fp8LinearMethod, Nvfp4LinearMethod
from sglang.multimodal_gen.models.quantized_export import quantize_fp8, quantize_nvfp4

METHODS = {
    "fp8": Fp8LinearMethod,
    "online-fp8": lambda: Fp8LinearMethod(online=True),
    "nvfp4": Nvfp4LinearMethod,
}


def _loaded(name):
    """A fused q/k/v layer of ``name`` loaded with seeded sources and a bias."""
    gen = torch.Generator().manual_seed(4)
    layer = ql.build("qkv", 0, 1, METHODS[name]())
    bias = ql.full_bias("qkv", gen)
    for sid, w in ql.full_weights("qkv", gen).items():
        layer.weight_loader(layer.bias, bias[sid], sid)
        if name == "online-fp8":
            layer.weight_loader(layer.weight, w, sid)
            continue
        if name == "fp8":
            codes, s = quantize_fp8(w)
            tensors = {"weight": codes, "weight_scale": s}
        else:
            packed, block, g = quantize_nvfp4(w)
            tensors = {"weight": packed, "weight_scale": block, "weight_scale_2": g}
        tensors["input_scale"] = torch.tensor(1.0)
        for leaf, t in tensors.items():
            layer.weight_loader(getattr(layer, leaf), t, sid)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("name", list(METHODS))
def test_casts_move_but_never_convert_quantized_tensors(name):
    layer = _loaded(name)
    stored = {n: (t.dtype, t.clone()) for n, t in layer.state_dict().items() if n != "bias"}
    bias = layer.bias.detach().clone()
    order = list(layer.state_dict())
    x = torch.randn(3, ql.IN)
    want = layer(x)[0]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(layer)
        for n, (dtype, value) in stored.items():
            t = layer.state_dict()[n]
            assert t.dtype == dtype and torch.equal(t.view(torch.uint8), value.view(torch.uint8))
    assert list(layer.state_dict()) == order
    assert layer.dtype == torch.float32 and layer.bias.dtype == torch.float32
    layer.bias.data.copy_(bias)  # the bias went through bf16 and fp16: its rounding, not ours
    torch.testing.assert_close(layer(x)[0], want, rtol=0, atol=0)
    layer.to(torch.bfloat16)
    assert layer.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert layer(x.bfloat16())[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(METHODS))
def test_forward_traces_as_one_graph(name):
    """``fullgraph=True`` fails on any graph break (the eager backend: no code generation)."""
    layer = _loaded(name)
    x = torch.randn(5, ql.IN)
    compiled = torch.compile(lambda t: layer(t)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x)[0], rtol=0, atol=0)
