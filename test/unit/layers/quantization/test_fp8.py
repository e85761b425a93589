"""FP8 (``layers/quantization/fp8.py``): per-row dequantization by hand, the online per-channel
quantizer's error bound, and every parallel layer kind at TP 1, 2 and 4 (checkpoint per-tensor
scales per source, online per-row scales) against the unquantized layer's shard map
(``fixtures.quantized_layers``). The FP8 tensor-core GEMM runs on CUDA sm >= 8.9 only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures import quantized_layers as ql
from sglang.multimodal_gen.layers.quantization.fp8 import (
    FP8_MAX,
    Fp8LinearMethod,
    quantize_rows_fp8,
)
from sglang.multimodal_gen.models.quantized_export import quantize_fp8

#: e4m3: 3 mantissa bits (half an ulp: 2**-4 of the value) down to 2**-6, then subnormals
#: 2**-9 apart (half a step: 2**-10), in units of the row's scale
HALF_ULP, HALF_SUBNORMAL = 2.0**-4, 2.0**-10


def test_dequantize_is_the_code_times_its_row_scale():
    """Each source's per-tensor scale on its rows (q, k, v of a fused layer: three scales)."""
    layer = ql.build("qkv", 0, 1, Fp8LinearMethod())
    codes = torch.tensor([0.5, -1.5, 448.0, 2.0**-9])  # exact e4m3 values
    scales = {"q": 3.0 / 7, "k": 11.0 / 7, "v": 0.125}
    for sid, sc in scales.items():
        rows = layer.shard_spec(sid).full_size
        layer.weight_loader(
            layer.weight, codes.repeat(rows, ql.IN // 4).to(torch.float8_e4m3fn), sid
        )
        layer.weight_loader(layer.weight_scale, torch.tensor(sc), sid)
    got = layer.quant_method.dequantize(layer, torch.float32)
    for sid, sc in scales.items():  # one fp32 product per element
        spec = layer.shard_spec(sid)
        for n in (spec.local_offset, spec.local_offset + spec.local_size - 1):
            assert torch.equal(got[n, :4], codes * torch.tensor(sc))


def test_online_quantizer_error_bound_and_scales():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(6, 256, generator=gen) * torch.logspace(-4, 3, 6)[:, None]
    w[2] = 0.0
    q, scale = quantize_rows_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    amax = w.abs().amax(1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / FP8_MAX, rtol=0, atol=0)
    assert scale[2] == 1 and (q[2].float() == 0).all()
    assert (q.float().abs().amax(1)[amax > 0] == FP8_MAX).all()  # each row uses the full range
    err = (w - q.float() * scale[:, None]).abs()
    bound = torch.maximum(w.abs() * HALF_ULP, scale[:, None] * HALF_SUBNORMAL)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err / w.abs().clamp(min=1e-30))[amax > 0].max() > HALF_ULP / 4  # really rounded


