"""LoRA layers: adapters in slot tensors, one forward around the ParallelLinear family.

* :class:`BaseLayerWithLoRA` and its wrappers (``wrap_with_lora``): adapters stored per slot,
  merge / unmerge, and the one forward that gives each row of a batch its own composition;
* :class:`Composition` (``((slot, strength), ...)``), :class:`RowMapping` (a composition per row)
  and :class:`LoRAContext` (one per model target: the mapping of the forwards running now).
"""

from sglang.multimodal_gen.layers.lora.composition import (
    Composition,
    LoRAContext,
    RowGroup,
    RowMapping,
    lora_context_of,
)
from sglang.multimodal_gen.layers.lora.compute import workspace_stats
from sglang.multimodal_gen.layers.lora.layer import BaseLayerWithLoRA
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights
from sglang.multimodal_gen.layers.lora.wrappers import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    replace_submodule,
    wrap_with_lora,
)

__all__ = [
    "BaseLayerWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "Composition",
    "LoRAContext",
    "LoRAWeights",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowGroup",
    "RowMapping",
    "RowParallelLinearWithLoRA",
    "lora_context_of",
    "replace_submodule",
    "workspace_stats",
    "wrap_with_lora",
]
