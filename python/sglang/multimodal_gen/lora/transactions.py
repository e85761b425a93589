"""The one savepoint/restore mechanism of the LoRA manager.

Every state change runs between a savepoint and its commit or rollback:

* a single operation (``set_lora``, ``unset_lora``, ``merge``, ``unmerge``, ``unload_adapter``,
  ``commit_as_base``) is wrapped in :meth:`TransactionMixin._txn`: an exception inside rolls back;
* a per-request composition (``use_composition``) opens a savepoint, applies the request's
  composition, runs the generation, and *always* rolls back to it;
* at tensor parallelism > 1 the runner opens a savepoint on every rank (:meth:`begin_change`),
  runs the command, and every rank commits or, when any rank failed, rolls back
  (:meth:`rollback_change`), so the ranks stay identical.

Savepoints nest (a stack): an operation's own savepoint inside the TP one. What a savepoint holds
(:class:`Savepoint`): the loaded adapters in LRU order, each target's composition and merge mode,
and each layer's ``(composition, merged, overlay)``; adapters dropped since are uninstalled only
when the outermost savepoint commits, adapters installed since are uninstalled on rollback.
Restoring a layer costs what changed: clearing a request overlay is free, an unmerged layer
recompiles its composition, a merged one puts its snapshot back and re-merges (deterministic, so
the weights are bit-identical).

A rollback that itself fails (out of memory, a device error) leaves the rank in an unknown state.
Then every layer is put in a known one (overlay cleared, unmerged to its snapshot, no adapter
active; the base weights), the manager refuses every later call, and :class:`LoRAStateError`
(an ``EngineDeadError``, HTTP 503) is raised so the engine stops serving instead of serving mixed
weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.lora.adapters import Adapter

logger = logging.getLogger(__name__)

__all__ = ["LoRAStateError", "Savepoint", "TransactionMixin"]


class LoRAStateError(EngineDeadError):
    """A LoRA rollback failed: this rank's weights may not match any composition (HTTP 503)."""


@dataclass
class Savepoint:
    """What a rollback needs to undo the changes made since the savepoint was taken."""

    adapters: list[tuple[str, Adapter, int]]  # (nickname, adapter, last_used) in LRU order
    targets: dict[str, tuple[list, str]]  # target -> (composition, mode)
    layers: dict[str, dict[str, tuple]]  # target -> module -> (composition, merged, overlay)
    dropped: list[Adapter] = field(default_factory=list)  # uninstall at the outermost commit
    installed: list[Adapter] = field(default_factory=list)  # uninstall on rollback


