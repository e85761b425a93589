"""NVFP4 weights (ModelOpt): packed E2M1 values, an E4M3 scale per block of 16, a global scale.

Checkpoint layout per source module (NVIDIA TensorRT-Model-Optimizer's NVFP4 export, as SGLang's
diffusion loader reads it): ``weight`` uint8 ``[N, K/2]`` holding two E2M1 codes per byte, element
``2j`` in the low nibble; ``weight_scale`` float8_e4m3fn ``[N, K/16]`` (row-major, not swizzled);
``weight_scale_2`` fp32 per-tensor; ``input_scale`` fp32 per-tensor. Dequantized:
``W[n, k] = E2M1[code[n, k]] * weight_scale[n, k // 16] * weight_scale_2``.

Storage here: ``weight`` and ``weight_scale`` sliced like the checkpoint (rows by output shard,
columns by input partition in units of 2 and 16 columns), ``weight_scale_2`` one fp32 value per
output row (each source's global scale on its rows: fused q/k/v stay exact). Every input
partition must start and end on a 16-column block.

GEMM: weight-only (dequantized to the compute dtype for each GEMM). FP4 tensor cores exist on
Blackwell only; no kernel for them is wired in (an H200 has none), so every device takes this
path.
"""

from __future__ import annotations

import torch

from sglang.multimodal_gen.layers.quantization.base import QuantizationMethod
from sglang.multimodal_gen.layers.quantization.scales import (
    check_dtype,
    load_row_scale,
    load_shard_scalar,
    new_param,
)

__all__ = ["E2M1_VALUES", "NVFP4_BLOCK", "Nvfp4LinearMethod", "dequantize_nvfp4", "unpack_e2m1"]

#: columns per block scale
NVFP4_BLOCK = 16
#: the 16 E2M1 code values (sign bit 3, exponent bits 2-1, mantissa bit 0; OCP MX spec v1.0)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_LUT: dict[torch.device, torch.Tensor] = {}


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> fp32 ``[N, K]``: element ``2j`` from the low nibble of byte ``j``."""
    lut = _LUT.get(packed.device)
    if lut is None:
        lut = _LUT[packed.device] = torch.tensor(E2M1_VALUES, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return lut[codes.int()]


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 ``[N, K]`` from ``packed`` uint8 ``[N, K/2]``, ``block_scale`` e4m3 ``[N, K/16]``
    and ``global_scale`` fp32 (a scalar or one value per row ``[N]``)."""
    values = unpack_e2m1(packed)
    n, k = values.shape
    g = global_scale.float()
    g = g.reshape(-1, 1, 1) if g.numel() > 1 else g.reshape(())
    # block scales broadcast over a [N, K/16, 16] view (no [N, K] scale tensor); the code times
    # its block scale is exact in fp32, so the global scale is the one rounding
    blocks = values.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return (blocks * block_scale.to(torch.float32).unsqueeze(-1) * g).view(n, k)


class Nvfp4LinearMethod(QuantizationMethod):
    """NVFP4 weights, weight-only GEMM (see the module docstring).

    Args:
        group_size: columns per block scale; only 16 (NVFP4's) is accepted.

    Raises:
        ValueError: (at layer creation) a group size other than 16, or an input partition that
            does not fall on 16-column blocks (names the layer).
    """

    name = "nvfp4"
    supports_lora_merge = False
    checkpoint_params = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def __init__(self, group_size: int = NVFP4_BLOCK):
        if group_size != NVFP4_BLOCK:
            raise ValueError(f"NVFP4 group_size {group_size} is not supported (only 16)")
        self.group_size = group_size

    def create_weights(self, layer, device):
        for start, size in layer.input_partitions:
            if start % NVFP4_BLOCK or size % NVFP4_BLOCK:
                raise ValueError(
                    f"{layer.display_name}: NVFP4 needs the input columns of each rank in blocks of "
                    f"{NVFP4_BLOCK}; this rank holds [{start}, {start + size}) of "
                    f"{layer.input_size} (another tp_size may fit)"
                )
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        layer.weight = new_param(layer, (rows, cols // 2), torch.uint8, device)
        layer.weight_scale = new_param(
            layer, (rows, cols // NVFP4_BLOCK), torch.float8_e4m3fn, device
        )
        layer.weight_scale_2 = new_param(layer, (rows,), torch.float32, device, fill=1.0)
        layer.input_scale = new_param(layer, (len(layer.shard_map),), torch.float32, device, 1.0)

    def load(self, layer, name, param, loaded, shard_id, pre_sharded):
        if name == "weight":
            check_dtype(loaded, (torch.uint8,), "weight")
            layer.load_output_rows(param, loaded, shard_id, pre_sharded, col_unit=2, what=name)
        elif name == "weight_scale":
            check_dtype(loaded, (torch.float8_e4m3fn,), "weight_scale")
            layer.load_output_rows(
                param, loaded, shard_id, pre_sharded, col_unit=NVFP4_BLOCK, what=name
            )
        elif name == "weight_scale_2":
            load_row_scale(layer, param, loaded, shard_id, "weight_scale_2")
        elif name == "input_scale":
            load_shard_scalar(layer, param, loaded, shard_id, "input_scale")
        else:
            raise ValueError(f"an nvfp4 layer has no checkpoint tensor {name!r}")

    def dequantize(self, layer, dtype):
        w = dequantize_nvfp4(layer.weight, layer.weight_scale, layer.weight_scale_2)
        return w.to(dtype)
