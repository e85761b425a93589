"""Scale loading shared by the quantized methods (``layers/quantization/scales.py``): per-tensor
scales (fp32 ``[]`` or ``[1]``, nothing else) fill their source's rows, per-source activation
scales land in their shard's entry; tensors and safetensors lazy slices alike."""

from __future__ import annotations

import pytest
import torch
from fixtures import quantized_layers as ql
from safetensors import safe_open
from safetensors.torch import save_file
from sglang.multimodal_gen.layers.quantization.scales import (
    check_dtype,
    load_row_scale,
    load_shard_scalar,
    new_param,
)


def _qkv(rank=1, size=2):
    """QKV at rank 1 of 2: local rows q [0, 32), k [32, 48), v [48, 64)."""
    layer = ql.build("qkv", rank, size)
    return layer, new_param(layer, (layer.output_size_per_partition,), torch.float32, "cpu", 0.0)


@pytest.mark.parametrize("shape", [(), (1,)])
def test_per_tensor_scale_fills_only_its_source_rows(shape):
    layer, p = _qkv()
    load_row_scale(layer, p, torch.full(shape, 3.0), "k", "weight_scale")
    load_row_scale(layer, p, torch.full(shape, 5.0), "v", "ws")
    assert p[:32].eq(0).all() and p[32:48].eq(3).all() and p[48:].eq(5).all()


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.arange(64.0), r"weight_scale has shape \[64\], expected a per-tensor scale"),
        (torch.ones(64, 1), r"weight_scale has shape \[64, 1\], expected a per-tensor scale"),
        (torch.ones(1, 1), r"weight_scale has shape \[1, 1\], expected a per-tensor scale"),
        (
            torch.tensor(2.0, dtype=torch.bfloat16),
            "weight_scale has dtype bfloat16, expected float32",
        ),
        (
            torch.tensor(2.0, dtype=torch.float16),
            "weight_scale has dtype float16, expected float32",
        ),
    ],
)
def test_anything_but_an_fp32_per_tensor_scale_is_refused(bad, message):
    """The checkpoint contract: fp32 of shape ``[]`` or ``[1]``; per-row or per-channel scales,
    other shapes and other dtypes are refused naming the tensor, and nothing is written."""
    layer, p = _qkv()
    with pytest.raises(ValueError, match=message):
        load_row_scale(layer, p, bad, "q", "weight_scale")
    assert p.eq(0).all()


def test_lazy_slices_of_scalars(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_file({"s0": torch.tensor(2.0), "s1": torch.tensor([4.0]), "rows": torch.ones(32)}, path)
    layer, p = _qkv()
    with safe_open(path, "pt") as f:
        load_row_scale(layer, p, f.get_slice("s0"), "v", "weight_scale")
        load_row_scale(layer, p, f.get_slice("s1"), "k", "weight_scale")
        with pytest.raises(ValueError, match=r"has shape \[32\]"):
            load_row_scale(layer, p, f.get_slice("rows"), "q", "weight_scale")
        s_in = new_param(layer, (3,), torch.float32, "cpu", 0.0)
        load_shard_scalar(layer, s_in, f.get_slice("s0"), "v", "input_scale")
    assert p[48:].eq(2).all() and p[32:48].eq(4).all() and p[:32].eq(0).all()
    assert s_in.tolist() == [0, 0, 2]


def test_shard_scalar_per_source_and_fused():
    layer, _ = _qkv()
    s = new_param(layer, (3,), torch.float32, "cpu", 0.0)
    for i, sid in enumerate("qkv"):
        load_shard_scalar(layer, s, torch.tensor(float(i + 1)), sid, "input_scale")
    assert s.tolist() == [1, 2, 3]
    load_shard_scalar(layer, s, torch.tensor([7.0]), None, "input_scale")  # the fused layout
    assert s.tolist() == [7, 7, 7]
    with pytest.raises(ValueError, match=r"input_scale has shape \[3\], expected a per-tensor"):
        load_shard_scalar(layer, s, torch.ones(3), "q", "input_scale")


def test_check_dtype_names_the_tensor():
    check_dtype(torch.ones(1), (torch.float32,), "x")
    with pytest.raises(ValueError, match="^my_scale has dtype int8, expected float32 or bfloat16$"):
        check_dtype(torch.ones(1, dtype=torch.int8), (torch.float32, torch.bfloat16), "my_scale")
