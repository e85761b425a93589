"""Quantization methods of the linear layers (see :mod:`.base` for the seam)."""

from sglang.multimodal_gen.layers.quantization.base import (
    QuantizationMethod,
    UnquantizedLinearMethod,
    tensor_dtype,
)
from sglang.multimodal_gen.layers.quantization.fp8 import Fp8LinearMethod, quantize_rows_fp8
from sglang.multimodal_gen.layers.quantization.nvfp4 import (
    Nvfp4LinearMethod,
    dequantize_nvfp4,
    unpack_e2m1,
)

__all__ = [
    "Fp8LinearMethod",
    "Nvfp4LinearMethod",
    "QuantizationMethod",
    "UnquantizedLinearMethod",
    "dequantize_nvfp4",
    "quantize_rows_fp8",
    "tensor_dtype",
    "unpack_e2m1",
]