def _checkpoint_sources(kind, gen):
    """Per-tensor FP8 of each source (ModelOpt's layout): ``{sid: (q, scale, input_scale)}``
    and the dequantized sources."""
    q, deq = {}, {}
    for i, (sid, w) in enumerate(ql.full_weights(kind, gen).items()):
        codes, s = quantize_fp8(w)
        q[sid] = (codes, s, torch.tensor(0.5 * (i + 1)))
        deq[sid] = codes.float() * s
    return q, deq


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ql.KINDS)
def test_checkpoint_fp8_local_weight_and_forward(kind, tp_size):
    gen = torch.Generator().manual_seed(2)
    q, deq = _checkpoint_sources(kind, gen)
    bias = ql.full_bias(kind, gen)
    layers = []
    for r in range(tp_size):
        layer = ql.build(kind, r, tp_size, Fp8LinearMethod())
        for sid, (codes, s, s_in) in q.items():
            layer.weight_loader(layer.weight, codes, sid)
            layer.weight_loader(layer.weight_scale, s, sid)
            layer.weight_loader(layer.input_scale, s_in, sid)
            layer.weight_loader(layer.bias, bias[sid], sid)
        layer.process_weights_after_loading()
        ref = ql.reference_layer(kind, r, tp_size, deq, bias)
        assert torch.equal(layer.quant_method.dequantize(layer, torch.float32), ref.weight)
        assert layer.input_scale.tolist() == [float(v[2]) for v in q.values()]
        layers.append(layer)
    x = torch.randn(5, ql.in_size(kind), generator=gen)
    want = F.linear(x, torch.cat(list(deq.values())), torch.cat(list(bias.values())))
    torch.testing.assert_close(ql.combined_output(kind, layers, x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["qkv", "row_sections"])
def test_online_fp8_scales_do_not_depend_on_the_split(kind, tp_size):
    """``--quantization fp8``: each rank quantizes with its rows' whole-row scales, so its local
    weight is the TP 1 quantization sliced (a Row rank sees only its columns, yet scales by the
    full row)."""
    gen = torch.Generator().manual_seed(3)
    full = ql.full_weights(kind, gen)
    bias = ql.full_bias(kind, gen)
    deq = {}
    for sid, w in full.items():
        codes, s = quantize_rows_fp8(w)
        deq[sid] = codes.float() * s[:, None]
    for r in range(tp_size):
        layer = ql.build(kind, r, tp_size, Fp8LinearMethod(online=True))
        assert "input_scale" not in dict(layer.named_parameters())
        assert "weight_scale" in dict(layer.named_buffers())  # derived, not a checkpoint tensor
        for sid, w in full.items():
            layer.weight_loader(layer.weight, w.to(torch.bfloat16).float(), sid)
            layer.weight_loader(layer.bias, bias[sid], sid)
        ref = ql.reference_layer(kind, r, tp_size, deq, bias)
        # the bf16 round trip above changes nothing the quantizer keeps: compare exactly
        ref_bf = ql.reference_layer(
            kind,
            r,
            tp_size,
            {
                sid: (lambda cs: cs[0].float() * cs[1][:, None])(
                    quantize_rows_fp8(w.to(torch.bfloat16).float())
                )
                for sid, w in full.items()
            },
            bias,
        )
        got = layer.quant_method.dequantize(layer, torch.float32)
        assert torch.equal(got, ref_bf.weight)
        torch.testing.assert_close(got, ref.weight, rtol=2**-3, atol=1e-3)


def test_online_refuses_a_quantized_checkpoint_weight():
    layer = ql.build("column", 0, 1, Fp8LinearMethod(online=True))
    with pytest.raises(ValueError, match="weight has dtype torch.float8_e4m3fn; --quantization"):
        layer.weight_loader(layer.weight, torch.zeros(96, ql.IN, dtype=torch.float8_e4m3fn))


def test_pre_sharded_row_pieces():
    """Rank r's column block of an FP8 Row weight with its per-tensor scale, pre-sharded."""
    gen = torch.Generator().manual_seed(4)
    codes, s = quantize_fp8(torch.randn(48, 128, generator=gen))
    for r in range(4):
        full = ql.build("row", r, 4, Fp8LinearMethod(static_input_scale=False), bias=False)
        full.weight_loader(full.weight, codes)
        full.weight_loader(full.weight_scale, s)
        shard = ql.build("row", r, 4, Fp8LinearMethod(static_input_scale=False), bias=False)
        shard.weight_loader(shard.weight, codes[:, r * 32 : (r + 1) * 32].contiguous(), None, True)
        shard.weight_loader(shard.weight_scale, s, None, True)
        assert torch.equal(shard.weight.view(torch.uint8), full.weight.view(torch.uint8))
        assert torch.equal(shard.weight_scale, full.weight_scale)


def test_wrong_shapes_and_dtypes_name_the_tensor():
    layer = ql.build("qkv", 1, 2, Fp8LinearMethod())
    codes, s = quantize_fp8(torch.randn(32, ql.IN))
    with pytest.raises(ValueError, match="weight has dtype float32, expected float8_e4m3fn"):
        layer.weight_loader(layer.weight, codes.float(), "k")
    with pytest.raises(ValueError, match=r"weight_scale has shape \[3\], expected a per-tensor"):
        layer.weight_loader(layer.weight_scale, torch.ones(3), "k")
    with pytest.raises(ValueError, match="weight_scale has dtype bfloat16, expected float32"):
        layer.weight_loader(layer.weight_scale, torch.ones((), dtype=torch.bfloat16), "k")
    with pytest.raises(ValueError, match="weight_scale has dtype int32"):
        layer.weight_loader(layer.weight_scale, torch.ones((), dtype=torch.int32), "k")
    with pytest.raises(ValueError, match=r"input_scale has shape \[2\]"):
        layer.weight_loader(layer.input_scale, torch.ones(2), "k")
    with pytest.raises(ValueError, match=r"weight for shard 'k' has shape \[32, 63\]"):
        layer.weight_loader(layer.weight, codes[:, :63].contiguous(), "k")


def _fp8_gemm_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_gemm_device(), reason="FP8 tensor-core GEMM needs CUDA sm >= 8.9")
@pytest.mark.parametrize("static", [True, False])
def test_scaled_mm_matches_weight_only(static):
    gen = torch.Generator().manual_seed(5)
    q, deq = _checkpoint_sources("qkv", gen)
    layer = ql.build("qkv", 0, 1, Fp8LinearMethod(static_input_scale=static), bias=False)
    for sid, (codes, s, _) in q.items():
        layer.weight_loader(layer.weight, codes, sid)
        layer.weight_loader(layer.weight_scale, s, sid)
        if static:
            layer.weight_loader(layer.input_scale, torch.tensor(4.0 / FP8_MAX), sid)
    layer = layer.cuda()
    x = torch.randn(32, ql.IN, generator=gen).clamp(-4, 4).cuda().to(torch.bfloat16)
    got = layer.quant_method.apply(layer, x, None).float()
    want = F.linear(x.float(), torch.cat(list(deq.values())).cuda())
    rel = (got - want).norm() / want.norm()
    assert rel < 0.08, rel  # activations rounded to e4m3 (3 mantissa bits) and bf16 output


