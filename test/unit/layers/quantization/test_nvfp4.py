"""NVFP4 (``layers/quantization/nvfp4.py``): the E2M1 decoding and block / global scales against
numbers computed here by hand, and every parallel layer kind at TP 1, 2 and 4 against the
unquantized layer's shard map (``fixtures.quantized_layers``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures import quantized_layers as ql
from sglang.multimodal_gen.layers.quantization.nvfp4 import (
    Nvfp4LinearMethod,
    dequantize_nvfp4,
    unpack_e2m1,
)
from sglang.multimodal_gen.models.quantized_export import quantize_nvfp4


def _e2m1(code: int) -> float:
    """E2M1 by its bit fields (OCP MX v1.0): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit
    0; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def test_unpack_reads_every_code_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | ((15 - codes) << 4)).to(torch.uint8).reshape(1, 16)  # low i, high 15 - i
    got = unpack_e2m1(packed)[0].tolist()
    want = [v for i in range(16) for v in (_e2m1(i), _e2m1(15 - i))]
    assert got == want
    assert [_e2m1(i) for i in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_dequantize_against_element_by_element_reference():
    gen = torch.Generator().manual_seed(1)
    n, k = 3, 48
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    block = (torch.rand(n, k // 16, generator=gen) * 20 + 0.01).to(torch.float8_e4m3fn)
    for g in (torch.tensor(0.37), torch.tensor([0.5, 2.0, 7.0])):
        got = dequantize_nvfp4(packed, block, g)
        want = torch.empty(n, k)
        for i in range(n):
            gi = float(g) if g.dim() == 0 else float(g[i])
            for j in range(k):
                byte = int(packed[i, j // 2])
                code = byte & 0xF if j % 2 == 0 else byte >> 4
                want[i, j] = _e2m1(code) * float(block[i, j // 16].float()) * gi
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_export_quantizer_round_trip_bound():
    """``quantize_nvfp4`` then ``dequantize_nvfp4``: each element within half an E2M1 step of its
    block (at most 1 of 6 units of the block scale) plus the block scale's own e4m3 rounding."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen) * torch.logspace(-2, 1, 8)[:, None]
    packed, block, g = quantize_nvfp4(w)
    deq = dequantize_nvfp4(packed, block, g)
    unit = (block.float() * g).repeat_interleave(16, dim=1)
    amax = w.abs().reshape(8, 4, 16).amax(-1).repeat_interleave(16, dim=1)
    assert ((w - deq).abs() <= unit + amax * 2**-3 + 1e-12).all()
    assert (w - deq).abs().max() > 0  # really quantized


def test_group_size_and_unaligned_partitions_refused():
    with pytest.raises(ValueError, match="group_size 32"):
        Nvfp4LinearMethod(group_size=32)
    from sglang.multimodal_gen.layers.linear import RowParallelLinear

    with pytest.raises(ValueError, match=r"RowParallelLinear\(odd\).*blocks of 16"):
        RowParallelLinear(
            48, 16, prefix="odd", tp_rank=1, tp_size=2, quant_method=Nvfp4LinearMethod()
        )


def _quantized_sources(kind, gen):
    """``{sid: (packed, block, global, input_scale)}`` and the fp32 dequantized sources."""
    q, deq = {}, {}
    for i, (sid, w) in enumerate(ql.full_weights(kind, gen).items()):
        packed, block, g = quantize_nvfp4(w)
        q[sid] = (packed, block, g, torch.tensor(0.25 * (i + 1)))
        deq[sid] = dequantize_nvfp4(packed, block, g)
    return q, deq


def _load(layer, q, bias, pre_sharded=False):
    for sid, (packed, block, g, s_in) in q.items():
        layer.weight_loader(layer.weight, packed, sid, pre_sharded)
        layer.weight_loader(layer.weight_scale, block, sid, pre_sharded)
        layer.weight_loader(layer.weight_scale_2, g, sid, pre_sharded)
        layer.weight_loader(layer.input_scale, s_in, sid)
        layer.weight_loader(layer.bias, bias[sid], sid, pre_sharded)
    layer.process_weights_after_loading()


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ql.KINDS)
def test_local_weight_is_the_unquantized_shard_and_forward_matches(kind, tp_size):
    gen = torch.Generator().manual_seed(3)
    q, deq = _quantized_sources(kind, gen)
    bias = ql.full_bias(kind, gen)
    layers = []
    for r in range(tp_size):
        layer = ql.build(kind, r, tp_size, Nvfp4LinearMethod())
        _load(layer, q, bias)
        ref = ql.reference_layer(kind, r, tp_size, deq, bias)
        assert torch.equal(layer.quant_method.dequantize(layer, torch.float32), ref.weight)
        assert layer.dtype == torch.float32 and layer.weight.dtype == torch.uint8
        layers.append(layer)
    # per-source input scales, one entry per output shard of the layer
    assert layers[-1].input_scale.tolist() == [float(v[3]) for v in q.values()]
    x = torch.randn(5, ql.in_size(kind), generator=gen)
    want = F.linear(x, torch.cat(list(deq.values())), torch.cat(list(bias.values())))
    torch.testing.assert_close(ql.combined_output(kind, layers, x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["column", "row", "row_sections"])
def test_pre_sharded_pieces_load_like_the_full_tensors(kind):
    """Rank r's pieces cut here by hand (rows for Column, column blocks for Row: 2 values per
    byte, 16 per block scale) load to the same tensors as the full checkpoint tensors."""
    gen = torch.Generator().manual_seed(4)
    q, _ = _quantized_sources(kind, gen)
    bias = ql.full_bias(kind, gen)
    n = 4
    for r in range(n):
        full = ql.build(kind, r, n, Nvfp4LinearMethod())
        _load(full, q, bias)
        pieces = {}
        for sid, (packed, block, g, s_in) in q.items():
            if kind == "column":
                rows = packed.shape[0] // n
                cut = slice(r * rows, (r + 1) * rows)
                pieces[sid] = (packed[cut], block[cut], g, s_in)
                b = bias[sid][cut]
            else:
                sections = ql.ROW_SECTIONS if kind == "row_sections" else (packed.shape[1] * 2,)
                cols, off = [], 0
                for size in sections:
                    cols.append(torch.arange(off + r * size // n, off + (r + 1) * size // n))
                    off += size
                cols = torch.cat(cols)
                pieces[sid] = (packed[:, cols[::2] // 2], block[:, cols[::16] // 16], g, s_in)
                b = bias[sid]
        shard = ql.build(kind, r, n, Nvfp4LinearMethod())
        _load(shard, pieces, {None: b}, pre_sharded=True)
        for name in ("weight", "weight_scale", "weight_scale_2", "bias"):
            a, e = getattr(shard, name), getattr(full, name)
            assert torch.equal(
                a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                e.view(torch.uint8) if e.dtype.itemsize == 1 else e,
            ), name


def test_wrong_shapes_and_dtypes_name_the_tensor():
    layer = ql.build("qkv", 0, 2, Nvfp4LinearMethod())
    packed, block, g = quantize_nvfp4(torch.randn(64, ql.IN))
    with pytest.raises(ValueError, match=r"QKVParallelLinear\(qkv\): weight_scale .*\[64, 3\]"):
        layer.weight_loader(layer.weight_scale, block[:, :3].contiguous(), "q")
    with pytest.raises(ValueError, match="weight_scale has dtype float32, expected float8_e4m3fn"):
        layer.weight_loader(layer.weight_scale, block.float(), "q")
    with pytest.raises(ValueError, match="weight has dtype int8, expected uint8"):
        layer.weight_loader(layer.weight, packed.view(torch.int8), "q")
    with pytest.raises(ValueError, match="input_scale has shape \\[2\\]"):
        layer.weight_loader(layer.input_scale, torch.ones(2), "q")
    with pytest.raises(
        ValueError, match="weight_scale_2 has shape \\[64\\], expected a per-tensor"
    ):
        layer.weight_loader(layer.weight_scale_2, torch.ones(64), "q")
