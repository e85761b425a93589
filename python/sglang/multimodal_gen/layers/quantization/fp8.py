"""FP8 (E4M3) weights: ModelOpt / ComfyUI checkpoints and online quantization at load.

Storage: ``weight`` ``float8_e4m3fn`` ``[out_local, in_local]`` and ``weight_scale`` fp32
``[out_local]`` (one scale per output row: a checkpoint's per-tensor scale fills the rows of its
source module, so the q, k and v sources of a fused layer keep their own scales); dequantized
weight ``W[n, k] = weight[n, k] * weight_scale[n]`` (ModelOpt's FP8 recipe, NVIDIA
TensorRT-Model-Optimizer; ComfyUI's ``scaled_fp8`` files store the same product as
``scale_weight``).

GEMM: on CUDA devices with FP8 tensor cores (compute capability 8.9 or higher)
``torch._scaled_mm`` with row-wise scales, activations quantized with the checkpoint's static
``input_scale`` (the largest of the fused sources', as vLLM does) or, without one, per token;
elsewhere weight-only: the weight is dequantized to the compute dtype for each GEMM. Whether a
torch build runs the row-wise FP8 kernel for a device and dtype (some refuse fp16 outputs) is
probed once with a tiny GEMM; a refusal means weight-only for that pair, with one warning.
"""

from __future__ import annotations

import logging
import os

import torch

from sglang.multimodal_gen.layers.batch_invariant import linear_rows_invariant
from sglang.multimodal_gen.layers.quantization.base import QuantizationMethod, tensor_dtype
from sglang.multimodal_gen.layers.quantization.scales import (
    check_dtype,
    load_row_scale,
    load_shard_scalar,
    new_param,
)

__all__ = ["FP8_MAX", "Fp8LinearMethod", "fp8_gemm_available", "quantize_rows_fp8"]

logger = logging.getLogger(__name__)

#: largest finite float8_e4m3fn value
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: set to 0 to keep the weight-only path on FP8-capable GPUs (debugging, comparisons)
FP8_GEMM_ENV = "SGLANG_DIFFUSION_FP8_GEMM"


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-output-channel) FP8 quantization of ``w`` ``[rows, cols]`` (any float dtype).

    Returns:
        ``(q, scale)``: ``q`` ``float8_e4m3fn`` ``[rows, cols]`` and ``scale`` fp32 ``[rows]``
        with ``w ~= q * scale[:, None]``; ``scale = amax(|row|) / 448`` (1 for an all-zero row).
    """
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


_FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (device, activation dtype) -> whether this torch build runs the row-wise FP8 GEMM there
_SCALED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _probe_scaled_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Run one 16x16x16 row-wise ``torch._scaled_mm`` (some builds refuse a device or an
    output dtype, e.g. fp16 with row-wise scales); one warning when refused."""
    try:
        a = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device, dtype=torch.float32)
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one.view(1, -1), out_dtype=dtype)
        return True
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("FP8 GEMM refused on %s for %s (%s): weight-only", device, dtype, first)
        return False


