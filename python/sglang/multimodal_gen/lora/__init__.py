"""LoRA adapter runtime: file formats, PEFT config semantics, loading (and the adapter manager)."""

from sglang.multimodal_gen.lora.formats import (
    CanonicalLoRA,
    convert_to_canonical,
    guess_architecture,
)
from sglang.multimodal_gen.lora.loading import load_lora_state_dict, resolve_lora_path
from sglang.multimodal_gen.lora.manager import MERGE_MODES, LoRAManager
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.peft_config import (
    AdapterConfig,
    config_from_sources,
    get_pattern_key,
)

__all__ = [
    # formats / PEFT semantics / loading
    "AdapterConfig",
    "CanonicalLoRA",
    "LoRAModelSpec",
    "config_from_sources",
    "convert_to_canonical",
    "get_pattern_key",
    "guess_architecture",
    "load_lora_state_dict",
    "resolve_lora_path",
    # adapter manager and merge cache
    "MERGE_MODES",
    "AdapterKey",
    "LoRAManager",
    "MergeCache",
    "MergeKey",
]
