"""The LoRA manager: the one object the pipeline and the server talk to about adapters.

It owns, for one rank:

* the LoRA-able layers of each *target* (``"transformer"``, ``"transformer_2"`` for two-expert
  models): every :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear` in the target module
  is wrapped with :func:`~sglang.multimodal_gen.layers.lora.wrap_with_lora` at construction;
* the loaded adapters (:class:`~sglang.multimodal_gen.lora.adapters.AdapterRegistry`: an LRU
  bounded by bytes; adapters of an active composition are pinned);
* the active composition ``[(nickname, strength), ...]`` and merge mode of each target;
* the merge cache (:class:`~sglang.multimodal_gen.lora.merge_cache.MergeCache`).

The work is split by responsibility: reading files and the path policy in
:mod:`~sglang.multimodal_gen.lora.loading`, the registry in :mod:`~sglang.multimodal_gen.lora.adapters`,
applying compositions to layers in :mod:`~sglang.multimodal_gen.lora.compose`, savepoints in
:mod:`~sglang.multimodal_gen.lora.transactions`, reports in :mod:`~sglang.multimodal_gen.lora.report`.
This module holds the public operations.

Every public operation is atomic: it validates and stages everything it can before touching a
layer, then changes the state under a savepoint that a failure rolls back (weights bit-identical).
Errors are :mod:`sglang.multimodal_gen.errors` types naming the request field (``lora_nickname``,
``lora_path``, ``target``, ``strength``, ``merge_mode``, ``lora``); the argument rules are those of
:mod:`sglang.multimodal_gen.lora.requests`, shared with the HTTP layer and the engine.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA
from sglang.multimodal_gen.lora.adapters import Adapter, AdapterRegistry
from sglang.multimodal_gen.lora.compose import CompositionMixin, wrap_layers
from sglang.multimodal_gen.lora.merge_cache import MergeCache
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.per_request import PerRequestMixin
from sglang.multimodal_gen.lora.report import ReportMixin
from sglang.multimodal_gen.lora.requests import (
    ALL_TARGETS,
    MERGE_MODES,
    check_target,
    normalize_set_lora,
)
from sglang.multimodal_gen.lora.staging import StagingMixin
from sglang.multimodal_gen.lora.transactions import LoRAStateError, TransactionMixin
from sglang.multimodal_gen.models.name_map import NameMap

logger = logging.getLogger(__name__)

__all__ = ["MERGE_MODES", "LoRAManager", "LoRAStateError"]

ALL = ALL_TARGETS


@dataclass
class _TargetState:
    composition: list[tuple[str, float]] = field(default_factory=list)  # (nickname, strength)
    mode: str = "auto"
    base_version: int = 0
    committed: list[dict[str, Any]] = field(default_factory=list)


class LoRAManager(StagingMixin, CompositionMixin, PerRequestMixin, TransactionMixin, ReportMixin):
    """Loads, activates, merges and switches LoRA adapters on one rank's model.

    Args:
        targets: ``{target_name: module}``, e.g. ``{"transformer": dit}`` (``"transformer_2"`` for
            the second expert of a two-expert model). ``"all"`` addresses every target.
        name_map: the model's :class:`NameMap` (file / diffusers / original names -> ours).
        allowed_roots: directories local LoRA paths must resolve into (realpath containment).
            ``None``: any local path (a user's own command line). An empty sequence: no local
            path at all (a server started without ``--lora-dir``); Hub ids present in the local
            Hugging Face cache are accepted in every case.
        max_loaded_bytes: bound on the bytes of loaded adapters on this rank
            (``--max-loaded-lora-gb``); the least recently used adapters that are not active are
            unloaded to make room.
        merge_cache_bytes: bound of the merge cache (``--lora-merge-cache-gb``; 0 disables it).
        default_merge_mode: ``"auto"``, ``"merge"`` or ``"dynamic"``, used when a call gives none.
        merge_cache_device: where merged weights are cached (default: the weights' device).
        model_name: used in messages.
        snapshot_device: where merged layers keep their pre-merge weights (default: the weights'
            device, where the snapshot is the base weight's own storage, no copy; ``"cpu"`` keeps
            accelerator memory at one model copy at the price of a host-to-device copy per
            unmerge).

    Raises:
        ValueError: no targets, a target named ``"all"``, a bad merge mode, a negative bound, or
            a target without any linear layer.
    """

    def __init__(
        self,
        targets: Mapping[str, nn.Module],
        name_map: NameMap | None = None,
        allowed_roots: Sequence[str] | None = None,
        max_loaded_bytes: int = 8 << 30,
        merge_cache_bytes: int = 1 << 30,
        default_merge_mode: str = "auto",
        merge_cache_device: str | torch.device | None = None,
        model_name: str | None = None,
        snapshot_device: str | torch.device | None = None,
    ):
        if not targets:
            raise ValueError("LoRAManager needs at least one target module")
        if ALL in targets:
            raise ValueError(f"{ALL!r} is reserved for 'every target'; name the targets")
        if default_merge_mode not in MERGE_MODES:
            raise ValueError(f"default_merge_mode must be one of {MERGE_MODES}")
        self.name_map = name_map
        self.allowed_roots = None if allowed_roots is None else list(allowed_roots)
        self.default_merge_mode = default_merge_mode
        self.cache = MergeCache(merge_cache_bytes, merge_cache_device)
        self._registry = AdapterRegistry(max_loaded_bytes)
        self._targets: dict[str, nn.Module] = dict(targets)
        self._layers: dict[str, dict[str, BaseLayerWithLoRA]] = {}
        self._specs: dict[str, LoRAModelSpec] = {}
        self._state: dict[str, _TargetState] = {}
        for tname, module in self._targets.items():
            self._layers[tname] = wrap_layers(tname, module)
            for layer in self._layers[tname].values():
                if snapshot_device is not None:
                    layer.snapshot_device = torch.device(snapshot_device)
            shapes = {
                name: {
                    s.shard_id: (s.full_size, layer.base_layer.input_size)
                    for s in layer.base_layer.shard_map
                }
                for name, layer in self._layers[tname].items()
            }
            self._specs[tname] = LoRAModelSpec.from_shapes(
                shapes, name_map, model_name or type(module).__name__
            )
            self._state[tname] = _TargetState(mode=default_merge_mode)
        self._uids = itertools.count()
        self._request_composition: list[tuple[str, float]] | None = None
        self._savepoints = []
        self.broken: str | None = None

    # ------------------------------------------------------------------ properties
    @property
    def target_names(self) -> tuple[str, ...]:
        """Valid ``target`` values: ``"all"`` and every target of this model."""
        return (ALL, *self._targets)

    def layers(self, target: str) -> dict[str, BaseLayerWithLoRA]:
        """``{module_name: LoRA layer}`` of one target (not ``"all"``)."""
        return dict(self._layers[target])

    @property
    def loaded_nicknames(self) -> list[str]:
        return list(self._registry)

    @property
    def max_loaded_bytes(self) -> int:
        return self._registry.max_bytes

    def loaded_bytes(self) -> int:
        return self._registry.loaded_bytes()

    def _resolve_targets(self, target: Any) -> list[str]:
        check_target(target, self.target_names)
        return list(self._targets) if target == ALL else [target]

    def _pinned(self, compositions: Mapping[str, list[tuple[str, float]]]) -> set[str]:
        pinned = {n for comp in compositions.values() for n, _ in comp}
        if self._request_composition:
            pinned |= {n for n, _ in self._request_composition}
        return pinned

    def _touch(self, names) -> None:
        for name in names:
            self._registry.touch(name)

    # ------------------------------------------------------------------ public API
    def load_adapter(self, nickname: str, path: str) -> dict[str, Any]:
        """Load (or reload from a new path) adapter ``nickname`` without activating it.

        Returns:
            The adapter's :meth:`list_loras` entry.

        Raises:
            InvalidRequestError / LoRAFormatError: bad nickname/path/file (``param`` names it).
            NotFoundError: not found locally nor in the Hub cache (from the loader).
        """
        self.set_lora([nickname], [path], [ALL], [1.0], _activate=False)
        return self._adapter_info(self._registry[nickname])

    def unload_adapter(self, nickname: str) -> dict[str, Any]:
        """Free adapter ``nickname``; if it is active anywhere it is deactivated there first.

        Raises:
            NotFoundError: unknown nickname (``param="lora_nickname"``).
        """
        if not isinstance(nickname, str) or not nickname.strip():
            raise InvalidRequestError(
                f"lora_nickname must be a non-empty string, got {nickname!r}", "lora_nickname"
            )
        adapter = self._registry.require(nickname)
        with self._txn():
            for st_name, st in self._state.items():
                if any(n == nickname for n, _ in st.composition):
                    new = [(n, s) for n, s in st.composition if n != nickname]
                    self._apply(st_name, new, st.mode)
                    st.composition = new
            self._registry.pop(nickname)
            self._drop(adapter)
        return {"status": "ok", "message": f"unloaded LoRA {nickname!r}"}

    def set_lora(
        self,
        nicknames: str | Sequence[str],
        paths: str | None | Sequence[str | None] = None,
        targets: str | Sequence[str] = ALL,
        strengths: float | Sequence[float] = 1.0,
        merge_mode: str | None = None,
        *,
        sources: Mapping[str, Any] | None = None,
        _activate: bool = True,
    ) -> dict[str, Any]:
        """Load what is needed and make the given adapters the active composition of their targets.

        Args:
            nicknames: one nickname or a list (each at most once per target).
            paths: per nickname a path/repo id to load, or ``None`` to use the loaded adapter. A
                scalar or a one-element list is broadcast over ``nicknames``; otherwise the
                lengths must match. A loaded nickname given a different or rewritten file is
                reloaded; given its unchanged file, nothing is read.
            targets: ``"all"``, ``"transformer"``, ... (broadcast like ``paths``).
            strengths: multipliers of each adapter's ``alpha / r`` (broadcast like ``paths``).
            merge_mode: ``"auto"``/``"merge"``/``"dynamic"`` (default: the manager's default).
            sources: ``{path: (state_dict, metadata)}`` already read with :meth:`read_source`, or
                ``{path: "unchanged"}`` (TP: by rank 0, for every rank); paths not in it are
                read here. A path given for several nicknames is read and converted once.

        Returns:
            ``{"status": "ok", "message": ..., "active": {target: [...]}, "memory": {...}}``.

        Raises:
            InvalidRequestError: bad field (``param`` names it: ``lora_nickname``, ``lora_path``,
                ``target``, ``strength``, ``merge_mode``), more than
                :data:`~sglang.multimodal_gen.lora.requests.MAX_ADAPTERS_PER_CALL` nicknames
                (nothing is read), list length mismatch, a duplicate
                nickname on one target, a bad file (:class:`LoRAFormatError`), an adapter that
                matches nothing in its target, merge impossible in ``"merge"`` mode, the adapter
                memory bound. NotFoundError: a nickname without path that is not loaded.
            On any error nothing changes (weights bit-identical, same adapters loaded).
        """
        self._check_usable()
        args = normalize_set_lora(
            nicknames, paths, targets, strengths, merge_mode, valid_targets=self.target_names
        )
        names, strength_list = args.nicknames, args.strengths
        mode = args.merge_mode or self.default_merge_mode
        new_comp: dict[str, list[tuple[str, float]]] = {}
        if _activate:
            for name, target, strength in zip(names, args.targets, strength_list):
                for t in self._resolve_targets(target):
                    new_comp.setdefault(t, []).append((name, strength))

        # stage files (read + convert) before touching anything
        staged: dict[str, tuple[Adapter, dict]] = {}
        given = {name: path for name, path in zip(names, args.paths) if path is not None}
        done: dict[str, tuple[dict, dict]] = {}  # a path named for several nicknames: read once
        for name, path in given.items():
            item = self._stage(name, path, sources, done)
            if item is not None:
                staged[name] = item
        for name in names:
            if name not in given:
                self._registry.require(name)  # null path: must be loaded already

        def adapter_for(name: str) -> Adapter:
            return staged[name][0] if name in staged else self._registry[name]

        for t, comp in new_comp.items():
            for name, _ in comp:
                if t not in adapter_for(name).modules:
                    raise InvalidRequestError(
                        f"adapter {name!r} matches no module of target {t!r}", param="target"
                    )
        self._check_strengths(new_comp, adapter_for, "strength")
        if mode == "merge":
            for t, comp in new_comp.items():
                self._check_mergeable_staged(t, comp, adapter_for)
        final = {t: list(s.composition) for t, s in self._state.items()} | new_comp
        evict = self._registry.plan_room(
            [a for a, _ in staged.values()], set(staged), self._pinned(final) | set(staged)
        )
        # a reloaded adapter active elsewhere gets its new weights there too
        reloaded = [
            t
            for t, s in self._state.items()
            if t not in new_comp and any(n in staged for n, _ in s.composition)
        ]
        with self._txn():
            for adapter, converted in staged.values():
                self._install(adapter, converted)
                old = self._registry.put(adapter)
                if old is not None:
                    self._drop(old)
            for t, comp in new_comp.items():
                self._apply(t, comp, mode)
                self._state[t].composition, self._state[t].mode = comp, mode
            for t in reloaded:
                st = self._state[t]
                self._apply(t, st.composition, st.mode, param="lora_path")
            for name in evict:
                logger.info("LoRA %r unloaded (LRU, memory bound)", name)
                self._drop(self._registry.pop(name))
                self._registry.evictions += 1
        self._touch([n for comp in new_comp.values() for n, _ in comp])
        self._touch(staged)
        what = ", ".join(f"{n}@{s:g}" for n, s in zip(names, strength_list))
        return {
            "status": "ok",
            "message": f"LoRA set: {what} (merge_mode={mode})",
            "active": {t: self._composition_json(t) for t in self._state},
            "memory": self.memory_report(),
        }

    def _check_mergeable_staged(self, t: str, comp, adapter_for: Callable[[str], Adapter]) -> None:
        for name, _ in comp:
            for module in adapter_for(name).modules.get(t, ()):
                if not self._layers[t][module].can_merge:
                    raise InvalidRequestError(
                        f"merge_mode 'merge': module {module!r} of {t!r} cannot merge LoRA "
                        "weights; use 'auto' or 'dynamic'",
                        param="merge_mode",
                    )

    def _change(self, target: str, what: str, step: Callable[[str], None]) -> dict[str, Any]:
        """Run ``step(t)`` for every target named by ``target`` under one savepoint."""
        self._check_usable()
        tnames = self._resolve_targets(target)
        with self._txn():
            for t in tnames:
                step(t)
        return {
            "status": "ok",
            "message": f"LoRA {what} on {target!r}",
            "memory": self.memory_report(),
        }

    def unset_lora(self, target: str = ALL) -> dict[str, Any]:
        """Deactivate the adapters of ``target`` (they stay loaded); weights return to the base.

        Raises:
            InvalidRequestError: unknown target (``param="target"``).
        """

        def step(t):
            self._apply(t, [], self._state[t].mode)
            self._state[t].composition = []

        return self._change(target, "unset", step)

    def merge(self, target: str = ALL) -> dict[str, Any]:
        """Merge the active composition of ``target`` into the weights (mode becomes ``"merge"``).

        Raises:
            InvalidRequestError: unknown target; a layer with an active adapter cannot merge.
        """
        for t in self._resolve_targets(target):
            self._check_mergeable(t, self._state[t].composition, "merge")

        def step(t):
            self._apply(t, self._state[t].composition, "merge")
            self._state[t].mode = "merge"

        return self._change(target, "merged", step)

    def unmerge(self, target: str = ALL) -> dict[str, Any]:
        """Restore the base weights of ``target``; its adapters keep running unmerged (``"dynamic"``).

        Raises:
            InvalidRequestError: unknown target.
        """

        def step(t):
            self._apply(t, self._state[t].composition, "dynamic")
            self._state[t].mode = "dynamic"

        return self._change(target, "unmerged", step)

    def commit_as_base(self, target: str = ALL) -> dict[str, Any]:
        """Bake the active composition of ``target`` into its base weights.

        The composition is cleared (its delta is now part of the base, which ``unset_lora`` and
        ``unmerge`` restore from then on); cached merges of the target are dropped.

        Raises:
            InvalidRequestError: unknown target; a layer with an active adapter cannot merge; an
                active adapter carries an output offset for a layer without a bias to fold it
                into. All checks run before any weight changes, so a refusal changes nothing.
        """
        self._check_usable()
        tnames = self._resolve_targets(target)
        for t in tnames:
            comp = self._state[t].composition
            self._check_mergeable(t, comp, "merge")
            for module, layer in self._layers[t].items():
                by_uid, _ = self._layer_comp(t, module, comp)
                if layer.base_layer.bias is None and layer.has_offsets([u for u, _ in by_uid]):
                    raise InvalidRequestError(
                        f"commit_as_base: an active adapter has an output offset (LoRA bias) on "
                        f"module {module!r} of {t!r}, which has no bias to fold it into; keep it "
                        "merged or dynamic instead",
                        param="target",
                    )
        for t in tnames:
            st = self._state[t]
            if not st.composition:
                continue
            with self._txn():
                self._apply(t, st.composition, "merge")
            # past this point the layers are merged; committing only drops snapshots
            for layer in self._layers[t].values():
                layer.commit_as_base()
            st.committed.extend({"nickname": n, "strength": s} for n, s in st.composition)
            st.composition = []
            st.base_version += 1
            self.cache.invalidate(lambda k, p=f"{t}:": k.module.startswith(p))
        return {"status": "ok", "message": f"LoRA committed as base on {target!r}"}
