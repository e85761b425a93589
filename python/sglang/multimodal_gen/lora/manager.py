"""The LoRA manager: the one object the pipeline and the server talk to about adapters.

It owns, for one rank:

* the LoRA-able layers of each *target* (``"transformer"``, ``"transformer_2"`` for two-expert
  models): every :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear` in the target module
  is wrapped with :func:`~sglang.multimodal_gen.layers.lora.wrap_with_lora` at construction;
* the loaded adapters by nickname (an LRU bounded by bytes; adapters of an active composition are
  pinned), each converted once from its file to our module names and sliced onto the layers;
* the active composition ``[(nickname, strength), ...]`` and merge mode of each target;
* the merge cache (:class:`~sglang.multimodal_gen.lora.merge_cache.MergeCache`).

Merge modes: ``"dynamic"`` (unmerged: the layers add the fused LoRA path in their forward),
``"merge"`` (merged into the weights; every layer must be able to merge), ``"auto"`` (merge the
layers that can, dynamic for the others).

Finite is not safe: a strength or an adapter's ``alpha / r`` can be finite in Python and still
overflow where it is used. Before any layer changes, each active adapter's effective scale
``strength x alpha / r`` must be finite in float32 (the merge accumulates in it) and
``|strength x scale x B|`` must fit the weights' dtype (the unmerged path folds it into ``B``); a
merge whose result is not finite is undone. Each is an ``InvalidRequestError`` naming the field
(``strength`` for ``set_lora``, ``lora`` for a per-request composition).

Every public operation is atomic: it validates and stages everything it can before touching a
layer, and if anything fails after that, each touched layer is put back into its previous
composition and merge state (unmerge restores a snapshot and re-merging is deterministic, so the
weights are bit-identical to before). Errors are :mod:`sglang.multimodal_gen.errors` types naming the
request field (``lora_nickname``, ``lora_path``, ``target``, ``strength``, ``merge_mode``, ``lora``);
the argument rules are those of :mod:`sglang.multimodal_gen.lora.requests`, shared with the HTTP
layer and the engine.

For tensor parallelism a change can also be made atomic *across* ranks: :meth:`begin_change`
opens a savepoint, the change runs, and every rank then calls :meth:`commit_change` or (when any
rank failed) :meth:`rollback_change`, which puts this rank back exactly where the savepoint was.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.errors import (
    InvalidRequestError,
    LoRAFormatError,
    NotFoundError,
    SGLangError,
)
from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA, replace_submodule, wrap_with_lora
from sglang.multimodal_gen.layers.lora.weights import all_finite
from sglang.multimodal_gen.lora.formats import CanonicalLoRA, convert_to_canonical
from sglang.multimodal_gen.lora.loading import is_hub_id, load_lora_state_dict
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.peft_config import FP32_MAX
from sglang.multimodal_gen.lora.requests import (
    ALL_TARGETS,
    MERGE_MODES,
    check_target,
    normalize_set_lora,
    validate_composition,
)
from sglang.multimodal_gen.models.name_map import NameMap

logger = logging.getLogger(__name__)

__all__ = ["MERGE_MODES", "LoRAManager"]

ALL = ALL_TARGETS


@dataclass
class _Adapter:
    """A loaded adapter. ``uid`` is its name on the layers (unique per load, so a reload under the
    same nickname can be staged next to the old one and swapped atomically)."""

    nickname: str
    uid: str
    source: str
    identity: str
    summaries: dict[str, dict[str, Any]]  # target -> CanonicalLoRA.summary()
    modules: dict[str, list[str]]  # target -> our module names the adapter touches
    scales: dict[tuple[str, str], tuple]  # (target, module) -> ((shard_id, scale), ...)
    nbytes: int = 0
    last_used: int = 0
    peaks: dict[tuple[str, str], float] = field(default_factory=dict)  # max |scale x B| per module


@dataclass
class _TargetState:
    composition: list[tuple[str, float]] = field(default_factory=list)  # (nickname, strength)
    mode: str = "auto"
    base_version: int = 0
    committed: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Savepoint:
    """What :meth:`LoRAManager.rollback_change` needs to undo the changes made since it was taken."""

    adapters: list[tuple[str, _Adapter, int]]  # (nickname, adapter, last_used) in LRU order
    layers: dict  # LoRAManager._snapshot_state of every target
    dropped: list[_Adapter] = field(default_factory=list)  # uninstall deferred until commit


def _amax(t: torch.Tensor) -> float:
    """``max |t|`` as a Python float (0 for an empty tensor)."""
    return float(t.detach().abs().amax()) if t.numel() else 0.0


class LoRAManager:
    """Loads, activates, merges and switches LoRA adapters on one rank's model.

    Args:
        targets: ``{target_name: module}``, e.g. ``{"transformer": dit}`` (``"transformer_2"`` for
            the second expert of a two-expert model). ``"all"`` addresses every target.
        name_map: the model's :class:`NameMap` (file / diffusers / original names -> ours).
        allowed_roots: directories local LoRA paths must resolve into (realpath containment).
            ``None``: any local path (a user's own command line). An empty sequence: no local
            path at all (a server started without ``--lora-dir``); Hub ids present in the local
            Hugging Face cache are accepted in every case.
        max_loaded_bytes: bound on the bytes of loaded adapters on this rank; the least recently
            used adapters that are not active are unloaded to make room.
        merge_cache_bytes: bound of the merge cache (0 disables it).
        default_merge_mode: ``"auto"``, ``"merge"`` or ``"dynamic"``, used when a call gives none.
        merge_cache_device: where merged weights are cached (default: the weights' device).
        model_name: used in messages.
        snapshot_device: where merged layers keep their pre-merge weights (default: the weights'
            device; ``"cpu"`` keeps accelerator memory at one model copy, e.g. with DiT offload,
            at the price of a host-to-device copy per unmerge).

    Raises:
        ValueError: no targets, a target named ``"all"``, a bad merge mode, or a target without
            any linear layer.
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
        self.max_loaded_bytes = int(max_loaded_bytes)
        self.default_merge_mode = default_merge_mode
        self.cache = MergeCache(merge_cache_bytes, merge_cache_device)
        self._targets: dict[str, nn.Module] = dict(targets)
        self._layers: dict[str, dict[str, BaseLayerWithLoRA]] = {}
        self._specs: dict[str, LoRAModelSpec] = {}
        self._state: dict[str, _TargetState] = {}
        for tname, module in self._targets.items():
            self._layers[tname] = self._wrap_layers(tname, module)
            if snapshot_device is not None:
                for layer in self._layers[tname].values():
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
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()  # LRU order, oldest first
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self._request_composition: list[tuple[str, float]] | None = None
        self._savepoint: _Savepoint | None = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _wrap_layers(tname: str, module: nn.Module) -> dict[str, BaseLayerWithLoRA]:
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
        return list(self._adapters)

    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self._adapters.values())

    # ------------------------------------------------------------------ validation
    def _resolve_targets(self, target: Any) -> list[str]:
        check_target(target, self.target_names)
        return list(self._targets) if target == ALL else [target]

    @staticmethod
    def _check_nickname(value: Any, param: str = "lora_nickname") -> str:
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequestError(f"{param} must be a non-empty string, got {value!r}", param)
        return value

    def _get(self, nickname: str, param: str = "lora_nickname") -> _Adapter:
        adapter = self._adapters.get(nickname)
        if adapter is None:
            raise NotFoundError(
                f"LoRA adapter {nickname!r} is not loaded (loaded: {list(self._adapters)}); "
                "pass lora_path to load it",
                param=param,
            )
        return adapter

    # ------------------------------------------------------------------ loading (staging)
    def read_source(
        self, path: str, trusted: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Read one adapter (file, folder or cached Hub id) as this manager's roots allow.

        No layer is touched. TP rank 0 uses it to read a file once and send the result to every
        rank (``set_lora(..., sources=...)``), so all ranks apply the same tensors.

        Args:
            trusted: the path comes from the operator's command line (``--lora-path`` when a
                server starts): read it wherever it is (a relative path is looked up in the
                roots first, then in the working directory).

        Returns:
            ``(state_dict, metadata)`` of :func:`~sglang.multimodal_gen.lora.loading.load_lora_state_dict`.

        Raises:
            InvalidRequestError / LoRAFormatError (``param="lora_path"``): a refused or unreadable
                path. A local path refused by the roots gets the same message whether or not it
                exists.
        """
        if not isinstance(path, str) or not path:
            raise InvalidRequestError(
                f"lora_path must be a non-empty string, got {path!r}", "lora_path"
            )
        if trusted and self.allowed_roots:
            # the operator's own path: relative to the roots when it is there, else anywhere
            try:
                return load_lora_state_dict(path, self.allowed_roots)
            except LoRAFormatError:
                raise
            except InvalidRequestError:
                pass
        roots = None if trusted else self.allowed_roots
        no_local = roots is not None and not roots
        if no_local and not is_hub_id(path):
            raise InvalidRequestError(
                f"LoRA path {path!r} refused: this server accepts local LoRA paths only inside "
                "the directories it was started with (--lora-dir DIR), and it has none. Start it "
                "with --lora-dir, or load the adapter at startup with --lora-path; Hugging Face "
                "Hub ids present in the local cache are accepted.",
                param="lora_path",
            )
        try:
            return load_lora_state_dict(path, roots)
        except SGLangError as e:
            if e.param is None:
                e.param = "lora_path"
            if (
                no_local
                and isinstance(e, InvalidRequestError)
                and not isinstance(e, LoRAFormatError)
            ):
                raise type(e)(
                    f"{e.message} (local LoRA paths need the server to be started with --lora-dir)",
                    param=e.param,
                    code=e.code,
                ) from None
            raise

    def _read(
        self, nickname: str, path: str, sources: Mapping[str, tuple] | None = None
    ) -> tuple[dict[str, CanonicalLoRA], dict[str, Any]]:
        """Convert a file (read now, or taken from ``sources``) for every target it matches.
        No layer is touched."""
        if sources is not None and path in sources:
            state_dict, metadata = sources[path]
        else:
            state_dict, metadata = self.read_source(path)
        converted: dict[str, CanonicalLoRA] = {}
        errors = []
        for tname, spec in self._specs.items():
            # keys carry the component prefix ("transformer_2.") or, as diffusers writes files
            # for a second expert, the first one's ("transformer.")
            for component in dict.fromkeys((tname, "transformer")):
                try:
                    converted[tname] = convert_to_canonical(
                        state_dict, metadata, spec, component=component
                    )
                    break
                except InvalidRequestError as e:
                    errors.append(e)
        if not converted:
            err = errors[0]
            if err.param is None:
                err.param = "lora_path"
            raise err
        return converted, metadata

    def _stage(
        self, nickname: str, path: str, sources: Mapping[str, tuple] | None = None
    ) -> tuple[_Adapter, dict[str, CanonicalLoRA]]:
        converted, metadata = self._read(nickname, path, sources)
        uid = f"{nickname}#{next(self._uids)}"
        scales = {
            (t, m): tuple(sorted(((sid, float(w.scale)) for sid, w in shards.items()), key=repr))
            for t, c in converted.items()
            for m, shards in c.modules.items()
        }
        for (_t, m), shard_scales in scales.items():
            for _, scale in shard_scales:
                if not abs(scale) <= FP32_MAX:
                    raise LoRAFormatError(
                        f"LoRA {nickname!r}: module {m!r} has scale alpha/r = {scale:g}, which "
                        "is not finite in float32",
                        param="lora_path",
                    )
        peaks = {
            (t, m): max(
                (abs(float(w.scale)) * _amax(w.lora_B) for w in shards.values()), default=0.0
            )
            for t, c in converted.items()
            for m, shards in c.modules.items()
        }
        adapter = _Adapter(
            nickname=nickname,
            uid=uid,
            source=path,
            identity=str(metadata.get("identity") or metadata.get("path") or path),
            summaries={t: c.summary() for t, c in converted.items()},
            modules={t: sorted(c.modules) for t, c in converted.items()},
            scales=scales,
            peaks=peaks,
        )
        return adapter, converted

    def _check_strengths(
        self,
        compositions: Mapping[str, list[tuple[str, float]]],
        adapter_for: Any,
        param: str,
    ) -> None:
        """Refuse a composition whose numbers overflow where they are used (see the module
        docstring): ``strength x alpha / r`` beyond float32, or ``|strength x scale x B|`` beyond
        the layer weights' dtype. Nothing is touched.

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

    def _install(self, adapter: _Adapter, converted: dict[str, CanonicalLoRA]) -> None:
        """Add the staged adapter's slices to the layers (under its uid). Raises after undoing."""
        done: list[BaseLayerWithLoRA] = []
        try:
            for tname, canon in converted.items():
                layers = self._layers[tname]
                for module, shards in canon.modules.items():
                    layer = layers[module]
                    layer.add_adapter(adapter.uid, shards)
                    done.append(layer)
        except ValueError as e:
            for layer in done:
                layer.remove_adapter(adapter.uid)
            raise InvalidRequestError(f"LoRA {adapter.nickname!r}: {e}", param="lora_path") from e
        except BaseException:
            for layer in done:
                layer.remove_adapter(adapter.uid)
            raise
        adapter.nbytes = sum(layer.adapter_nbytes(adapter.uid) for layer in done)

    def _uninstall(self, adapter: _Adapter) -> None:
        for tname, modules in adapter.modules.items():
            for module in modules:
                self._layers[tname][module].remove_adapter(adapter.uid)

    def _drop(self, adapter: _Adapter) -> None:
        """Uninstall an adapter that left ``_adapters`` (at once, or at commit in a savepoint)."""
        if self._savepoint is not None:
            self._savepoint.dropped.append(adapter)
        else:
            self._uninstall(adapter)

    def _touch(self, adapter: _Adapter) -> None:
        adapter.last_used = next(self._clock)
        self._adapters.move_to_end(adapter.nickname)

    def _pinned(self, compositions: Mapping[str, list[tuple[str, float]]]) -> set[str]:
        pinned = {n for comp in compositions.values() for n, _ in comp}
        if self._request_composition:
            pinned |= {n for n, _ in self._request_composition}
        return pinned

    def _check_room(self, new: list[_Adapter], replaced: set[str], pinned: set[str]) -> list[str]:
        """Nicknames to evict so the loaded bytes fit after adding ``new``.

        Raises:
            InvalidRequestError: even after evicting every unpinned adapter it would not fit.
        """
        keep = {n: a for n, a in self._adapters.items() if n not in replaced}
        total = sum(a.nbytes for a in keep.values()) + sum(a.nbytes for a in new)
        evict = []
        for n, a in keep.items():  # oldest first
            if total <= self.max_loaded_bytes:
                break
            if n in pinned:
                continue
            evict.append(n)
            total -= a.nbytes
        if total > self.max_loaded_bytes:
            raise InvalidRequestError(
                f"loading would need {total} bytes of LoRA weights, over the bound of "
                f"{self.max_loaded_bytes} bytes, with every other adapter in use",
                param="lora_path",
            )
        return evict

    # ------------------------------------------------------------------ applying compositions
    def _layer_comp(self, tname: str, module: str, comp: list[tuple[str, float]]):
        """Composition by layer uid for one layer, and its merge-cache key."""
        by_uid, keys = [], []
        for nickname, strength in comp:
            adapter = self._adapters[nickname]
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
        comp: list[tuple[str, float]],
        mode: str,
        use_cache: bool = True,
        param: str = "strength",
    ) -> None:
        """Put every layer of ``tname`` into ``comp`` under ``mode`` (no rollback here).

        ``mode="request"`` (per-request compositions): layers whose composition does not change
        keep their merge state, the others run unmerged. A layer already in the wanted
        composition and merge state is not touched.

        Raises:
            InvalidRequestError: ``param``; a merged weight came out NaN/Inf (the caller's
                transaction puts the layers back).
        """
        for module, layer in self._layers[tname].items():
            by_uid, key = self._layer_comp(tname, module, comp)
            same = layer.active_composition == by_uid
            if mode == "request":
                want_merged = layer.merged and same
            else:
                want_merged = bool(by_uid) and (
                    mode == "merge" or (mode == "auto" and layer.can_merge)
                )
            if same and layer.merged == want_merged:
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

    def _snapshot_state(self, tnames: list[str]):
        return {
            t: (
                list(self._state[t].composition),
                self._state[t].mode,
                {
                    m: (layer.active_composition, layer.merged)
                    for m, layer in self._layers[t].items()
                },
            )
            for t in tnames
        }

    def _restore(self, saved) -> None:
        """Put layers and target states back as recorded by :meth:`_snapshot_state`."""
        for t, (comp, mode, layer_states) in saved.items():
            self._state[t].composition = comp
            self._state[t].mode = mode
            for m, (layer_comp, was_merged) in layer_states.items():
                layer = self._layers[t][m]
                if layer.active_composition == layer_comp and layer.merged == was_merged:
                    continue
                layer.unmerge()
                layer.set_active(layer_comp)
                if was_merged:
                    layer.merge()

    def _transaction(self, tnames: list[str]):
        """Context manager: on an exception inside, restore the targets' layers and state."""
        saved = self._snapshot_state(tnames)

        @contextlib.contextmanager
        def guard():
            try:
                yield
            except BaseException:
                try:
                    self._restore(saved)
                except Exception:  # pragma: no cover - restore must not hide the cause
                    logger.exception("LoRA state restore failed")
                raise

        return guard()

    def _check_mergeable(self, tname: str, comp: list[tuple[str, float]], mode: str) -> None:
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

    # ------------------------------------------------------------------ cross-rank atomicity
    def begin_change(self) -> None:
        """Open a savepoint before a change that must be all-or-nothing across TP ranks.

        Until :meth:`commit_change` or :meth:`rollback_change`, adapters that are replaced,
        evicted or unloaded stay installed on the layers (not in use), so the previous state can
        be restored exactly.

        Raises:
            RuntimeError: a savepoint is already open.
        """
        if self._savepoint is not None:
            raise RuntimeError("a LoRA change savepoint is already open")
        self._savepoint = _Savepoint(
            adapters=[(n, a, a.last_used) for n, a in self._adapters.items()],
            layers=self._snapshot_state(list(self._targets)),
        )

    def commit_change(self) -> None:
        """Keep the changes made since :meth:`begin_change`; free the adapters they dropped."""
        sp, self._savepoint = self._savepoint, None
        if sp is None:
            raise RuntimeError("no LoRA change savepoint is open")
        for adapter in sp.dropped:
            self._uninstall(adapter)

    def rollback_change(self) -> None:
        """Undo every change made since :meth:`begin_change` (another rank failed).

        Loaded adapters (and their LRU order), compositions, merge modes and layer merge states
        are those of the savepoint again; merged weights are restored from the pre-merge snapshot
        and re-merged, so they are bit-identical to before. Adapters loaded since are freed.
        """
        sp, self._savepoint = self._savepoint, None
        if sp is None:
            raise RuntimeError("no LoRA change savepoint is open")
        keep = {a.uid for _, a, _ in sp.adapters}
        since = {a.uid: a for a in [*self._adapters.values(), *sp.dropped] if a.uid not in keep}
        self._adapters = OrderedDict((n, a) for n, a, _ in sp.adapters)
        for _, a, last_used in sp.adapters:
            a.last_used = last_used
        self._restore(sp.layers)  # layers now use only adapters of the savepoint
        for adapter in since.values():
            self._uninstall(adapter)

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
        return self._adapter_info(self._adapters[nickname])

    def unload_adapter(self, nickname: str) -> dict[str, Any]:
        """Free adapter ``nickname``; if it is active anywhere it is deactivated there first.

        Raises:
            NotFoundError: unknown nickname (``param="lora_nickname"``).
        """
        self._check_nickname(nickname)
        adapter = self._get(nickname)
        touched = [
            t for t, s in self._state.items() if any(n == nickname for n, _ in s.composition)
        ]
        with self._transaction(touched):
            for t in touched:
                st = self._state[t]
                new = [(n, s) for n, s in st.composition if n != nickname]
                self._apply(t, new, st.mode)
                st.composition = new
        del self._adapters[nickname]
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
        sources: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] | None = None,
        _activate: bool = True,
    ) -> dict[str, Any]:
        """Load what is needed and make the given adapters the active composition of their targets.

        Args:
            nicknames: one nickname or a list (each at most once per target).
            paths: per nickname a path/repo id to load, or ``None`` to use the loaded adapter. A
                scalar or a one-element list is broadcast over ``nicknames``; otherwise the
                lengths must match. A loaded nickname given a different file is reloaded.
            targets: ``"all"``, ``"transformer"``, ... (broadcast like ``paths``).
            strengths: multipliers of each adapter's ``alpha / r`` (broadcast like ``paths``).
            merge_mode: ``"auto"``/``"merge"``/``"dynamic"`` (default: the manager's default).
            sources: ``{path: (state_dict, metadata)}`` already read with :meth:`read_source`
                (TP: by rank 0, for every rank); paths not in it are read here.

        The arguments follow :func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`.
        Every target named (through ``"all"`` or by name) gets exactly the listed adapters for it,
        in order; targets not named keep their composition.

        Returns:
            ``{"status": "ok", "message": ..., "active": {target: [...]}}`` (JSON-able).

        Raises:
            InvalidRequestError: bad field (``param`` names it: ``lora_nickname``, ``lora_path``,
                ``target``, ``strength``, ``merge_mode``), list length mismatch, a duplicate
                nickname on one target, a bad file (:class:`LoRAFormatError`), an adapter that
                matches nothing in its target, merge impossible in ``"merge"`` mode, memory bound.
            NotFoundError: a nickname without path that is not loaded.
            On any error nothing changes (weights bit-identical, same adapters loaded).
        """
        args = normalize_set_lora(
            nicknames, paths, targets, strengths, merge_mode, valid_targets=self.target_names
        )
        names, strength_list = args.nicknames, args.strengths
        mode = args.merge_mode or self.default_merge_mode

        # new compositions of the targets named (normalize_set_lora refused duplicates)
        new_comp: dict[str, list[tuple[str, float]]] = {}
        for name, target, strength in zip(names, args.targets, strength_list):
            for t in self._resolve_targets(target):
                new_comp.setdefault(t, []).append((name, strength))

        # stage files (read + convert) before touching anything
        staged: dict[str, tuple[_Adapter, dict[str, CanonicalLoRA]]] = {}
        given = {name: path for name, path in zip(names, args.paths) if path is not None}
        for name, path in given.items():
            old = self._adapters.get(name)
            adapter, converted = self._stage(name, path, sources)
            if old is not None and old.identity == adapter.identity:
                continue  # same unchanged file: reuse
            staged[name] = (adapter, converted)
        for name in names:
            if name not in given:
                self._get(name)  # null path: must be loaded already

        # every adapter must touch every target it is set on
        def adapter_for(name: str) -> _Adapter:
            return staged[name][0] if name in staged else self._adapters[name]

        if _activate:
            for t, comp in new_comp.items():
                for name, _ in comp:
                    if t not in adapter_for(name).modules:
                        raise InvalidRequestError(
                            f"adapter {name!r} matches no module of target {t!r}", param="target"
                        )

        if _activate:
            self._check_strengths(new_comp, adapter_for, "strength")

        # memory: pinned = everything active after this call
        final_comp = {t: list(s.composition) for t, s in self._state.items()}
        if _activate:
            final_comp.update(new_comp)
        for adapter, converted in staged.values():  # size of the new slices (estimate)
            adapter.nbytes = sum(c.nbytes() for c in converted.values())
        pinned = self._pinned(final_comp) | set(staged)
        evict = self._check_room([a for a, _ in staged.values()], set(staged), pinned)

        # install new adapters under fresh uids (old ones stay until the swap succeeds)
        installed: list[_Adapter] = []
        previous: dict[str, _Adapter | None] = {}
        touched = list(new_comp) if _activate else []
        reloaded_active = [
            t
            for t, s in self._state.items()
            if any(n in staged for n, _ in s.composition) and t not in touched
        ]
        try:
            for adapter, converted in staged.values():
                self._install(adapter, converted)
                installed.append(adapter)
            with self._transaction(touched + reloaded_active):
                for name, (adapter, _) in staged.items():
                    previous[name] = self._adapters.get(name)
                    self._adapters[name] = adapter
                for t in touched:
                    if mode == "merge":
                        self._check_mergeable(t, new_comp[t], mode)
                    self._apply(t, new_comp[t], mode)
                    self._state[t].composition = new_comp[t]
                    self._state[t].mode = mode
                for t in reloaded_active:  # a reloaded adapter active elsewhere: new weights
                    st = self._state[t]
                    self._apply(t, st.composition, st.mode, param="lora_path")
        except BaseException:
            for name, old in previous.items():
                if old is None:
                    self._adapters.pop(name, None)
                else:
                    self._adapters[name] = old
            for adapter in installed:
                self._uninstall(adapter)
            raise
        # committed: drop replaced versions and evict
        for old in previous.values():
            if old is not None:
                self._drop(old)
        for name in evict:
            adapter = self._adapters.pop(name, None)
            if adapter is not None:
                logger.info("LoRA %r unloaded (LRU, memory bound)", name)
                self._drop(adapter)
        for t in new_comp if _activate else ():
            for name, _ in new_comp[t]:
                self._touch(self._adapters[name])
        for name in staged:
            self._touch(self._adapters[name])
        active = {t: self._composition_json(t) for t in self._state}
        what = ", ".join(f"{n}@{s:g}" for n, s in zip(names, strength_list))
        return {
            "status": "ok",
            "message": f"LoRA set: {what} (merge_mode={mode})",
            "active": active,
        }

    def unset_lora(self, target: str = ALL) -> dict[str, Any]:
        """Deactivate the adapters of ``target`` (they stay loaded); weights return to the base.

        Raises:
            InvalidRequestError: unknown target (``param="target"``).
        """
        tnames = self._resolve_targets(target)
        with self._transaction(tnames):
            for t in tnames:
                self._apply(t, [], self._state[t].mode)
                self._state[t].composition = []
        return {"status": "ok", "message": f"LoRA unset on {target!r}"}

    def merge(self, target: str = ALL) -> dict[str, Any]:
        """Merge the active composition of ``target`` into the weights (mode becomes ``"merge"``).

        Raises:
            InvalidRequestError: unknown target; a layer with an active adapter cannot merge.
        """
        tnames = self._resolve_targets(target)
        for t in tnames:
            self._check_mergeable(t, self._state[t].composition, "merge")
        with self._transaction(tnames):
            for t in tnames:
                self._apply(t, self._state[t].composition, "merge")
                self._state[t].mode = "merge"
        return {"status": "ok", "message": f"LoRA merged on {target!r}"}

    def unmerge(self, target: str = ALL) -> dict[str, Any]:
        """Restore the base weights of ``target``; its adapters keep running unmerged (``"dynamic"``).

        Raises:
            InvalidRequestError: unknown target.
        """
        tnames = self._resolve_targets(target)
        with self._transaction(tnames):
            for t in tnames:
                self._apply(t, self._state[t].composition, "dynamic")
                self._state[t].mode = "dynamic"
        return {"status": "ok", "message": f"LoRA unmerged on {target!r}"}

    def commit_as_base(self, target: str = ALL) -> dict[str, Any]:
        """Bake the active composition of ``target`` into its base weights.

        The composition is cleared (its delta is now part of the base, which ``unset_lora`` and
        ``unmerge`` restore from then on); cached merges of the target are dropped.

        Raises:
            InvalidRequestError: unknown target; a layer with an active adapter cannot merge; an
                active adapter carries an output offset for a layer without a bias to fold it
                into. All checks run before any weight changes, so a refusal changes nothing.
        """
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
            with self._transaction([t]):
                self._apply(t, st.composition, "merge")
            # past this point the layers are merged; committing only drops snapshots
            for layer in self._layers[t].values():
                layer.commit_as_base()
            st.committed.extend({"nickname": n, "strength": s} for n, s in st.composition)
            st.composition = []
            st.base_version += 1
            prefix = f"{t}:"
            self.cache.invalidate(lambda k, p=prefix: k.module.startswith(p))
        return {"status": "ok", "message": f"LoRA committed as base on {target!r}"}

    @contextlib.contextmanager
    def use_composition(
        self, composition: Sequence[tuple[str, float]] | Sequence[Mapping[str, Any]] | None
    ) -> Iterator[None]:
        """Run the block with ``composition`` ``[(nickname, strength), ...]`` active on every
        target, then restore the previous state (weights bit-identical).

        ``None`` leaves the current state. Layers whose composition is unchanged (all of them when
        it equals the active one) keep their state and cost nothing; the others run the request's
        composition unmerged for the block (merged ones are unmerged for it and re-merged after,
        from the merge cache when possible). Entries may also be
        ``{"name": ..., "scale": ...}`` mappings.

        Raises:
            NotFoundError: an unknown nickname (``param="lora"``).
            InvalidRequestError: a bad strength or a duplicate (``param="lora"``).
        """
        if composition is None:
            yield
            return
        comp = validate_composition(composition, "lora")
        for name, _ in comp:
            self._get(name, param="lora")
        self._check_strengths(
            {t: [(n, s) for n, s in comp if t in self._adapters[n].modules] for t in self._targets},
            self._adapters.__getitem__,
            "lora",
        )
        tnames = [
            t
            for t in self._targets
            if [(n, s) for n, s in comp if t in self._adapters[n].modules]
            != self._state[t].composition
        ]
        if not tnames:
            yield
            return
        saved = self._snapshot_state(tnames)
        self._request_composition = comp
        try:
            with self._transaction(tnames):
                for t in tnames:
                    tcomp = [(n, s) for n, s in comp if t in self._adapters[n].modules]
                    self._apply(t, tcomp, "request", param="lora")
            yield
        finally:
            self._request_composition = None
            for t in tnames:
                st = self._state[t]
                comp_t, mode_t, _ = saved[t]
                self._apply(t, comp_t, mode_t)
                st.composition, st.mode = comp_t, mode_t
            for name, _ in comp:
                if name in self._adapters:
                    self._touch(self._adapters[name])

    # ------------------------------------------------------------------ reporting
    def _composition_json(self, t: str) -> dict[str, Any]:
        st = self._state[t]
        layers = self._layers[t].values()
        return {
            "adapters": [{"nickname": n, "strength": s} for n, s in st.composition],
            "merge_mode": st.mode,
            "merged_layers": sum(1 for layer in layers if layer.merged),
            "dynamic_layers": sum(1 for layer in layers if layer.active and not layer.merged),
            "committed": list(st.committed),
        }

    def _adapter_info(self, a: _Adapter) -> dict[str, Any]:
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

    def list_loras(self) -> dict[str, Any]:
        """Plain-JSON state: loaded adapters (LRU order, oldest first), the active composition,
        mode and merged/dynamic layer counts per target, memory and merge-cache counters."""
        return {
            "available": True,
            "targets": list(self.target_names),
            "default_merge_mode": self.default_merge_mode,
            "loaded": [self._adapter_info(a) for a in self._adapters.values()],
            "active": {t: self._composition_json(t) for t in self._state},
            "memory": {
                "loaded_bytes": self.loaded_bytes(),
                "max_loaded_bytes": self.max_loaded_bytes,
            },
            "merge_cache": self.cache.stats(),
        }