class TransactionMixin:
    """Savepoints of :class:`~sglang.multimodal_gen.lora.manager.LoRAManager` (state it owns:
    ``_registry``, ``_state``, ``_layers``; ``_uninstall`` comes from the composition mixin)."""

    _savepoints: list[Savepoint]
    broken: str | None

    # ------------------------------------------------------------------ savepoints
    def _layer_states(self) -> dict[str, dict[str, tuple]]:
        return {
            t: {
                m: (layer.active_composition, layer.merged, layer.overlay)
                for m, layer in layers.items()
            }
            for t, layers in self._layers.items()
        }

    def _begin(self) -> Savepoint:
        self._check_usable()
        sp = Savepoint(
            adapters=self._registry.state(),
            targets={t: (list(s.composition), s.mode) for t, s in self._state.items()},
            layers=self._layer_states(),
        )
        self._savepoints.append(sp)
        return sp

    def _commit(self) -> None:
        sp = self._savepoints.pop()
        if self._savepoints:  # nested: the outer savepoint may still undo all of it
            self._savepoints[-1].dropped.extend(sp.dropped)
            self._savepoints[-1].installed.extend(sp.installed)
            return
        for adapter in sp.dropped:
            self._uninstall(adapter)

    def _rollback(self) -> None:
        """Return to the innermost savepoint (and close it).

        Raises:
            LoRAStateError: the restore failed; the layers were reset to the base weights.
        """
        sp = self._savepoints.pop()
        try:
            keep = {a.uid for _, a, _ in sp.adapters}
            current = [*self._registry.values(), *sp.dropped, *sp.installed]
            since = {a.uid: a for a in current if a.uid not in keep}
            self._registry.restore(sp.adapters)
            for t, (comp, mode) in sp.targets.items():
                self._state[t].composition, self._state[t].mode = list(comp), mode
            self._restore_layers(sp.layers)  # layers now use only adapters of the savepoint
            for adapter in since.values():
                self._uninstall(adapter)
        except BaseException as e:
            self._quarantine(f"restoring the LoRA state failed ({type(e).__name__}: {e})")
            raise LoRAStateError(
                f"restoring the LoRA state failed ({type(e).__name__}: {e}); every layer was "
                "reset to its base weights and the engine stops serving (restart it)"
            ) from e

    def _restore_layers(self, saved: dict[str, dict[str, tuple]]) -> None:
        for t, states in saved.items():
            for m, (comp, merged, overlay) in states.items():
                layer = self._layers[t][m]
                if (layer.active_composition, layer.merged) != (comp, merged):
                    layer.unmerge()
                    layer.set_active(comp)
                    if merged:
                        layer.merge()
                if layer.overlay != overlay:
                    if overlay is None:
                        layer.clear_overlay()
                    else:
                        layer.set_overlay(overlay)

    def _quarantine(self, reason: str) -> None:
        """Put every layer in a known state (base weights, nothing active) after a failed
        restore; later calls raise :class:`LoRAStateError`."""
        self.broken = reason
        self._savepoints.clear()
        logger.error("LoRA state lost: %s", reason)
        for layers in self._layers.values():
            for layer in layers.values():
                for step in (layer.unmerge, lambda layer=layer: layer.set_active([])):
                    try:  # unmerge puts the snapshot back and ends any overlay
                        step()
                    except BaseException:  # pragma: no cover - best effort, already failing
                        logger.exception("resetting LoRA layer %s failed", layer.prefix)
        for st in self._state.values():
            st.composition = []

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise LoRAStateError(f"the LoRA state was lost earlier: {self.broken}")

    @contextlib.contextmanager
    def _txn(self) -> Iterator[Savepoint]:
        """Run the block under a savepoint: commit when it returns, roll back when it raises."""
        sp = self._begin()
        try:
            yield sp
        except BaseException:
            self._rollback()
            raise
        self._commit()

    def _drop(self, adapter: Adapter) -> None:
        """An adapter left the registry: uninstall it when the outermost savepoint commits."""
        if self._savepoints:
            self._savepoints[-1].dropped.append(adapter)
        else:
            self._uninstall(adapter)

    def _note_installed(self, adapter: Adapter) -> None:
        if self._savepoints:
            self._savepoints[-1].installed.append(adapter)

    # ------------------------------------------------------------------ cross-rank protocol
    def begin_change(self) -> None:
        """Open a savepoint before a change that must be all-or-nothing across TP ranks.

        Raises:
            RuntimeError: a savepoint is already open.
            LoRAStateError: the state was lost earlier.
        """
        if self._savepoints:
            raise RuntimeError("a LoRA change savepoint is already open")
        self._begin()

    def commit_change(self) -> None:
        """Keep the changes made since :meth:`begin_change`; free the adapters they dropped."""
        if not self._savepoints:
            raise RuntimeError("no LoRA change savepoint is open")
        self._commit()

    def rollback_change(self) -> None:
        """Undo every change made since :meth:`begin_change` (another rank failed): adapters
        (and their LRU order), compositions, merge modes and layer states are those of the
        savepoint again, merged weights bit-identical.

        Raises:
            LoRAStateError: the restore failed (see the module docstring).
        """
        if not self._savepoints:
            raise RuntimeError("no LoRA change savepoint is open")
        self._rollback()

    def transaction_info(self) -> dict[str, Any]:
        """``{"open_savepoints": n, "broken": reason or None}`` (JSON-able)."""
        return {"open_savepoints": len(self._savepoints), "broken": self.broken}
