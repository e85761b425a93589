"""The composer: the LoRA layers of each target and their global composition.

:class:`Composer` owns, per target, the wrapped layers, the shared
:class:`~sglang.multimodal_gen.layers.lora.LoRAContext`, and the global composition
``[(nickname, strength), ...]`` with its merge mode. It puts adapters on the layers (each in the
slot the :class:`~sglang.multimodal_gen.lora.adapters.AdapterStore` assigns it in that target)
and brings every layer of a target to a composition under a merge mode (:meth:`Composer.apply`):

* ``"dynamic"``: unmerged, the layers add the composition's delta in their forward;
* ``"merge"``: merged into the weights (merged weights come from the merge cache when possible);
* ``"auto"``: merged where the layer can merge, dynamic elsewhere.

Finite is not safe: before any layer changes, each adapter's ``strength x alpha / r`` must be finite
in float32 and ``|strength x scale x B|`` must fit the weights' dtype
(:meth:`Composer.check_strengths`); a merge whose result is not finite is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.lora import (
    BaseLayerWithLoRA,
    Composition,
    LoRAContext,
    lora_context_of,
    replace_submodule,
    wrap_with_lora,
)
from sglang.multimodal_gen.layers.lora.weights import all_finite
from sglang.multimodal_gen.lora.adapters import Adapter, AdapterStore
from sglang.multimodal_gen.lora.formats import CanonicalLoRA
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey
from sglang.multimodal_gen.lora.peft_config import FP32_MAX

__all__ = ["Composer", "TargetState", "wrap_layers"]

#: ``[(nickname, strength), ...]``: a composition as the user names it.
NamedComposition = list[tuple[str, float]]


@dataclass(frozen=True)
class TargetState:
    """A target's global composition as the user set it, and what its layers were given.

    Attributes:
        composition: ``[(nickname, strength), ...]`` (a tuple).
        mode: the merge mode.
        base_version: bumped by ``commit_as_base`` (merge-cache keys carry it).
        committed: what was committed into the base weights, oldest first.
        applied: the :class:`Composition` (slots) every layer of the target holds as active.
    """

    composition: tuple[tuple[str, float], ...] = ()
    mode: str = "auto"
    base_version: int = 0
    committed: tuple[tuple[str, float], ...] = ()
    applied: Composition = field(default=Composition.EMPTY)


class Composer:
    """Layers, contexts and global compositions of the LoRA manager's targets.

    Args:
        targets: ``{target: module}``; every ``ParallelLinear`` inside is wrapped (once).
        store: the adapter store (slots, adapters by nickname).
        cache: the merge cache.
        default_mode: the merge mode of a target before any ``set_lora``.
        snapshot_device: where merged layers keep their pre-merge weights (``None``: the
            weights' device).

    Raises:
        ValueError: a target without any ``ParallelLinear``.
    """

    def __init__(
        self,
        targets: Mapping[str, nn.Module],
        store: AdapterStore,
        cache: MergeCache,
        default_mode: str = "auto",
        snapshot_device: str | torch.device | None = None,
    ):
        self.store = store
        self.cache = cache
        self._layers: dict[str, dict[str, BaseLayerWithLoRA]] = {}
        self._contexts: dict[str, LoRAContext] = {}
        self._state: dict[str, TargetState] = {}
        for tname, module in targets.items():
            self._layers[tname], self._contexts[tname] = wrap_layers(tname, module)
            if snapshot_device is not None:
                for layer in self._layers[tname].values():
                    layer.snapshot_device = torch.device(snapshot_device)
            self._state[tname] = TargetState(mode=default_mode)

    # ------------------------------------------------------------------ reading
    @property
    def target_names(self) -> list[str]:
        return list(self._layers)

    def layers(self, target: str) -> dict[str, BaseLayerWithLoRA]:
        """``{module_name: LoRA layer}`` of ``target`` (a copy of the mapping)."""
        return dict(self._layers[target])

    def all_layers(self) -> Iterator[BaseLayerWithLoRA]:
        for layers in self._layers.values():
            yield from layers.values()

    def context(self, target: str) -> LoRAContext:
        return self._contexts[target]

    def state(self, target: str) -> TargetState:
        return self._state[target]

    def composition(self, target: str) -> NamedComposition:
        return list(self._state[target].composition)

    def mode(self, target: str) -> str:
        return self._state[target].mode

    def shapes(self, target: str) -> dict[str, dict[Any, tuple[int, int]]]:
        """``{module: {shard_id: (full_out, full_in)}}`` of ``target``'s layers (for the spec)."""
        return {
            name: {
                s.shard_id: (s.full_size, layer.base_layer.input_size)
                for s in layer.base_layer.shard_map
            }
            for name, layer in self._layers[target].items()
        }

    def slot_composition(self, target: str, comp: Sequence[tuple[str, float]]) -> Composition:
        """The slots of ``comp`` (loaded, installed nicknames) in ``target``, in order; adapters
        without a module in the target are left out."""
        out = []
        for nickname, strength in comp:
            adapter = self.store[nickname]
            if target not in adapter.modules:
                continue
            out.append((self.store.slot_of(target, adapter.uid), strength))
        return Composition(out)

    # ------------------------------------------------------------------ state changes
    def set_target(self, target: str, **changes: Any) -> None:
        """Replace fields of ``target``'s :class:`TargetState` (lists become tuples)."""
        for k in ("composition", "committed"):
            if k in changes:
                changes[k] = tuple((n, float(s)) for n, s in changes[k])
        self._state[target] = replace(self._state[target], **changes)
        self.context(target).active = self._state[target].applied

    def states(self) -> dict[str, TargetState]:
        """Every target's state (immutable values), for a savepoint."""
        return dict(self._state)

    def layer_states(self) -> dict[str, dict[str, tuple[Composition, bool]]]:
        """``{target: {module: (active composition, merged)}}``, for a savepoint."""
        return {
            t: {m: (layer.active_composition, layer.merged) for m, layer in layers.items()}
            for t, layers in self._layers.items()
        }

    def restore(
        self,
        states: Mapping[str, TargetState],
        layer_states: Mapping[str, Mapping[str, tuple[Composition, bool]]],
    ) -> None:
        """Put back target states and layer states recorded by :meth:`states` and
        :meth:`layer_states`; a layer already in its recorded state is not touched, a merged one
        is re-merged (deterministic: bit-identical weights)."""
        self._state.update(states)
        for t, st in states.items():
            self.context(t).active = st.applied
        for t, saved in layer_states.items():
            for m, (comp, merged) in saved.items():
                layer = self._layers[t][m]
                if (layer.active_composition, layer.merged) != (comp, merged):
                    layer.unmerge()
                    layer.set_active(comp)
                    if merged:
                        layer.merge()

    def reset(self) -> list[tuple[BaseLayerWithLoRA, BaseException]]:
        """Every layer to its base weight with nothing active, every target's composition
        cleared (after a failed restore); returns the layers that failed (best effort)."""
        failed = []
        for layer in self.all_layers():
            for step in (layer.unmerge, lambda layer=layer: layer.set_active(Composition.EMPTY)):
                try:
                    step()
                except BaseException as e:  # pragma: no cover - best effort, already failing
                    failed.append((layer, e))
        for t in self._state:
            self.set_target(t, composition=[], applied=Composition.EMPTY)
        return failed

    # ------------------------------------------------------------------ adapters on layers
    def install_bytes(self, converted: Mapping[str, CanonicalLoRA]) -> int:
        """Bytes installing ``converted`` would take on this rank's layers."""
        return sum(
            self._layers[t][module].nbytes_for(shards)
            for t, canon in converted.items()
            for module, shards in canon.modules.items()
        )

    def install(self, adapter: Adapter, converted: Mapping[str, CanonicalLoRA]) -> None:
        """Put the adapter's slices on the layers under its uid, in its target-wide slot (taken
        in the store). Raises after undoing (a layer's ``ValueError`` becomes an
        ``InvalidRequestError`` with ``param="lora_path"``)."""
        done: list[BaseLayerWithLoRA] = []
        try:
            for tname, canon in converted.items():
                layers = self._layers[tname]
                taken = set().union(*(layer.occupied_slots for layer in layers.values()))
                slot = self.store.assign_slot(tname, adapter.uid, taken)
                for module, shards in canon.modules.items():
                    layer = layers[module]
                    layer.add_adapter(adapter.uid, shards, slot=slot)
                    done.append(layer)
        except BaseException as e:
            for layer in done:
                layer.remove_adapter(adapter.uid)
            self.store.free_slots(adapter.uid)
            if isinstance(e, ValueError):
                raise InvalidRequestError(
                    f"LoRA {adapter.nickname!r}: {e}", param="lora_path"
                ) from e
            raise
        adapter.nbytes = sum(layer.adapter_nbytes(adapter.uid) for layer in done)

    def uninstall(self, adapter: Adapter) -> None:
        """Take the adapter off the layers and free its slots."""
        for tname, modules in adapter.modules.items():
            for module in modules:
                self._layers[tname][module].remove_adapter(adapter.uid)
        self.store.free_slots(adapter.uid)

    # ------------------------------------------------------------------ checks
    def check_strengths(
        self,
        compositions: Mapping[str, Sequence[tuple[str, float]]],
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
                    dtype = layers[module].base_layer.dtype
                    top = torch.finfo(dtype).max if dtype.is_floating_point else FP32_MAX
                    peak = abs(strength) * adapter.peaks.get((tt, module), 0.0)
                    if not peak <= top:
                        raise InvalidRequestError(
                            f"strength {strength:g} of adapter {name!r} makes its LoRA weights "
                            f"overflow {str(dtype).removeprefix('torch.')} on module {module!r} "
                            f"(largest |strength x scale x B| = {peak:g}); use a smaller strength",
                            param=param,
                        )

    def check_mergeable(
        self,
        target: str,
        comp: Sequence[tuple[str, float]],
        adapter_for: Callable[[str], Adapter] | None = None,
        what: str = "merge_mode 'merge'",
    ) -> None:
        """Refuse merge mode when a layer an adapter of ``comp`` touches cannot merge, e.g. its
        base weight is quantized (``adapter_for``: how to find a nickname's adapter, staged ones
        included; ``what``: the call the message names). Nothing changes.

        Raises:
            InvalidRequestError: ``param="merge_mode"``; the message names the module and why
                (:attr:`BaseLayerWithLoRA.merge_refusal`).
        """
        find = adapter_for or self.store.__getitem__
        for name, _ in comp:
            for module in find(name).modules.get(target, ()):
                layer = self._layers[target][module]
                if not layer.can_merge:
                    raise InvalidRequestError(
                        f"{what}: module {module!r} of {target!r} cannot merge LoRA "
                        f"weights ({layer.merge_refusal}); use 'auto' or 'dynamic'",
                        param="merge_mode",
                    )

    def check_commit(self, target: str) -> None:
        """Refuse ``commit_as_base`` when an active adapter has an output offset on a layer
        without a bias (nothing changes).

        Raises:
            InvalidRequestError: ``param="target"``; or as :meth:`check_mergeable`.
        """
        comp = self.composition(target)
        self.check_mergeable(target, comp, what="commit_as_base")
        uids = [self.store[n].uid for n, _ in comp]
        for module, layer in self._layers[target].items():
            if layer.base_layer.bias is None and layer.has_offsets(uids):
                raise InvalidRequestError(
                    f"commit_as_base: an active adapter has an output offset (LoRA bias) on "
                    f"module {module!r} of {target!r}, which has no bias to fold it into; keep it "
                    "merged or dynamic instead",
                    param="target",
                )

    # ------------------------------------------------------------------ applying
    def _merge_key(self, target: str, module: str, comp: Sequence[tuple[str, float]]) -> MergeKey:
        keys = []
        for nickname, strength in comp:
            adapter = self.store[nickname]
            scales = adapter.scales.get((target, module))
            if scales is not None:
                keys.append(AdapterKey(adapter.identity, strength, scales))
        return MergeKey(f"{target}:{module}", self._state[target].base_version, tuple(keys))

    def apply(
        self,
        target: str,
        comp: Sequence[tuple[str, float]],
        mode: str,
        use_cache: bool = True,
        param: str = "strength",
    ) -> None:
        """Put every layer of ``target`` into ``comp`` under ``mode`` and record it as the
        target's composition (the caller's savepoint undoes a partial change). A layer already
        in the wanted state is not touched; one whose own part of the composition is unchanged
        is not re-merged.

        Raises:
            InvalidRequestError: ``param``; a merged weight came out NaN/Inf.
        """
        slots = self.slot_composition(target, comp)
        for module, layer in self._layers[target].items():
            local = layer.local_composition(slots)
            want_merged = bool(local) and (mode == "merge" or (mode == "auto" and layer.can_merge))
            if layer.active_composition == slots and layer.merged == want_merged:
                continue
            if not want_merged:
                layer.unmerge()
                layer.set_active(slots)
                continue
            if layer.merged and layer.merged_composition == local:
                layer.set_active(slots)  # its part is merged already
                continue
            key = self._merge_key(target, module, comp)
            cached = self.cache.get(key) if use_cache else None
            if layer.merged:
                merged = layer.set_active(slots, cached=cached)
            else:
                layer.set_active(slots)
                merged = layer.merge(cached=cached)
            if cached is None and merged is not None and not all_finite(merged):
                raise InvalidRequestError(
                    f"merging the LoRA composition {[n for n, _ in comp]} into module {module!r} "
                    f"of {target!r} gives NaN/Inf weights in "
                    f"{str(merged.dtype).removeprefix('torch.')}; use smaller strengths (or the "
                    "adapter's weights are extreme)",
                    param=param,
                )
            if use_cache and cached is None and merged is not None and layer.merged:
                self.cache.put(key, merged)
        self.set_target(target, composition=list(comp), mode=mode, applied=slots)

    def commit(self, target: str, mode: str) -> None:
        """Bake ``target``'s composition, merged on every layer that has a part of it (the
        caller applied it in ``"merge"`` mode), into the base weights: snapshots dropped, the
        composition recorded as committed and cleared, the mode set back to ``mode``, the
        target's cached merges dropped. Not undoable: run :meth:`check_commit` first."""
        st = self._state[target]
        for layer in self._layers[target].values():
            layer.commit_as_base()
        self.set_target(
            target,
            committed=[*st.committed, *st.composition],
            composition=[],
            mode=mode,
            base_version=st.base_version + 1,
            applied=Composition.EMPTY,
        )
        self.cache.invalidate(lambda k, p=f"{target}:": k.module.startswith(p))


def wrap_layers(tname: str, module: nn.Module) -> tuple[dict[str, BaseLayerWithLoRA], LoRAContext]:
    """Wrap every ParallelLinear of ``module`` (once) and return ``({name: LoRA layer}, the
    target's context)``; the context is set on ``module`` and on every layer (an existing one is
    reused, so a second manager over the same model shares it).

    Raises:
        ValueError: ``module`` has no ParallelLinear.
    """
    ctx = lora_context_of(module) or LoRAContext(tname)
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
    module.lora_context = ctx
    for layer in layers.values():
        layer.lora_context = ctx
    return layers, ctx
