"""Scale tensors shared by the quantized linear methods (FP8, NVFP4).

A checkpoint quantizes each *source* module on its own: a fused layer of ours (q/k/v, gate/up,
Flux's single-stream ``[qkv | mlp]``) gets one per-tensor scale per source. Stored as one value
per output row of the local weight, those scales stay exact without re-quantizing anything: a
row is dequantized with the scale of the source it came from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.layers.quantization.base import tensor_dtype

# the layer (layers.linear.ParallelLinear) imports this module: it is typed structurally here
LinearLayer = nn.Module  # a layers.linear.ParallelLinear
ShardId = int | str | None

__all__ = ["SCALE_DTYPES", "check_dtype", "load_row_scale", "load_shard_scalar", "new_param"]

#: dtypes accepted for fp32 scales (ModelOpt writes float32; bf16/fp16 copies are widened)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def new_param(layer: LinearLayer, shape, dtype, device, fill: float | None = None) -> nn.Parameter:
    """A frozen parameter with the layer's ``weight_loader`` (``fill``: its initial value)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if fill is not None:
        t.fill_(fill)
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = layer.weight_loader
    return p


def check_dtype(loaded: Any, allowed: tuple[torch.dtype, ...], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``loaded``'s dtype is one of ``allowed``."""
    dtype = tensor_dtype(loaded)
    if dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        shown = str(dtype).replace("torch.", "")
        raise ValueError(f"{what} has dtype {shown}, expected {names}")


def _numel(loaded: Any) -> int:
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    n = 1
    for s in shape:
        n *= s
    return n


def _value(loaded: Any) -> torch.Tensor:
    """The tensor of ``loaded`` (a lazy slice of a 0-d tensor is read with ``[()]``)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[()] if len(loaded.get_shape()) == 0 else loaded[:]


def load_row_scale(
    layer: LinearLayer,
    param: nn.Parameter,
    loaded: Any,
    shard_id: ShardId,
    pre_sharded: bool,
    what: str,
) -> None:
    """Fill ``param`` ``[out_local]`` (fp32) for shard ``shard_id``: a per-tensor scale (shape
    ``[]`` or ``[1]``) fills the shard's rows, a per-row one (``[rows]`` or ``[rows, 1]``) is
    sliced like the weight's rows.

    Raises:
        ValueError: a wrong dtype or shape (the message names ``what``).
    """
    check_dtype(loaded, SCALE_DTYPES, what)
    if _numel(loaded) == 1:
        layer.fill_shard_rows(param, _value(loaded).reshape(()).float(), shard_id)
        return
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if len(shape) == 2 and shape[1] == 1:
        loaded = _value(loaded).reshape(-1)
    layer.load_output_rows(param, loaded, shard_id, pre_sharded, col_unit=None, what=what)


def load_shard_scalar(
    layer: LinearLayer, param: nn.Parameter, loaded: Any, shard_id: ShardId, what: str
) -> None:
    """Store a per-tensor scale (shape ``[]`` or ``[1]``) of shard ``shard_id`` in ``param``
    ``[n_shards]`` (every shard's entry for the fused layout ``shard_id=None``).

    Raises:
        ValueError: a wrong dtype or more than one element (names ``what``).
    """
    check_dtype(loaded, SCALE_DTYPES, what)
    if _numel(loaded) != 1:
        shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else loaded.get_shape()
        raise ValueError(f"{what} has shape {list(shape)}, expected a per-tensor scale [] or [1]")
    value = _value(loaded).reshape(()).float()
    ids = layer.output_shard_ids
    fused = shard_id is None and len(ids) > 1
    index = range(len(ids)) if fused else [ids.index(layer.shard_spec(shard_id).shard_id)]
    with torch.no_grad():
        for i in index:
            param.data[i] = value