def test_fp8_gemm_probe_once_per_device_and_dtype(monkeypatch, caplog):
    """The FP8 GEMM is probed once per (device, dtype) with a tiny ``torch._scaled_mm``; a build
    that refuses it (some refuse fp16 outputs) means weight-only for that pair, one warning, and
    no further probe; capability < 8.9, non-CUDA devices and fp32 activations never probe."""
    from sglang.multimodal_gen.layers.quantization import fp8 as fp8_mod

    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype=None, **kw):
        calls.append(out_dtype)
        if out_dtype == torch.float16:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise")
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(fp8_mod, "_SCALED_MM_OK", {})
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch, "zeros", lambda *s, device=None, **kw: torch.empty(*s, **kw))
    monkeypatch.setattr(torch, "ones", lambda *s, device=None, **kw: torch.empty(*s, **kw))
    cuda = torch.device("cuda:0")
    assert fp8_mod.fp8_gemm_available(cuda, torch.bfloat16)
    with caplog.at_level("WARNING"):
        assert not fp8_mod.fp8_gemm_available(cuda, torch.float16)
        assert not fp8_mod.fp8_gemm_available(cuda, torch.float16)
    assert calls == [torch.bfloat16, torch.float16]  # one probe each
    assert sum("FP8 GEMM refused" in r.message for r in caplog.records) == 1
    assert not fp8_mod.fp8_gemm_available(cuda, torch.float32)
    assert not fp8_mod.fp8_gemm_available(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(fp8_mod, "_SCALED_MM_OK", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert not fp8_mod.fp8_gemm_available(cuda, torch.bfloat16)
    assert len(calls) == 2
    monkeypatch.setenv(fp8_mod.FP8_GEMM_ENV, "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert not fp8_mod.fp8_gemm_available(cuda, torch.bfloat16)
