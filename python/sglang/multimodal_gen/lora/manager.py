"""The LoRA manager: the one object the pipeline and the server talk to about adapters.

A facade over objects that own their state, for one rank:

* :class:`~sglang.multimodal_gen.lora.adapters.AdapterStore`: the loaded adapters (an LRU bounded
  by bytes; adapters of an active composition are pinned) and the slot table (the slot index
  every layer of a target uses for an adapter);
* :class:`~sglang.multimodal_gen.lora.staging.Stager`: reading and converting files under the
  path policy;
* :class:`~sglang.multimodal_gen.lora.compose.Composer`: the LoRA-able layers of each *target*
  (``"transformer"``, ``"transformer_2"`` for two-expert models; every
  :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear` in the target module is wrapped
  with :func:`~sglang.multimodal_gen.layers.lora.wrap_with_lora` at construction), their shared
  :class:`~sglang.multimodal_gen.layers.lora.LoRAContext`, the global composition and merge mode
  of each target, the merge cache;
* :class:`~sglang.multimodal_gen.lora.transactions.Savepoints`: savepoints and the TP protocol;
* :mod:`~sglang.multimodal_gen.lora.report` and :mod:`~sglang.multimodal_gen.lora.per_request`:
  functions over those (``list_loras``, a request's :class:`LoRASelection`).

Every public operation is atomic: it validates and stages everything it can before touching a
layer, then changes the state under a savepoint that a failure rolls back (weights bit-identical).
Errors are :mod:`sglang.multimodal_gen.errors` types naming the request field (``lora_nickname``,
``lora_path``, ``target``, ``strength``, ``merge_mode``, ``lora``); the argument rules are those of
:mod:`sglang.multimodal_gen.lora.requests`, shared with the HTTP layer and the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import sglang.multimodal_gen.lora.report as report
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA, LoRAContext
from sglang.multimodal_gen.lora.adapters import Adapter, AdapterStore
from sglang.multimodal_gen.lora.compose import Composer
from sglang.multimodal_gen.lora.merge_cache import MergeCache
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.per_request import LoRASelection, select
from sglang.multimodal_gen.lora.requests import (
    ALL_TARGETS,
    MERGE_MODES,
    SetLoRAArgs,
    check_target,
    normalize_set_lora,
)
from sglang.multimodal_gen.lora.staging import Stager
from sglang.multimodal_gen.lora.transactions import LoRAStateError, Savepoints
from sglang.multimodal_gen.models.name_map import NameMap

logger = logging.getLogger(__name__)

__all__ = ["MERGE_MODES", "LoRAManager", "LoRASelection", "LoRAStateError"]

ALL = ALL_TARGETS


class LoRAManager:
    """Loads, activates, merges and switches LoRA adapters on one rank's model.

    Args:
        targets: ``{target_name: module}``, e.g. ``{"transformer": dit}`` (``"transformer_2"`` for
            the second expert of a two-expert model). ``"all"`` addresses every target.
        name_map: the model's :class:`NameMap` (file / diffusers / original names -> ours).
        allowed_roots: directories local LoRA paths must resolve into (realpath containment).
            ``None``: any local path (a user's own command line). An empty sequence: no local
            path at all (a server started without ``--lora-dir``); Hub ids are accepted in
            every case.
        allow_hub_download: a Hub id missing from the local Hugging Face cache is downloaded
            (``False``: refused, unless the call is ``trusted``: startup ``--lora-path``).
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
            unmerge, and per forward of rows that do not use the merged composition).

    Attributes:
        store, stager, composer, savepoints: the objects above.
        cache: the merge cache (``composer.cache``).

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
        allow_hub_download: bool = False,
    ):
        if not targets:
            raise ValueError("LoRAManager needs at least one target module")
        if ALL in targets:
            raise ValueError(f"{ALL!r} is reserved for 'every target'; name the targets")
        if default_merge_mode not in MERGE_MODES:
            raise ValueError(f"default_merge_mode must be one of {MERGE_MODES}")
        self.name_map = name_map
        self.default_merge_mode = default_merge_mode
        self.store = AdapterStore(max_loaded_bytes)
        self.composer = Composer(
            targets,
            self.store,
            MergeCache(merge_cache_bytes, merge_cache_device),
            default_merge_mode,
            snapshot_device,
        )
        specs = {
            t: LoRAModelSpec.from_shapes(
                self.composer.shapes(t), name_map, model_name or type(module).__name__
            )
            for t, module in targets.items()
        }
        self.stager = Stager(allowed_roots, specs, allow_hub_download)
        self.savepoints = Savepoints(self.store, self.composer)

    # ------------------------------------------------------------------ properties
    @property
    def cache(self) -> MergeCache:
        return self.composer.cache

    @property
    def allowed_roots(self) -> list[str] | None:
        return self.stager.allowed_roots

    @property
    def broken(self) -> str | None:
        """Why the LoRA state was lost (every later call raises :class:`LoRAStateError`)."""
        return self.savepoints.broken

    @property
    def target_names(self) -> tuple[str, ...]:
        """Valid ``target`` values: ``"all"`` and every target of this model."""
        return (ALL, *self.composer.target_names)

    def layers(self, target: str) -> dict[str, BaseLayerWithLoRA]:
        """``{module_name: LoRA layer}`` of one target (not ``"all"``)."""
        return self.composer.layers(target)

    def context(self, target: str) -> LoRAContext:
        """The :class:`LoRAContext` every LoRA layer of ``target`` reads its row mapping from
        (also ``lora_context_of(module)``)."""
        return self.composer.context(target)

    @property
    def loaded_nicknames(self) -> list[str]:
        return list(self.store)

    @property
    def max_loaded_bytes(self) -> int:
        return self.store.max_bytes

    def loaded_bytes(self) -> int:
        return self.store.loaded_bytes()

    def adapter(self, nickname: str) -> Adapter:
        """The loaded adapter ``nickname``.

        Raises:
            NotFoundError: not loaded (``param="lora_nickname"``).
        """
        return self.store.require(nickname)

    def _resolve_targets(self, target: Any) -> list[str]:
        check_target(target, self.target_names)
        return self.composer.target_names if target == ALL else [target]

    def _touch(self, names) -> None:
        for name in names:
            self.store.touch(name)

    # ------------------------------------------------------------------ reading files
    def read_source(self, path: str, trusted: bool = False):
        """Read one adapter as this manager's roots allow; see :meth:`Stager.read_source`."""
        return self.stager.read_source(path, trusted)

    def unchanged(self, nickname: str, path: str, trusted: bool = False) -> bool:
        """Whether ``nickname`` is loaded from ``path`` and its files were not rewritten since
        (a ``set_lora`` then reads nothing); see :meth:`Stager.unchanged`."""
        return self.stager.unchanged(self.store.get(nickname), path, trusted)

    # ------------------------------------------------------------------ per request
    def selection(
        self,
        composition: Sequence[tuple[str, float]] | Sequence[Mapping[str, Any]] | None,
        field: str = "lora",
    ) -> LoRASelection:
        """A request's adapters as one :class:`~sglang.multimodal_gen.layers.lora.Composition`
        per target; nothing changes on any layer.

        Args:
            composition: ``None``: the targets' current global compositions (exactly the values
                the layers hold, so merged layers serve it from their merged weights);
                otherwise ``[(nickname, strength), ...]`` or ``{"name", "scale"}`` /
                ``{"name", "strength"}`` mappings (:func:`~sglang.multimodal_gen.lora.requests.validate_composition`);
                ``[]`` is no LoRA. A target's composition lists only the adapters that have
                modules in it. The named adapters are touched in the LRU.
            field: the request field the composition came from (``lora``, or a family's own
                field of kind ``lora`` such as LTX-2's ``stage_2_lora``), named by the errors.

        Raises:
            NotFoundError: an unknown nickname (``param=field``).
            InvalidRequestError: a bad entry, a duplicate, more than
                :data:`~sglang.multimodal_gen.lora.requests.MAX_ADAPTERS_PER_CALL` entries, a
                strength that overflows where it is used (``param=field``).
            LoRAStateError: the LoRA state was lost earlier.
        """
        self.savepoints.check_usable()
        return select(self.store, self.composer, composition, field)

    def selection_is_current(self, selection: LoRASelection) -> bool:
        """Whether every slot ``selection`` names still holds the adapter it named (no adapter
        was unloaded, evicted or replaced since it was made)."""
        return selection.slot_epoch == self.store.slot_epoch

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
        return report.adapter_info(self.composer, self.store[nickname])

    def unload_adapter(self, nickname: str) -> dict[str, Any]:
        """Free adapter ``nickname``; if it is active anywhere it is deactivated there first.

        Raises:
            NotFoundError: unknown nickname (``param="lora_nickname"``).
        """
        if not isinstance(nickname, str) or not nickname.strip():
            raise InvalidRequestError(
                f"lora_nickname must be a non-empty string, got {nickname!r}", "lora_nickname"
            )
        adapter = self.store.require(nickname)
        with self.savepoints.txn():
            for t in self.composer.target_names:
                comp = self.composer.composition(t)
                if any(n == nickname for n, _ in comp):
                    new = [(n, s) for n, s in comp if n != nickname]
                    self.composer.apply(t, new, self.composer.mode(t))
            self.store.pop(nickname)
            self.savepoints.drop(adapter)
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
        args = normalize_set_lora(
            nicknames, paths, targets, strengths, merge_mode, valid_targets=self.target_names
        )
        return self.apply_set_lora(args, sources=sources, _activate=_activate)

    def apply_set_lora(
        self,
        args: SetLoRAArgs,
        *,
        sources: Mapping[str, Any] | None = None,
        _activate: bool = True,
    ) -> dict[str, Any]:
        """:meth:`set_lora` with arguments normalised once, where they entered (the engine or
        the HTTP layer: :func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`).

        Raises:
            As :meth:`set_lora`; a target that is not one of this model's (``param="target"``).
        """
        self.savepoints.check_usable()
        for target in args.targets:
            check_target(target, self.target_names)
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
            item = self.stager.stage(name, path, self.store.get(name), sources, done)
            if item is not None:
                adapter, converted = item
                adapter.nbytes = self.composer.install_bytes(converted)
                staged[name] = item
        for name in names:
            if name not in given:
                self.store.require(name)  # null path: must be loaded already

        def adapter_for(name: str) -> Adapter:
            return staged[name][0] if name in staged else self.store[name]

        for t, comp in new_comp.items():
            for name, _ in comp:
                if t not in adapter_for(name).modules:
                    raise InvalidRequestError(
                        f"adapter {name!r} matches no module of target {t!r}", param="target"
                    )
        self.composer.check_strengths(new_comp, adapter_for, "strength")
        if mode == "merge":
            for t, comp in new_comp.items():
                self.composer.check_mergeable(t, comp, adapter_for)
        current = {t: self.composer.composition(t) for t in self.composer.target_names}
        final = current | new_comp
        pins = {n for comp in final.values() for n, _ in comp} | set(staged)
        evict = self.store.plan_room([a for a, _ in staged.values()], set(staged), pins)
        # a reloaded adapter active elsewhere gets its new weights there too
        reloaded = [
            t
            for t, comp in current.items()
            if t not in new_comp and any(n in staged for n, _ in comp)
        ]
        with self.savepoints.txn():
            for adapter, converted in staged.values():
                self.composer.install(adapter, converted)
                self.savepoints.note_installed(adapter)
                old = self.store.put(adapter)
                if old is not None:
                    self.savepoints.drop(old)
            for t, comp in new_comp.items():
                self.composer.apply(t, comp, mode)
            for t in reloaded:
                comp = self.composer.composition(t)
                self.composer.apply(t, comp, self.composer.mode(t), param="lora_path")
            for name in evict:
                logger.info("LoRA %r unloaded (LRU, memory bound)", name)
                self.savepoints.drop(self.store.pop(name))
                self.store.evictions += 1
        self._touch([n for comp in new_comp.values() for n, _ in comp])
        self._touch(staged)
        what = ", ".join(f"{n}@{s:g}" for n, s in zip(names, strength_list))
        return {
            "status": "ok",
            "message": f"LoRA set: {what} (merge_mode={mode})",
            # every adapter loaded now (least recently used ones may have been unloaded)
            "loaded": list(self.store),
            "active": {
                t: report.composition_json(self.composer, t) for t in self.composer.target_names
            },
            "memory": self.memory_report(),
        }

    def _change(self, target: str, what: str, step: Callable[[str], None]) -> dict[str, Any]:
        """Run ``step(t)`` for every target named by ``target`` under one savepoint."""
        self.savepoints.check_usable()
        tnames = self._resolve_targets(target)
        with self.savepoints.txn():
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
            self.composer.apply(t, [], self.composer.mode(t))

        return self._change(target, "unset", step)

    def merge(self, target: str = ALL) -> dict[str, Any]:
        """Merge the active composition of ``target`` into the weights (mode becomes ``"merge"``).

        Raises:
            InvalidRequestError: unknown target; a layer with an active adapter cannot merge
                (e.g. its base weight is quantized; ``param="merge_mode"``, nothing changes).
        """
        for t in self._resolve_targets(target):
            self.composer.check_mergeable(
                t, self.composer.composition(t), what="merge_lora_weights"
            )

        def step(t):
            self.composer.apply(t, self.composer.composition(t), "merge")

        return self._change(target, "merged", step)

    def unmerge(self, target: str = ALL) -> dict[str, Any]:
        """Restore the base weights of ``target``; its adapters keep running unmerged (``"dynamic"``).

        Raises:
            InvalidRequestError: unknown target.
        """

        def step(t):
            self.composer.apply(t, self.composer.composition(t), "dynamic")

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
        self.savepoints.check_usable()
        tnames = self._resolve_targets(target)
        for t in tnames:
            self.composer.check_commit(t)
        for t in tnames:
            comp, mode = self.composer.composition(t), self.composer.mode(t)
            if not comp:
                continue
            with self.savepoints.txn():
                self.composer.apply(t, comp, "merge")
            # past this point the layers are merged; committing only drops snapshots
            self.composer.commit(t, mode)
        return {"status": "ok", "message": f"LoRA committed as base on {target!r}"}

    # ------------------------------------------------------------------ reports
    def list_loras(self) -> dict[str, Any]:
        """Plain-JSON state: loaded adapters (LRU order, oldest first), the active composition,
        mode and merged/dynamic layer counts per target, memory and merge-cache counters."""
        self.savepoints.check_usable()
        return report.list_loras(
            self.store, self.composer, self.target_names, self.default_merge_mode
        )

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by the LoRA runtime on this rank (:func:`report.memory_report`)."""
        return report.memory_report(self.store, self.composer)

    # ------------------------------------------------------------------ TP protocol
    def begin_change(self) -> None:
        """Open a savepoint before a change that must be all-or-nothing across TP ranks.

        Raises:
            RuntimeError: a savepoint is already open.
            LoRAStateError: the state was lost earlier.
        """
        self.savepoints.begin_change()

    def commit_change(self) -> None:
        """Keep the changes made since :meth:`begin_change`; free the adapters they dropped."""
        self.savepoints.commit_change()

    def rollback_change(self) -> None:
        """Undo every change made since :meth:`begin_change` (another rank failed): adapters
        (and their LRU order), slots, compositions, merge modes and layer states are those of
        the savepoint again, merged weights bit-identical.

        Raises:
            LoRAStateError: the restore failed (every layer reset to its base weights).
        """
        self.savepoints.rollback_change()

    def transaction_info(self) -> dict[str, Any]:
        """``{"open_savepoints": n, "broken": reason or None}`` (JSON-able)."""
        return self.savepoints.info()
