"""LoRA adapter runtime: file formats, PEFT config semantics, loading (and the adapter manager).

Names are imported lazily (on first attribute access), so light users such as the HTTP layer's
argument checks (:mod:`sglang.multimodal_gen.lora.requests`) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # formats / PEFT semantics / loading
    "AdapterConfig": "peft_config",
    "CanonicalLoRA": "formats",
    "LoRAModelSpec": "model_spec",
    "config_from_sources": "peft_config",
    "convert_to_canonical": "formats",
    "get_pattern_key": "peft_config",
    "guess_architecture": "key_grammar",
    "load_lora_state_dict": "loading",
    "resolve_lora_path": "loading",
    # request arguments
    "MERGE_MODES": "requests",
    "normalize_set_lora": "requests",
    "validate_composition": "requests",
    # adapter manager and merge cache
    "AdapterKey": "merge_cache",
    "LoRAManager": "manager",
    "LoRASelection": "per_request",
    "LoRAStateError": "transactions",
    "MergeCache": "merge_cache",
    "MergeKey": "merge_cache",
}

__all__ = [
    "MERGE_MODES",
    "AdapterConfig",
    "AdapterKey",
    "CanonicalLoRA",
    "LoRAManager",
    "LoRAModelSpec",
    "LoRASelection",
    "LoRAStateError",
    "MergeCache",
    "MergeKey",
    "config_from_sources",
    "convert_to_canonical",
    "get_pattern_key",
    "guess_architecture",
    "load_lora_state_dict",
    "normalize_set_lora",
    "resolve_lora_path",
    "validate_composition",
]
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from sglang.multimodal_gen.lora.formats import CanonicalLoRA, convert_to_canonical
    from sglang.multimodal_gen.lora.key_grammar import guess_architecture
    from sglang.multimodal_gen.lora.loading import load_lora_state_dict, resolve_lora_path
    from sglang.multimodal_gen.lora.manager import LoRAManager
    from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
    from sglang.multimodal_gen.lora.peft_config import (
        AdapterConfig,
        config_from_sources,
        get_pattern_key,
    )
    from sglang.multimodal_gen.lora.per_request import LoRASelection
    from sglang.multimodal_gen.lora.requests import (
        MERGE_MODES,
        normalize_set_lora,
        validate_composition,
    )
    from sglang.multimodal_gen.lora.transactions import LoRAStateError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
