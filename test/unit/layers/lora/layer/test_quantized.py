"""LoRA over quantized :class:`ParallelLinear` layers (FP8 checkpoint and online, NVFP4), one
process.

The layers are built with ``quant_method=`` and loaded through ``weight_loader`` from per-source
quantized tensors (``models.quantized_export.quantize_fp8`` / ``quantize_nvfp4``: one per-tensor
scale per q / k / v source, so the fused layer's rows carry three different scales), or from
floating-point ones quantized per row while loading (online FP8). Reference: ``F.linear`` in
float64 on the weight decoded here by hand (FP8: ``q * scale``; NVFP4: the E2M1 table times the
block scale times the global scale) plus ``sum_i s_i c_i B_i A_i`` and the offsets, computed
from the adapter's full tensors. The LoRA pair must run in the compute dtype
(fp32 here, bf16 in one case) beside the quantized GEMM; a quantized layer never merges.
Measured (fp32, CPU): worst abs error 1.5e-5 against the reference, whose LoRA term reaches
6.7-8.3; TP 2 rank pieces vs one process: bit-equal (qkv), 4.8e-6 (row: a sum of two partials).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from sglang.multimodal_gen.layers.linear import QKVParallelLinear, RowParallelLinear
from sglang.multimodal_gen.layers.lora import LoRAWeights, wrap_with_lora
from sglang.multimodal_gen.layers.lora.composition import RowMapping
from sglang.multimodal_gen.layers.quantization.fp8 import Fp8LinearMethod, quantize_rows_fp8
from sglang.multimodal_gen.layers.quantization.nvfp4 import Nvfp4LinearMethod
from sglang.multimodal_gen.models.quantized_export import quantize_fp8, quantize_nvfp4

IN = 64  # NVFP4 blocks of 16 columns: 32 per rank at TP 2
QKV = dict(head_size=8, total_num_heads=4, total_num_kv_heads=2)  # q 32, k 16, v 16 rows
SOURCES = {"qkv": {"q": 32, "k": 16, "v": 16}, "row": {None: 48}}
ATOL, RTOL = 2e-4, 1e-4
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


FORMATS = ["fp8", "fp8-online", "nvfp4"]


def _method(fmt: str):
    if fmt == "nvfp4":
        return Nvfp4LinearMethod()
    return Fp8LinearMethod(online=fmt == "fp8-online")


def _build(kind: str, fmt: str, tp_rank: int = 0, tp_size: int = 1, dtype=torch.float32):
    kw = dict(params_dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, quant_method=_method(fmt))
    if kind == "qkv":
        return QKVParallelLinear(IN, **QKV, bias=True, prefix="blocks.0.attn.to_qkv", **kw)
    # a partial sum per rank (the test adds them): the bias is returned, added once
    return RowParallelLinear(IN, 48, bias=True, input_is_parallel=False, reduce_results=False,
                             skip_bias_add=True, prefix="blocks.0.ff.down", **kw)  # fmt: skip


def _decode_fp4(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (low nibble first, bit 3 the sign) -> float64 values ``[N, 2 * cols]``."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    return _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()


def _quantized_sources(kind: str, fmt: str, seed: int):
    """``({source: checkpoint tensors}, dense float64 weight [out, in], bias [out])``."""
    g = torch.Generator().manual_seed(seed)
    tensors, dense = {}, []
    for i, (sid, rows) in enumerate(SOURCES[kind].items()):
        w = torch.randn(rows, IN, generator=g) * (0.5 + i)  # three distinct scales
        if fmt == "fp8":
            q, s = quantize_fp8(w)
            tensors[sid] = dict(weight=q, weight_scale=s, input_scale=torch.tensor(1.0))
            dense.append(q.double() * s.double())
        elif fmt == "fp8-online":  # quantized per output row while loading
            tensors[sid] = dict(weight=w)
            q, s = quantize_rows_fp8(w)
            dense.append(q.double() * s.double()[:, None])
        else:
            packed, bs, gs = quantize_nvfp4(w)
            tensors[sid] = dict(weight=packed, weight_scale=bs, weight_scale_2=gs,
                                input_scale=torch.tensor(1.0))  # fmt: skip
            block = bs.double().repeat_interleave(16, dim=1)
            dense.append(_decode_fp4(packed) * block * gs.double())
    bias = torch.randn(sum(SOURCES[kind].values()), generator=g)
    return tensors, torch.cat(dense), bias


def _load(layer, tensors, bias):
    for sid, named in tensors.items():
        for name, t in named.items():
            layer.weight_loader(getattr(layer, name), t, sid)
    layer.weight_loader(layer.bias, bias)
    layer.process_weights_after_loading()
    return layer


def _adapter(kind: str, seed: int, offset: bool) -> dict:
    """``{source: LoRAWeights}``: random non-zero A and B, ranks 4 / 2 / 3 per source."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (sid, rows) in enumerate(SOURCES[kind].items()):
        r = (4, 2, 3)[i]
        a = torch.randn(r, IN, generator=g) / IN**0.5
        b = torch.randn(rows, r, generator=g)
        off = torch.randn(rows, generator=g) if offset else None
        out[sid] = LoRAWeights(a, b, 0.5 + 0.25 * i, off)
    return out