def fp8_gemm_available(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :class:`Fp8LinearMethod` runs ``torch._scaled_mm`` for activations of ``dtype`` on
    ``device``: CUDA with compute capability >= 8.9, bf16 or fp16 activations, not switched off
    with ``SGLANG_DIFFUSION_FP8_GEMM=0``, and accepted by this torch build (probed once per
    device and dtype with a tiny GEMM; the answer is kept)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if os.environ.get(FP8_GEMM_ENV, "1") == "0":
        return False
    key = (str(device), dtype)
    ok = _SCALED_MM_OK.get(key)
    if ok is None:
        capable = torch.cuda.get_device_capability(device) >= (8, 9)
        ok = _SCALED_MM_OK[key] = capable and _probe_scaled_mm(device, dtype)
    return ok


class Fp8LinearMethod(QuantizationMethod):
    """FP8 E4M3 weights with per-row fp32 scales.

    Args:
        online: quantize a floating-point checkpoint while loading it (``--quantization fp8``):
            per-output-channel scales from each whole row (every TP size gives the same values).
            Otherwise the checkpoint holds ``weight`` (e4m3), ``weight_scale`` and, when
            ``static_input_scale``, ``input_scale``.
        static_input_scale: the checkpoint has a per-tensor ``input_scale`` per source
            (ModelOpt); required then, and used by the FP8 tensor-core GEMM.
    """

    name = "fp8"
    supports_lora_merge = False

    def __init__(self, online: bool = False, static_input_scale: bool = True):
        self.online = online
        self.static_input_scale = static_input_scale and not online
        self.checkpoint_params = (
            ("weight",)
            if online
            else ("weight", "weight_scale") + (("input_scale",) if self.static_input_scale else ())
        )

    def describe(self) -> str:
        return "fp8 (online, per-channel)" if self.online else "fp8"

    def create_weights(self, layer, device):
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        layer.weight = new_param(layer, (rows, cols), torch.float8_e4m3fn, device)
        scale = new_param(layer, (rows,), torch.float32, device, fill=1.0)
        if self.online:  # derived at load, not read: a buffer is not a checkpoint tensor
            layer.register_buffer("weight_scale", scale.data)
        else:
            layer.weight_scale = scale
        if self.static_input_scale:
            layer.input_scale = new_param(
                layer, (len(layer.shard_map),), torch.float32, device, 1.0
            )

    def load(self, layer, name, param, loaded, shard_id, pre_sharded):
        if name == "weight":
            if self.online:
                self._load_online(layer, loaded, shard_id, pre_sharded)
                return
            check_dtype(loaded, (torch.float8_e4m3fn,), "weight")
            layer.load_output_rows(param, loaded, shard_id, pre_sharded, col_unit=1, what="weight")
        elif name == "weight_scale" and not self.online:
            load_row_scale(layer, param, loaded, shard_id, "weight_scale")
        elif name == "input_scale" and self.static_input_scale:
            load_shard_scalar(layer, param, loaded, shard_id, "input_scale")
        else:
            raise ValueError(f"an {self.describe()} layer has no checkpoint tensor {name!r}")

    def _load_online(self, layer, loaded, shard_id, pre_sharded):
        dtype = tensor_dtype(loaded)
        if dtype not in _FLOAT_WEIGHTS:
            raise ValueError(
                f"weight has dtype {dtype}; --quantization fp8 quantizes a floating-point "
                "checkpoint (a pre-quantized one carries its own quantization_config)"
            )
        if pre_sharded:
            if layer.input_size_per_partition != layer.input_size:
                raise ValueError(
                    "--quantization fp8 reads whole rows to compute its scales; a pre-sharded "
                    "piece of a layer whose input is split holds part of each row"
                )
            rows = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
            q, scale = quantize_rows_fp8(rows)
            layer.load_output_rows(layer.weight, q, shard_id, True, col_unit=1, what="weight")
            layer.load_output_rows(layer.weight_scale, scale, shard_id, True, None, "weight")
            return
        # the whole rows of this rank's output shard: scales independent of the TP split
        full_rows = layer.output_rows_of(loaded, shard_id, what="weight")
        q, scale = quantize_rows_fp8(full_rows)
        local_q = layer.take_input_columns(q, col_unit=1)
        layer.load_output_rows(layer.weight, local_q, shard_id, True, col_unit=1, what="weight")
        layer.load_output_rows(layer.weight_scale, scale, shard_id, True, None, "weight")

    def dequantize(self, layer, dtype):
        w = layer.weight.to(torch.float32) * layer.weight_scale[:, None]
        return w.to(dtype)

    def process_weights_after_loading(self, layer):
        """Probe the FP8 GEMM for the layer's device and compute dtype now, outside any
        compiled region (:func:`fp8_gemm_available`)."""
        fp8_gemm_available(layer.weight.device, self.compute_dtype(layer))

    def apply(self, layer, x, bias):
        if fp8_gemm_available(x.device, x.dtype):
            y = self._scaled_mm(layer, x, bias)
            if y is not None:
                return y
        return linear_rows_invariant(x, self.dequantize(layer, x.dtype), bias)

    def _scaled_mm(self, layer, x, bias):
        """``torch._scaled_mm`` with row-wise scales (``None`` when the shapes do not fit)."""
        w = layer.weight
        n, k = w.shape
        if k % 16 or n % 16:
            return None
        x2 = x.reshape(-1, k)
        if self.static_input_scale:
            s = layer.input_scale.max().float()
            xq = (x2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale_a = s.expand(x2.shape[0], 1).contiguous()
        else:
            amax = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            scale_a = amax / FP8_MAX
            xq = (x2.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            xq,
            w.t(),
            scale_a=scale_a,
            scale_b=layer.weight_scale.view(1, -1),
            bias=None if bias is None else bias.to(x.dtype),
            out_dtype=x.dtype,
        )
        return y.reshape(*x.shape[:-1], n)
