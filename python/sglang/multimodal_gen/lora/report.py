"""Plain-JSON reports of the LoRA manager: ``list_loras`` and the memory it holds.

Functions of the adapter store and the composer, read through their public methods.

Memory (bytes, this rank; see docs/lora.md "Memory model"):

* ``loaded_bytes``: the loaded adapters' used columns in the layers' slot tensors (bounded by
  ``max_loaded_bytes``);
* ``slot_bytes``: the slot tensors as allocated (padding columns up to each layer's widest
  adapter, free slots up to its capacity, included);
* ``snapshot_bytes``: pre-merge weights kept by merged layers, by device (one weight per merged
  layer: the merged weight replaces it, the snapshot *is* the base weight's storage);
* ``merge_cache``: cached merged weights (bounded by ``max_bytes``; the entry a layer uses right
  now shares its storage with the parameter);
* ``workspace``: fp32 merge workspace held now (0 between operations) and its peak;
* ``lora_weight_bytes``: all weights of the LoRA-able layers (the most a snapshot set can reach);
  ``affected_weight_bytes``: those of the layers an active adapter touches.
"""

from __future__ import annotations

from typing import Any

from sglang.multimodal_gen.layers.lora import workspace_stats
from sglang.multimodal_gen.lora.adapters import Adapter, AdapterStore
from sglang.multimodal_gen.lora.compose import Composer

__all__ = ["adapter_info", "composition_json", "list_loras", "memory_report", "pinned"]


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def pinned(composer: Composer) -> set[str]:
    """Nicknames an active (global) composition uses: they cannot be evicted."""
    return {n for t in composer.target_names for n, _ in composer.composition(t)}


def composition_json(composer: Composer, target: str) -> dict[str, Any]:
    st = composer.state(target)
    layers = composer.layers(target).values()
    return {
        "adapters": [{"nickname": n, "strength": s} for n, s in st.composition],
        "merge_mode": st.mode,
        "merged_layers": sum(1 for layer in layers if layer.merged),
        "dynamic_layers": sum(1 for layer in layers if layer.active and not layer.merged),
        "committed": [{"nickname": n, "strength": s} for n, s in st.committed],
    }


def adapter_info(composer: Composer, a: Adapter) -> dict[str, Any]:
    return {
        "nickname": a.nickname,
        "path": a.source,
        "bytes": a.nbytes,
        "targets": {t: dict(s) for t, s in a.summaries.items()},
        "active_on": [
            t
            for t in composer.target_names
            if any(n == a.nickname for n, _ in composer.composition(t))
        ],
        "pinned": a.nickname in pinned(composer),
    }


def memory_report(store: AdapterStore, composer: Composer) -> dict[str, Any]:
    """Bytes held by the LoRA runtime on this rank (see the module docstring)."""
    snapshots: dict[str, int] = {}
    slot_bytes = weights = affected = 0
    for layer in composer.all_layers():
        weights += _nbytes(layer.base_layer.weight)
        if layer.active or layer.merged:
            affected += _nbytes(layer.base_layer.weight)
        snap = layer.snapshot
        if snap is not None:
            dev = str(snap.device)
            snapshots[dev] = snapshots.get(dev, 0) + _nbytes(snap)
        slot_bytes += layer.slot_nbytes()
    ws = workspace_stats()
    return {
        "loaded_bytes": store.loaded_bytes(),
        "max_loaded_bytes": store.max_bytes,
        "adapter_evictions": store.evictions,
        "slot_bytes": slot_bytes,
        "snapshot_bytes": sum(snapshots.values()),
        "snapshot_bytes_by_device": snapshots,
        "merge_cache_bytes": composer.cache.bytes,
        "merge_cache_max_bytes": composer.cache.max_bytes,
        "workspace_bytes": ws["live"],
        "workspace_peak_bytes": ws["peak"],
        "lora_weight_bytes": weights,
        "affected_weight_bytes": affected,
    }


def list_loras(
    store: AdapterStore, composer: Composer, target_names, default_merge_mode: str
) -> dict[str, Any]:
    """Plain-JSON state: loaded adapters (LRU order, oldest first), the active composition,
    mode and merged/dynamic layer counts per target, memory and merge-cache counters."""
    return {
        "available": True,
        "targets": list(target_names),
        "default_merge_mode": default_merge_mode,
        "loaded": [adapter_info(composer, a) for a in store.values()],
        "active": {t: composition_json(composer, t) for t in composer.target_names},
        "memory": memory_report(store, composer),
        "merge_cache": composer.cache.stats(),
    }