def _reference(kind, dense, bias, x, adapters) -> torch.Tensor:
    """``x (W + sum s c B A)^T + b + sum s c offset`` in float64, by source rows."""
    dw = torch.zeros_like(dense)
    off = torch.zeros(dense.shape[0], dtype=torch.float64)
    start = 0
    for sid, rows in SOURCES[kind].items():
        for weights, strength in adapters:
            w = weights[sid]
            c = strength * w.scale
            dw[start : start + rows] += c * (w.lora_B.double() @ w.lora_A.double())
            if w.offset is not None:
                off[start : start + rows] += c * w.offset.double()
        start += rows
    return F.linear(x.double(), dense + dw, bias.double()) + off


def _lora_layer(kind, fmt, seed=0, tp_rank=0, tp_size=1, dtype=torch.float32):
    tensors, dense, bias = _quantized_sources(kind, fmt, seed)
    layer = wrap_with_lora(_load(_build(kind, fmt, tp_rank, tp_size, dtype), tensors, bias))
    a, b = _adapter(kind, seed + 1, offset=True), _adapter(kind, seed + 2, offset=False)
    layer.add_adapter("a", a)
    layer.add_adapter("b", b)
    return layer, dense, bias, a, b


def _out(layer, x):
    y, out_bias = layer(x)
    return y if out_bias is None else y + out_bias


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_forward_is_dequantized_gemm_plus_lora(kind, fmt):
    layer, dense, bias, a, b = _lora_layer(kind, fmt)
    stored = torch.uint8 if fmt == "nvfp4" else torch.float8_e4m3fn
    assert layer.base_layer.weight.dtype == stored
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(9))
    base = _reference(kind, dense, bias, x, [])
    torch.testing.assert_close(_out(layer, x).double(), base, atol=ATOL, rtol=RTOL)
    layer.set_active([("a", 0.7), ("b", -1.3)])
    want = _reference(kind, dense, bias, x, [(a, 0.7), (b, -1.3)])
    assert (want - base).abs().max() > 0.5  # the LoRA term is far above the tolerance
    got = _out(layer, x)
    assert got.dtype == torch.float32 and layer.lora_a.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    assert not layer.merged


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_rows_each_equal_their_composition_alone(fmt):
    """Batches whose rows use a, nothing and a + b (the global composition) in every order, the
    first twice (a group of scattered rows): each row bit-equal to its forward alone (the
    dequantized GEMM is row-invariant on the CPU)."""
    layer, *_ = _lora_layer("qkv", fmt, seed=3)
    comps = [[("a", 0.8)], [], [("a", -0.4), ("b", 0.9)]]
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(4))
    alone = []
    for comp in comps:
        layer.set_active(comp)
        alone.append(layer(x[None])[0][0])
    assert not torch.equal(alone[0], alone[1]) and not torch.equal(alone[0], alone[2])
    layer.set_active(comps[2])
    for order in itertools.permutations(range(len(comps))):
        rows = [*order, order[0]]  # the first composition twice, apart
        mapping = RowMapping.of([layer.composition(comps[i]) for i in rows])
        with layer.lora_context.rows(mapping):
            batch = layer(x.expand(len(rows), *x.shape))[0]
        for r, i in enumerate(rows):
            assert torch.equal(batch[r], alone[i]), (fmt, order, r)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_layer_refuses_to_merge(fmt):
    layer, *_ = _lora_layer("qkv", fmt, dtype=torch.bfloat16)
    layer.set_active([("a", 1.0)])
    # the LoRA pair follows the compute dtype, not the stored FP8 / packed FP4 dtype
    assert layer.base_layer.dtype == torch.bfloat16
    assert layer.lora_a.dtype == layer.lora_b.dtype == torch.bfloat16
    assert not layer.can_merge
    assert f"quantized ({fmt[:3]}" in layer.merge_refusal
    weight = layer.base_layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.to_qkv.*quantized"):
        layer.merge()
    with pytest.raises(ValueError, match="quantized"):
        layer.commit_as_base()
    assert not layer.merged and torch.equal(layer.base_layer.weight, weight)
    assert layer.active_composition == layer.composition([("a", 1.0)])
    x = torch.randn(2, IN, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    assert layer(x)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_tp2_pieces_equal_one_process(kind, fmt):
    """Rank r of 2 (each with its rows of the per-source scales, or its NVFP4 column blocks):
    the all-gathered (qkv) or summed (row) outputs equal the one-process layer's."""
    x = torch.randn(2, 4, IN, generator=torch.Generator().manual_seed(6))
    comp = [("a", 0.6), ("b", 1.4)]
    one, dense, bias, a, b = _lora_layer(kind, fmt)
    one.set_active(comp)
    want = _out(one, x)
    pieces = []
    for rank in range(2):
        layer, *_ = _lora_layer(kind, fmt, tp_rank=rank, tp_size=2)
        layer.set_active(comp)
        pieces.append(layer(x)[0])
    if kind == "qkv":
        got = layer.base_layer.gathered_to_full(torch.cat(pieces, dim=-1))
    else:  # partial sums; the offsets come from rank 0 alone, the bias is added once
        got = pieces[0] + pieces[1] + layer.base_layer.bias
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    ref = _reference(kind, dense, bias, x, [(a, 0.6), (b, 1.4)])
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)
