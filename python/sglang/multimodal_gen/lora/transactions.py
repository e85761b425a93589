"""The one savepoint/restore mechanism of the LoRA manager.

Every state change runs between a savepoint and its commit or rollback:

* a single operation (``set_lora``, ``unset_lora``, ``merge``, ``unmerge``, ``unload_adapter``,
  ``commit_as_base``) runs in :meth:`Savepoints.txn`: an exception inside rolls back;
* at tensor parallelism > 1 the runner opens a savepoint on every rank (:meth:`begin_change`),
  runs the command, and every rank commits or, when any rank failed, rolls back
  (:meth:`rollback_change`), so the ranks stay identical.

Savepoints nest (a stack): an operation's own savepoint inside the TP one. What a savepoint holds
(:class:`Savepoint`): the store's state (loaded adapters in LRU order, the slot table), each
target's state (composition, mode, ...) and each layer's ``(active composition, merged)``;
adapters dropped since are uninstalled only when the outermost savepoint commits, adapters
installed since are uninstalled on rollback. Restoring a layer costs what changed: an unmerged
layer just takes its composition back, a merged one puts its snapshot back and re-merges
(deterministic, so the weights are bit-identical).

A rollback that itself fails (out of memory, a device error) leaves the rank in an unknown state.
Then every layer is put in a known one (unmerged to its snapshot, no adapter active; the base
weights), the manager refuses every later call, and :class:`LoRAStateError` (an
``EngineDeadError``, HTTP 503) is raised so the engine stops serving instead of serving mixed
weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.lora.adapters import Adapter, AdapterStore, StoreState
from sglang.multimodal_gen.lora.compose import Composer, TargetState

logger = logging.getLogger(__name__)

__all__ = ["LoRAStateError", "Savepoint", "Savepoints"]


class LoRAStateError(EngineDeadError):
    """A LoRA rollback failed: this rank's weights may not match any composition (HTTP 503)."""


@dataclass
class Savepoint:
    """What a rollback needs to undo the changes made since the savepoint was taken."""

    store: StoreState
    targets: dict[str, TargetState]
    layers: dict[str, dict[str, tuple]]  # target -> module -> (composition, merged)
    dropped: list[Adapter] = field(default_factory=list)  # uninstall at the outermost commit
    installed: list[Adapter] = field(default_factory=list)  # uninstall on rollback


class Savepoints:
    """The savepoint stack over an adapter store and a composer.

    Attributes:
        broken: why the state was lost (a failed restore), else ``None``; every later
            :meth:`check_usable` raises :class:`LoRAStateError`.
    """

    def __init__(self, store: AdapterStore, composer: Composer):
        self.store = store
        self.composer = composer
        self._stack: list[Savepoint] = []
        self.broken: str | None = None

    @property
    def depth(self) -> int:
        """Open savepoints."""
        return len(self._stack)

    # ------------------------------------------------------------------ savepoints
    def begin(self) -> Savepoint:
        self.check_usable()
        sp = Savepoint(
            store=self.store.state(),
            targets=self.composer.states(),
            layers=self.composer.layer_states(),
        )
        self._stack.append(sp)
        return sp

    def commit(self) -> None:
        sp = self._stack.pop()
        if self._stack:  # nested: the outer savepoint may still undo all of it
            self._stack[-1].dropped.extend(sp.dropped)
            self._stack[-1].installed.extend(sp.installed)
            return
        for adapter in sp.dropped:
            self.composer.uninstall(adapter)

    def rollback(self) -> None:
        """Return to the innermost savepoint (and close it).

        Raises:
            LoRAStateError: the restore failed; the layers were reset to the base weights.
        """
        sp = self._stack.pop()
        try:
            keep = {a.uid for _, a, _ in sp.store.adapters}
            current = [*self.store.values(), *sp.dropped, *sp.installed]
            since = {a.uid: a for a in current if a.uid not in keep}
            self.store.restore(sp.store)
            # the layers then use only adapters of the savepoint
            self.composer.restore(sp.targets, sp.layers)
            for adapter in since.values():
                self.composer.uninstall(adapter)
        except BaseException as e:
            self.quarantine(f"restoring the LoRA state failed ({type(e).__name__}: {e})")
            raise LoRAStateError(
                f"restoring the LoRA state failed ({type(e).__name__}: {e}); every layer was "
                "reset to its base weights and the engine stops serving (restart it)"
            ) from e

    def quarantine(self, reason: str) -> None:
        """Put every layer in a known state (base weights, nothing active) after a failed
        restore; later calls raise :class:`LoRAStateError`."""
        self.broken = reason
        self._stack.clear()
        logger.error("LoRA state lost: %s", reason)
        for layer, _ in self.composer.reset():  # pragma: no cover - already failing
            logger.error("resetting LoRA layer %s failed", layer.prefix)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise LoRAStateError(f"the LoRA state was lost earlier: {self.broken}")

    @contextlib.contextmanager
    def txn(self) -> Iterator[Savepoint]:
        """Run the block under a savepoint: commit when it returns, roll back when it raises."""
        sp = self.begin()
        try:
            yield sp
        except BaseException:
            self.rollback()
            raise
        self.commit()

    def drop(self, adapter: Adapter) -> None:
        """An adapter left the store: uninstall it when the outermost savepoint commits."""
        if self._stack:
            self._stack[-1].dropped.append(adapter)
        else:
            self.composer.uninstall(adapter)

    def note_installed(self, adapter: Adapter) -> None:
        """An adapter was installed: a rollback of the open savepoint uninstalls it."""
        if self._stack:
            self._stack[-1].installed.append(adapter)

    # ------------------------------------------------------------------ cross-rank protocol
    def begin_change(self) -> None:
        """Open a savepoint before a change that must be all-or-nothing across TP ranks.

        Raises:
            RuntimeError: a savepoint is already open.
            LoRAStateError: the state was lost earlier.
        """
        if self._stack:
            raise RuntimeError("a LoRA change savepoint is already open")
        self.begin()

    def commit_change(self) -> None:
        """Keep the changes made since :meth:`begin_change`; free the adapters they dropped."""
        if not self._stack:
            raise RuntimeError("no LoRA change savepoint is open")
        self.commit()

    def rollback_change(self) -> None:
        """Undo every change made since :meth:`begin_change` (another rank failed).

        Raises:
            LoRAStateError: the restore failed (see the module docstring).
        """
        if not self._stack:
            raise RuntimeError("no LoRA change savepoint is open")
        self.rollback()

    def info(self) -> dict[str, Any]:
        """``{"open_savepoints": n, "broken": reason or None}`` (JSON-able)."""
        return {"open_savepoints": len(self._stack), "broken": self.broken}
