"""The adapters the engine will have loaded when a newly queued request runs.

A generation naming adapters in its ``lora`` runs after every command queued before it. Whether
those adapters will be loaded then is known when it is queued: the engine's loaded adapters, plus
the adapters the ``set_lora`` calls queued ahead of it load, minus those the ``unload_lora``
calls queued ahead of it free. :class:`AdapterLedger` keeps that account, so a request naming an
adapter that will not be there is refused (404 naming ``lora``) before a job or a queue entry
exists, and a request queued behind a ``set_lora`` that loads its adapter is accepted, whichever
finishes first.

The scheduler tells the ledger, under its queue lock, about each LoRA command it queues
(:meth:`queued`) and, from its thread, how each ended (:meth:`finished`); it asks
:meth:`check` under the same lock as it queues a generation, so the account and the queue order
are the same. A queued command counts as it would succeed; when it fails, or is dropped, its
effect is taken back. A ``set_lora`` answer that lists the engine's loaded adapters (``loaded``)
replaces the account of what is loaded (the engine may have unloaded least-recently-used
adapters to make room).

The starting point is the engine's ``list_loras()`` (:meth:`sync`). An engine that cannot report
leaves the ledger unknowing, and then it refuses nothing (the engine's own check still answers).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from sglang.multimodal_gen.errors import NotFoundError

__all__ = ["AdapterLedger", "loaded_names"]


def loaded_names(report: Any) -> set[str] | None:
    """The nicknames a ``list_loras()`` report lists as loaded (``loaded``: a list of
    ``{"nickname", ...}`` entries, or a mapping keyed by nickname); ``None`` when it has none."""
    if not isinstance(report, Mapping):
        return None
    loaded = report.get("loaded")
    if isinstance(loaded, Mapping):
        return {str(n) for n in loaded}
    if isinstance(loaded, (list, tuple)):
        names = set()
        for entry in loaded:
            if isinstance(entry, str):
                names.add(entry)
            elif isinstance(entry, Mapping) and isinstance(entry.get("nickname"), str):
                names.add(entry["nickname"])
            else:
                return None
        return names
    return None


def _effect(method: str, args: tuple, kwargs: dict) -> tuple[set[str], set[str]]:
    """``(loads, unloads)``: the nicknames a queued command loads and frees if it succeeds."""
    if method == "set_lora":
        spec = args[0] if args else kwargs.get("lora_nickname")
        if hasattr(spec, "nicknames"):  # SetLoRAArgs, as the HTTP layer sends it
            names, paths = list(spec.nicknames), list(spec.paths)
        else:
            names = [spec] if isinstance(spec, str) else list(spec or [])
            raw = args[1] if len(args) > 1 else kwargs.get("lora_path")
            paths = raw if isinstance(raw, (list, tuple)) else [raw] * len(names)
            if len(paths) == 1:
                paths = list(paths) * len(names)
        return {n for n, p in zip(names, paths) if p is not None}, set()
    if method == "unload_lora":
        name = args[0] if args else kwargs.get("nickname", kwargs.get("lora_nickname"))
        return set(), {name} if isinstance(name, str) else set()
    return set(), set()


class AdapterLedger:
    """The loaded adapters as the queue will leave them (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: set[str] | None = None  # the engine's, as of the last finished command
        self._pending: OrderedDict[int, tuple[set[str], set[str]]] = OrderedDict()

    @property
    def known(self) -> bool:
        """Whether the ledger knows the engine's adapters (else it refuses nothing)."""
        return self._loaded is not None

    def sync(self, report: Any) -> None:
        """Take the engine's loaded adapters from a ``list_loras()`` report (anything else: the
        ledger stops knowing)."""
        names = loaded_names(report)
        with self._lock:
            self._loaded = names

    def queued(self, token: int, method: str, args: tuple = (), kwargs: dict | None = None) -> None:
        """A command was queued (``token`` names it until :meth:`finished`)."""
        loads, unloads = _effect(method, args, kwargs or {})
        if not loads and not unloads and method != "set_lora":
            return
        with self._lock:
            self._pending[token] = (loads, unloads)

    def finished(self, token: int, result: Any = None, ok: bool = True) -> None:
        """The command ``token`` ended: succeeded with ``result``, or not (``ok=False``: failed
        or dropped, nothing changed)."""
        with self._lock:
            effect = self._pending.pop(token, None)
            if effect is None or not ok or self._loaded is None:
                return
            reported = loaded_names(result)
            if reported is not None:
                self._loaded = reported
            else:
                loads, unloads = effect
                self._loaded = (self._loaded | loads) - unloads

    def view(self) -> set[str] | None:
        """The adapters loaded once every queued command has run as it should (``None``: not
        known)."""
        with self._lock:
            if self._loaded is None:
                return None
            names = set(self._loaded)
            for loads, unloads in self._pending.values():
                names = (names | loads) - unloads
            return names

    def check(self, names: Iterable[str]) -> None:
        """Refuse a request naming an adapter that will not be loaded when it runs.

        Raises:
            NotFoundError: 404, ``param="lora"``, naming the first such adapter.
        """
        names = list(names)
        if not names:
            return
        loaded = self.view()
        if loaded is None:
            return
        for name in names:
            if name not in loaded:
                raise NotFoundError(
                    f"LoRA adapter {name!r} is not loaded (loaded: {sorted(loaded)}); load it "
                    "with /v1/set_lora first",
                    param="lora",
                )
