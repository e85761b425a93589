"""LoRA layers: one generic forward around the ParallelLinear family (ARCHITECTURE.md section 3)."""

from sglang.multimodal_gen.layers.lora.layer import (
    BaseLayerWithLoRA,
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    get_runtime_lora_scale,
    release_merge_workspace,
    replace_submodule,
    runtime_lora_scale,
    wrap_with_lora,
)
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights

__all__ = [
    "BaseLayerWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "LoRAWeights",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "get_runtime_lora_scale",
    "release_merge_workspace",
    "replace_submodule",
    "runtime_lora_scale",
    "wrap_with_lora",
]
