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

from sglang.multimodal_gen.layers.quantization.base import LinearLayer, ShardId, tensor_dtype

__all__ = ["SCALE_DTYPES", "check_dtype", "load_row_scale", "load_shard_scalar", "new_param"]

#: the dtype of a checkpoint's per-tensor scales (ModelOpt and ComfyUI write float32)
SCALE_DTYPES = (torch.float32,)


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


def _shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _per_tensor(loaded: Any, what: str) -> torch.Tensor:
    """The 0-d fp32 value of a per-tensor scale: fp32 of shape ``[]`` or ``[1]``, nothing else.

    Raises:
        ValueError: another dtype or shape (names ``what`` and both).
    """
    check_dtype(loaded, SCALE_DTYPES, what)
    shape = _shape(loaded)
    if shape not in ((), (1,)):
        raise ValueError(f"{what} has shape {list(shape)}, expected a per-tensor scale [] or [1]")
    return _value(loaded).reshape(())


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
    what: str,
) -> None:
    """Fill the rows of shard ``shard_id`` of ``param`` ``[out_local]`` (fp32) with the source's
    per-tensor scale ``loaded`` (fp32 ``[]`` or ``[1]``).

    Raises:
        ValueError: a wrong dtype or shape (the message names ``what``).
    """
    layer.fill_shard_rows(param, _per_tensor(loaded, what), shard_id)


def load_shard_scalar(
    layer: LinearLayer, param: nn.Parameter, loaded: Any, shard_id: ShardId, what: str
) -> None:
    """Store a per-tensor scale (shape ``[]`` or ``[1]``) of shard ``shard_id`` in ``param``
    ``[n_shards]`` (every shard's entry for the fused layout ``shard_id=None``).

    Raises:
        ValueError: a wrong dtype or more than one element (names ``what``).
    """
    value = _per_tensor(loaded, what)
    ids = layer.output_shard_ids
    fused = shard_id is None and len(ids) > 1
    index = range(len(ids)) if fused else [ids.index(layer.shard_spec(shard_id).shard_id)]
    with torch.no_grad():
        for i in index:
            param.data[i] = value
