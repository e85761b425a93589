"""The LoRA class of each parallel linear layer type, and how a model's layers get wrapped.

Subclasses of :class:`~sglang.multimodal_gen.layers.lora.layer.BaseLayerWithLoRA` only say how a
full ``A`` ``[r, in]`` and ``B`` ``[out_of_shard, r]`` are cut to this rank, driven by the base
layer's shard map.
"""

from __future__ import annotations

from torch import nn

from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.lora.layer import BaseLayerWithLoRA

__all__ = [
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "replace_submodule",
    "wrap_with_lora",
]


# ---------------------------------------------------------------------------- subclasses
class ReplicatedLinearWithLoRA(BaseLayerWithLoRA):
    """Nothing is split: ``A`` and ``B`` are used whole."""


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """The output dim is split: ``A`` whole, ``B`` cut to this rank's rows by the shard map."""

    def slice_lora_b_weights(self, lora_b, shard_id):
        return self.base_layer.shard_output_tensor(lora_b, shard_id)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """gate/up sections: ``B`` of shard ``i`` (or of the fused ``[gate|up]``) cut per section."""


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """q/k/v sections (GQA aware through the shard map): ``B`` of ``"q"|"k"|"v"`` or fused."""


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """The input dim is split: ``A`` cut to this rank's columns, ``B`` whole; the partial deltas
    are summed by the base layer's all-reduce together with the partial base outputs."""

    def slice_lora_a_weights(self, lora_a, shard_id):
        return self.base_layer.shard_input_tensor(lora_a, dim=-1)


# most specific first: the first isinstance match wins
_WRAPPER_TABLE: tuple[tuple[type[ParallelLinear], type[BaseLayerWithLoRA]], ...] = (
    (QKVParallelLinear, QKVParallelLinearWithLoRA),
    (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
    (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
    (RowParallelLinear, RowParallelLinearWithLoRA),
    (ReplicatedLinear, ReplicatedLinearWithLoRA),
)


def wrap_with_lora(layer: nn.Module, **kwargs) -> BaseLayerWithLoRA:
    """Wrap a parallel linear layer in its LoRA class (an already wrapped layer is returned as is).

    Args:
        layer: a :class:`ParallelLinear` subclass instance.
        kwargs: passed to the wrapper (``snapshot_device``, ``lora_context``).

    Raises:
        TypeError: ``layer`` is not a known :class:`ParallelLinear` type.
    """
    if isinstance(layer, BaseLayerWithLoRA):
        return layer
    for base_type, wrapper in _WRAPPER_TABLE:
        if isinstance(layer, base_type):
            return wrapper(layer, **kwargs)
    raise TypeError(f"no LoRA wrapper for {type(layer).__name__} ({getattr(layer, 'prefix', '')})")


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Replace the submodule at dotted ``name`` of ``model`` by ``new``; returns ``new``.

    Raises:
        ValueError: ``name`` is empty or does not name an existing submodule.
    """
    if not name:
        raise ValueError("replace_submodule: empty module name")
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError as e:
        raise ValueError(f"replace_submodule: no submodule {parent_name!r} ({e})") from None
    if leaf not in parent._modules:
        raise ValueError(f"replace_submodule: {type(parent).__name__} has no child {leaf!r}")
    parent._modules[leaf] = new
    return new
