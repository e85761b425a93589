"""Plain-JSON reports of the LoRA manager: ``list_loras`` and the memory it holds.

Memory (bytes, this rank; see docs/lora.md "Memory model"):

* ``loaded_bytes``: the loaded adapters' slices on the layers (bounded by ``max_loaded_bytes``);
* ``snapshot_bytes``: pre-merge weights kept by merged layers, by device (one weight per merged
  layer: the merged weight replaces it, the snapshot *is* the base weight's storage);
* ``merge_cache``: cached merged weights (bounded by ``max_bytes``; the entry a layer uses right
  now shares its storage with the parameter);
* ``compiled_bytes``: fused ``A_cat``/``B_cat``/offsets of dynamic layers and request overlays;
* ``workspace``: fp32 merge workspace held now (0 between operations) and its peak;
* ``lora_weight_bytes``: all weights of the LoRA-able layers (the most a snapshot set can reach);
  ``affected_weight_bytes``: those of the layers an active adapter touches.
"""

from __future__ import annotations

from typing import Any

from sglang.multimodal_gen.layers.lora import workspace_stats
from sglang.multimodal_gen.lora.adapters import Adapter

__all__ = ["ReportMixin"]


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ReportMixin:
    """``list_loras`` and memory figures of the LoRA manager."""

    def _composition_json(self, t: str) -> dict[str, Any]:
        st = self._state[t]
        layers = self._layers[t].values()
        return {
            "adapters": [{"nickname": n, "strength": s} for n, s in st.composition],
            "merge_mode": st.mode,
            "merged_layers": sum(1 for layer in layers if layer.merged),
            "dynamic_layers": sum(1 for layer in layers if layer.active and not layer.merged),
            "overlay_layers": sum(1 for layer in layers if layer.overlay is not None),
            "committed": list(st.committed),
        }

    def _adapter_info(self, a: Adapter) -> dict[str, Any]:
        pinned = self._pinned({t: s.composition for t, s in self._state.items()})
        return {
            "nickname": a.nickname,
            "path": a.source,
            "bytes": a.nbytes,
            "targets": {t: dict(s) for t, s in a.summaries.items()},
            "active_on": [
                t for t, s in self._state.items() if any(n == a.nickname for n, _ in s.composition)
            ],
            "pinned": a.nickname in pinned,
        }

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by the LoRA runtime on this rank (see the module docstring)."""
        snapshots: dict[str, int] = {}
        compiled = weights = affected = 0
        for layers in self._layers.values():
            for layer in layers.values():
                weights += _nbytes(layer.base_layer.weight)
                if layer.active or layer.merged:
                    affected += _nbytes(layer.base_layer.weight)
                if layer.merged and layer._snapshot is not None:
                    dev = str(layer._snapshot.device)
                    snapshots[dev] = snapshots.get(dev, 0) + _nbytes(layer._snapshot)
                for t in (layer._a_cat, layer._b_cat, layer._offset, *(layer._ov or ())):
                    compiled += _nbytes(t)
        ws = workspace_stats()
        return {
            "loaded_bytes": self._registry.loaded_bytes(),
            "max_loaded_bytes": self._registry.max_bytes,
            "adapter_evictions": self._registry.evictions,
            "snapshot_bytes": sum(snapshots.values()),
            "snapshot_bytes_by_device": snapshots,
            "merge_cache_bytes": self.cache.bytes,
            "merge_cache_max_bytes": self.cache.max_bytes,
            "compiled_bytes": compiled,
            "workspace_bytes": ws["live"],
            "workspace_peak_bytes": ws["peak"],
            "lora_weight_bytes": weights,
            "affected_weight_bytes": affected,
        }

    def list_loras(self) -> dict[str, Any]:
        """Plain-JSON state: loaded adapters (LRU order, oldest first), the active composition,
        mode and merged/dynamic layer counts per target, memory and merge-cache counters."""
        self._check_usable()
        return {
            "available": True,
            "targets": list(self.target_names),
            "default_merge_mode": self.default_merge_mode,
            "loaded": [self._adapter_info(a) for a in self._registry.values()],
            "active": {t: self._composition_json(t) for t in self._state},
            "memory": self.memory_report(),
            "merge_cache": self.cache.stats(),
        }
