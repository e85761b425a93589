"""Putting adapters on layers and compositions into effect, for the LoRA manager.

Per target, :meth:`CompositionMixin._apply` brings every layer to a composition under a merge mode:

* ``"dynamic"``: unmerged, the layers add the fused LoRA path in their forward;
* ``"merge"``: merged into the weights (merged weights come from the merge cache when possible);
* ``"auto"``: merged where the layer can merge, dynamic elsewhere;
* ``"request"`` (per-request compositions): a merged layer keeps its weights and runs the request
  as an overlay, ``merged + (request - merged)`` in its forward, so nothing is unmerged now or
  re-merged afterwards; an unmerged layer switches its dynamic composition.

Finite is not safe: before any layer changes, each adapter's ``strength x alpha / r`` must be finite
in float32 and ``|strength x scale x B|`` must fit the weights' dtype
(:meth:`CompositionMixin._check_strengths`); a merge whose result is not finite is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA, replace_submodule, wrap_with_lora
from sglang.multimodal_gen.layers.lora.weights import all_finite
from sglang.multimodal_gen.lora.adapters import Adapter
from sglang.multimodal_gen.lora.formats import CanonicalLoRA
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeKey
from sglang.multimodal_gen.lora.peft_config import FP32_MAX

__all__ = ["CompositionMixin", "wrap_layers"]

Composition = list[tuple[str, float]]


class CompositionMixin:
    """Layers, conversion and composition application of the LoRA manager (state it owns:
    ``_layers``, ``_specs``, ``_state``, ``_registry``, ``cache``)."""

    # ------------------------------------------------------------------ layers
    def _install(self, adapter: Adapter, converted: Mapping[str, CanonicalLoRA]) -> None:
        """Add the adapter's slices to the layers (under its uid). Raises after undoing."""
        done: list[BaseLayerWithLoRA] = []
        try:
            for tname, canon in converted.items():
                for module, shards in canon.modules.items():
                    layer = self._layers[tname][module]
                    layer.add_adapter(adapter.uid, shards)
                    done.append(layer)
        except BaseException as e:
            for layer in done:
                layer.remove_adapter(adapter.uid)
            if isinstance(e, ValueError):
                raise InvalidRequestError(
                    f"LoRA {adapter.nickname!r}: {e}", param="lora_path"
                ) from e
            raise
        adapter.nbytes = sum(layer.adapter_nbytes(adapter.uid) for layer in done)
        self._note_installed(adapter)

    def _uninstall(self, adapter: Adapter) -> None:
        for tname, modules in adapter.modules.items():
            for module in modules:
                self._layers[tname][module].remove_adapter(adapter.uid)

    # ------------------------------------------------------------------ checks
    def _check_strengths(
        self,
        compositions: Mapping[str, Composition],
        adapter_for: Callable[[str], Adapter],
        param: str,
    ) -> None:
        """Refuse a composition whose numbers overflow where they are used: ``strength x alpha /
        r`` beyond float32, or ``|strength x scale x B|`` beyond the layer weights' dtype.

        Raises:
            InvalidRequestError: ``param`` (``"strength"`` or ``"lora"``).
        """
        for t, comp in compositions.items():
            layers = self._layers[t]
            for name, strength in comp:
                adapter = adapter_for(name)
                for (tt, module), shard_scales in adapter.scales.items():
                    if tt != t:
                        continue
                    for _, scale in shard_scales:
                        eff = strength * scale
                        if not abs(eff) <= FP32_MAX:
                            raise InvalidRequestError(
                                f"strength {strength:g} of adapter {name!r} times its scale "
                                f"alpha/r = {scale:g} is {eff:g}, which is not finite in "
                                "float32; use a smaller strength",
                                param=param,
                            )
                    dtype = layers[module].base_layer.weight.dtype
                    top = torch.finfo(dtype).max if dtype.is_floating_point else FP32_MAX
                    peak = abs(strength) * adapter.peaks.get((tt, module), 0.0)
                    if not peak <= top:
                        raise InvalidRequestError(
                            f"strength {strength:g} of adapter {name!r} makes its LoRA weights "
                            f"overflow {str(dtype).removeprefix('torch.')} on module {module!r} "
                            f"(largest |strength x scale x B| = {peak:g}); use a smaller strength",
                            param=param,
                        )

    def _check_mergeable(self, tname: str, comp: Composition, mode: str) -> None:
        if mode != "merge":
            return
        for module, layer in self._layers[tname].items():
            by_uid, _ = self._layer_comp(tname, module, comp)
            if by_uid and not layer.can_merge:
                raise InvalidRequestError(
                    f"merge_mode 'merge': module {module!r} of {tname!r} cannot merge LoRA "
                    "weights; use 'auto' or 'dynamic'",
                    param="merge_mode",
                )

    # ------------------------------------------------------------------ applying
    def _layer_comp(self, tname: str, module: str, comp: Composition):
        """Composition by layer uid for one layer, and its merge-cache key."""
        by_uid, keys = [], []
        for nickname, strength in comp:
            adapter = self._registry[nickname]
            scales = adapter.scales.get((tname, module))
            if scales is None:
                continue
            by_uid.append((adapter.uid, strength))
            keys.append(AdapterKey(adapter.identity, strength, scales))
        key = MergeKey(f"{tname}:{module}", self._state[tname].base_version, tuple(keys))
        return by_uid, key

    def _apply(
        self,
        tname: str,
        comp: Composition,
        mode: str,
        use_cache: bool = True,
        param: str = "strength",
    ) -> None:
        """Put every layer of ``tname`` into ``comp`` under ``mode`` (the caller's savepoint
        undoes a partial change). A layer already in the wanted state is not touched.

        Raises:
            InvalidRequestError: ``param``; a merged weight came out NaN/Inf.
        """
        for module, layer in self._layers[tname].items():
            by_uid, key = self._layer_comp(tname, module, comp)
            same = layer.active_composition == by_uid
            if mode == "request":
                if same and layer.overlay is None:
                    continue
                if layer.merged:
                    if same:
                        layer.clear_overlay()
                    else:
                        layer.set_overlay(by_uid)
                else:
                    layer.set_active(by_uid)
                continue
            want_merged = bool(by_uid) and (mode == "merge" or (mode == "auto" and layer.can_merge))
            if same and layer.merged == want_merged and layer.overlay is None:
                continue
            if not want_merged:
                if layer.merged:
                    layer.unmerge()
                layer.set_active(by_uid)
                continue
            cached = self.cache.get(key) if use_cache else None
            if layer.merged:
                merged = layer.set_active(by_uid, cached=cached)
            else:
                layer.set_active(by_uid)
                merged = layer.merge(cached=cached) if layer.active else None
            if cached is None and merged is not None and not all_finite(merged):
                raise InvalidRequestError(
                    f"merging the LoRA composition {[n for n, _ in comp]} into module {module!r} "
                    f"of {tname!r} gives NaN/Inf weights in "
                    f"{str(merged.dtype).removeprefix('torch.')}; use smaller strengths (or the "
                    "adapter's weights are extreme)",
                    param=param,
                )
            if use_cache and cached is None and merged is not None and layer.merged:
                self.cache.put(key, merged)


def wrap_layers(tname: str, module: nn.Module) -> dict[str, BaseLayerWithLoRA]:
    """Wrap every ParallelLinear of ``module`` (once) and return ``{name: LoRA layer}``."""
    layers: dict[str, BaseLayerWithLoRA] = {}
    named = list(module.named_modules())
    wrapped_prefixes = tuple(n + "." for n, m in named if isinstance(m, BaseLayerWithLoRA))
    for name, mod in named:
        if not name or (wrapped_prefixes and name.startswith(wrapped_prefixes)):
            continue
        if isinstance(mod, BaseLayerWithLoRA):
            layers[name] = mod
        elif isinstance(mod, ParallelLinear):
            layers[name] = replace_submodule(module, name, wrap_with_lora(mod))
    if not layers:
        raise ValueError(f"target {tname!r} has no ParallelLinear layer to put LoRA on")
    return layers
