"""LoRA layers: one generic forward around the ParallelLinear family (ARCHITECTURE.md section 3)."""

from sglang.multimodal_gen.layers.lora.compute import (
    get_runtime_lora_scale,
    runtime_lora_scale,
    workspace_stats,
)
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
    "LoRAWeights",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "get_runtime_lora_scale",
    "replace_submodule",
    "runtime_lora_scale",
    "workspace_stats",
    "wrap_with_lora",
]
