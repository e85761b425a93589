"""The quantization method seam of :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear`.

A :class:`QuantizationMethod` decides how one linear layer stores its weight and runs its GEMM
(the split vLLM's ``LinearMethodBase`` made: create the weights, post-process them after
loading, apply). The layer keeps everything else: the shard map, input sharding, the bias, the
collectives. Unquantized is one method among them (:class:`UnquantizedLinearMethod`), so a layer
has one code path whatever its storage.

A method loads checkpoint tensors through the layer's shard-map helpers
(:meth:`ParallelLinear.load_output_rows`, :meth:`ParallelLinear.fill_shard_rows`), which slice
any ``[rows, columns]`` tensor to this rank: rows follow the output shard, columns the input
partitions (in units of the packing: 2 columns per byte for packed FP4, 16 per block scale).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.layers.batch_invariant import linear_rows_invariant
from sglang.multimodal_gen.layers.cpu_gemm import PackedWeight

# the layer (layers.linear.ParallelLinear) imports this module: it is typed structurally here
LinearLayer = nn.Module  # a layers.linear.ParallelLinear
ShardId = int | str | None

__all__ = ["QuantizationMethod", "UnquantizedLinearMethod", "tensor_dtype"]


def tensor_dtype(t: Any) -> torch.dtype:
    """The dtype of a tensor or of a safetensors lazy slice (read as an empty slice, or the one
    element of a 0-d tensor: no data worth the name)."""
    if isinstance(t, torch.Tensor):
        return t.dtype
    return (t[0:0] if t.get_shape() else t[()]).dtype


class QuantizationMethod:
    """How a :class:`ParallelLinear` stores its weight and computes ``x W^T + b``.

    Subclasses override :meth:`create_weights`, :meth:`load`, :meth:`dequantize` and, when they
    have a faster GEMM than dequantize-then-matmul, :meth:`apply`.

    Attributes:
        name: the method's name in messages and reports (``"fp8"``, ``"nvfp4"``...).
        supports_lora_merge: whether a LoRA delta can be merged into the stored weight (a
            quantized weight cannot: the merged sum is not representable at the stored scale;
            LoRA runs unmerged beside the quantized GEMM).
        checkpoint_params: the parameter names a checkpoint must provide per output shard of
            the layer (the loader's completeness check; ``bias`` is the layer's own).
    """

    name = "unquantized"
    supports_lora_merge = True
    checkpoint_params: tuple[str, ...] = ("weight",)

    def create_weights(self, layer: LinearLayer, device: torch.device | str | None) -> None:
        """Register the layer's weight tensors (``layer.weight`` at least) with a
        ``weight_loader`` attribute pointing at ``layer.weight_loader``."""
        raise NotImplementedError

    def load(
        self,
        layer: LinearLayer,
        name: str,
        param: nn.Parameter,
        loaded: Any,
        shard_id: ShardId,
        pre_sharded: bool,
    ) -> None:
        """Copy the checkpoint tensor ``loaded`` (a tensor or a safetensors lazy slice) for
        parameter ``name`` of shard ``shard_id`` into this rank's part of ``param``.

        Raises:
            ValueError: a wrong shape or dtype (the message names the parameter and both).
        """
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Finish the weights once every tensor is loaded (e.g. reduce per-shard activation
        scales to the one the GEMM uses). Default: nothing."""

    def weight_changed(self, layer: LinearLayer) -> None:
        """The layer's weight was replaced or written outside :meth:`load`
        (:meth:`ParallelLinear.weight_changed`). Default: nothing derived to drop."""

    def dequantize(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """The local weight ``[out_local, in_local]`` in ``dtype`` (fp32 products rounded once)."""
        raise NotImplementedError

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``: ``[..., in_local]`` -> ``[..., out_local]`` in ``x.dtype``.
        Default: weight-only (dequantize to ``x.dtype``, then the row-invariant GEMM)."""
        return linear_rows_invariant(x, self.dequantize(layer, x.dtype), bias)

    def compute_dtype(self, layer: LinearLayer) -> torch.dtype:
        """The dtype activations, bias and LoRA weights use with this layer."""
        return layer.params_dtype

    def weight_nbytes(self, layer: LinearLayer) -> int:
        """Bytes of the stored weight tensors (weight and scales; not the bias)."""
        return sum(
            t.numel() * t.element_size()
            for n, t in layer.named_parameters(recurse=False)
            if n != "bias"
        ) + sum(t.numel() * t.element_size() for t in layer.buffers(recurse=False))

    def describe(self) -> str:
        return self.name


class UnquantizedLinearMethod(QuantizationMethod):
    """A floating-point weight ``[out_local, in_local]`` in the layer's ``params_dtype``; the GEMM
    is :func:`~sglang.multimodal_gen.layers.batch_invariant.linear_rows_invariant`.

    Each layer's method owns the oneDNN-packed copy of its weight that ``--cpu-gemm-backend
    onednn-packed`` runs on (:class:`~sglang.multimodal_gen.layers.cpu_gemm.PackedWeight`: made
    on first use, remade when the weight changes, dropped on every load)."""

    def __init__(self) -> None:
        self.packed = PackedWeight()

    def create_weights(self, layer, device):
        layer.weight = nn.Parameter(
            torch.empty(
                layer.output_size_per_partition,
                layer.input_size_per_partition,
                dtype=layer.params_dtype,
                device=device,
            ),
            requires_grad=False,
        )
        layer.weight.weight_loader = layer.weight_loader

    def load(self, layer, name, param, loaded, shard_id, pre_sharded):
        if name != "weight":
            raise ValueError(f"unquantized layer has no parameter {name!r}")
        dtype = tensor_dtype(loaded)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) or dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            raise ValueError(
                f"weight has dtype {dtype}, expected a floating-point dtype (an unquantized "
                "layer; is the checkpoint's quantization_config missing or does its 'ignore' "
                "list name this module?)"
            )
        self.packed.clear()
        layer.load_output_rows(param, loaded, shard_id, pre_sharded, col_unit=1, what="weight")

    def process_weights_after_loading(self, layer):
        self.packed.clear()
        super().process_weights_after_loading(layer)

    def weight_changed(self, layer):
        self.packed.clear()

    def dequantize(self, layer, dtype):
        w = layer.weight
        return w if w.dtype == dtype else w.to(dtype)

    def apply(self, layer, x, bias):
        return linear_rows_invariant(x, layer.weight, bias, self.packed)

    def compute_dtype(self, layer):
        return layer.weight.dtype
