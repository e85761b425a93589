"""Loaded adapters: what one adapter is once converted, and the store that holds them.

An :class:`Adapter` is built from a file converted for every target it matches
(:func:`stage_adapter`); nothing is put on a layer here. The :class:`AdapterStore` keeps them by
nickname in least-recently-used order, decides which ones to unload so the loaded bytes fit
``max_bytes`` (the caller names the pinned ones: adapters of an active composition), and owns the
slot table: for each target, the slot index every layer of that target uses for an installed
adapter (by uid). A slot is taken when the adapter is installed on the layers and freed when it
is uninstalled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError, NotFoundError
from sglang.multimodal_gen.lora.formats import CanonicalLoRA
from sglang.multimodal_gen.lora.peft_config import FP32_MAX

__all__ = ["Adapter", "AdapterStore", "StoreState", "stage_adapter"]


@dataclass
class Adapter:
    """A loaded adapter. ``uid`` is its name on the layers (unique per load, so a reload under the
    same nickname can be staged next to the old one and swapped atomically)."""

    nickname: str
    uid: str
    source: str
    identity: str  # "<content digest>:<config digest>" (lora.loading)
    summaries: dict[str, dict[str, Any]]  # target -> CanonicalLoRA.summary()
    modules: dict[str, list[str]]  # target -> our module names the adapter touches
    scales: dict[tuple[str, str], tuple]  # (target, module) -> ((shard_id, scale), ...)
    nbytes: int = 0
    last_used: int = 0
    peaks: dict[tuple[str, str], float] = field(default_factory=dict)  # max |scale x B| per module
    file_key: tuple | None = None  # lora.loading.file_key at load time: reuse without a read


def _amax(t: torch.Tensor) -> float:
    """``max |t|`` as a Python float (0 for an empty tensor)."""
    return float(t.detach().abs().amax()) if t.numel() else 0.0


def stage_adapter(
    nickname: str,
    uid: str,
    path: str,
    converted: Mapping[str, CanonicalLoRA],
    metadata: Mapping[str, Any],
) -> Adapter:
    """Describe a converted adapter (scales, peaks, modules, estimated bytes); touches nothing.

    Raises:
        LoRAFormatError: an ``alpha / r`` that is not finite in float32 (``param="lora_path"``).
    """
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
        (t, m): max((abs(float(w.scale)) * _amax(w.lora_B) for w in shards.values()), default=0.0)
        for t, c in converted.items()
        for m, shards in c.modules.items()
    }
    return Adapter(
        nickname=nickname,
        uid=uid,
        source=path,
        identity=str(metadata.get("identity") or metadata.get("path") or path),
        summaries={t: c.summary() for t, c in converted.items()},
        modules={t: sorted(c.modules) for t, c in converted.items()},
        scales=scales,
        peaks=peaks,
        nbytes=sum(c.nbytes() for c in converted.values()),  # estimate until installed
        file_key=metadata.get("file_key"),
    )


@dataclass(frozen=True)
class StoreState:
    """What a savepoint keeps of the store: adapters in LRU order and the slot table."""

    adapters: tuple[tuple[str, Adapter, int], ...]  # (nickname, adapter, last_used)
    slots: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]  # target -> ((uid, slot), ...)


class AdapterStore:
    """Adapters by nickname, least recently used first, bounded by their bytes on this rank; and
    the slot of each installed adapter (by uid) in each target.

    Args:
        max_bytes: bound of :meth:`loaded_bytes` (``--max-loaded-lora-gb``).
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_loaded_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[str, Adapter] = OrderedDict()
        self._slots: dict[str, dict[str, int]] = {}  # target -> uid -> slot
        self._clock = 0
        self.evictions = 0
        self.slot_epoch = 0  # bumped whenever a slot is freed (a selection may be stale)

    # mapping-like access ----------------------------------------------------------------
    def __contains__(self, nickname: object) -> bool:
        return nickname in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, nickname: str) -> Adapter:
        return self._items[nickname]

    def get(self, nickname: str) -> Adapter | None:
        return self._items.get(nickname)

    def values(self) -> list[Adapter]:
        return list(self._items.values())

    def items(self) -> list[tuple[str, Adapter]]:
        return list(self._items.items())

    def require(self, nickname: str, param: str = "lora_nickname") -> Adapter:
        """The adapter loaded as ``nickname``.

        Raises:
            NotFoundError: not loaded (``param`` names the field).
        """
        adapter = self._items.get(nickname)
        if adapter is None:
            hint = (
                "load it first with POST /v1/set_lora (engine.set_lora; a strength of 0 "
                "loads it without using it globally)"
                if param != "lora_nickname"
                else "pass lora_path to load it"
            )
            raise NotFoundError(
                f"LoRA adapter {nickname!r} is not loaded (loaded: {list(self._items)}); {hint}",
                param=param,
            )
        return adapter

    # changes (the manager's transactions record and undo them) ---------------------------
    def put(self, adapter: Adapter) -> Adapter | None:
        """Add or replace ``adapter.nickname``; returns the adapter it replaced."""
        old = self._items.get(adapter.nickname)
        self._items[adapter.nickname] = adapter
        return old

    def pop(self, nickname: str) -> Adapter | None:
        return self._items.pop(nickname, None)

    def touch(self, nickname: str) -> None:
        """Mark ``nickname`` most recently used."""
        adapter = self._items.get(nickname)
        if adapter is None:
            return
        self._clock += 1
        adapter.last_used = self._clock
        self._items.move_to_end(nickname)

    def state(self) -> StoreState:
        """The adapters in LRU order and the slot table, for a savepoint."""
        return StoreState(
            tuple((n, a, a.last_used) for n, a in self._items.items()),
            tuple((t, tuple(table.items())) for t, table in self._slots.items()),
        )

    def restore(self, state: StoreState) -> None:
        """Put back the contents, LRU order and slot table recorded by :meth:`state`."""
        self._items = OrderedDict()
        for n, a, last_used in state.adapters:
            a.last_used = last_used
            self._items[n] = a
        before = {(t, u, s) for t, table in self._slots.items() for u, s in table.items()}
        self._slots = {t: dict(table) for t, table in state.slots}
        after = {(t, u, s) for t, table in self._slots.items() for u, s in table.items()}
        if before - after:
            self.slot_epoch += 1

    # slots -----------------------------------------------------------------------------------
    def slot_of(self, target: str, uid: str) -> int | None:
        """The slot of installed adapter ``uid`` on the layers of ``target``, or ``None``."""
        return self._slots.get(target, {}).get(uid)

    def assign_slot(self, target: str, uid: str, taken: Iterable[int] = ()) -> int:
        """The slot of ``uid`` in ``target``: its current one, else the lowest slot neither in
        the table nor in ``taken`` (slots the target's layers hold for someone else)."""
        table = self._slots.setdefault(target, {})
        if uid in table:
            return table[uid]
        used = set(table.values()) | set(taken)
        slot = 0
        while slot in used:
            slot += 1
        table[uid] = slot
        return slot

    def free_slots(self, uid: str) -> None:
        """Forget the slots of ``uid`` in every target (it was uninstalled)."""
        for table in self._slots.values():
            if table.pop(uid, None) is not None:
                self.slot_epoch += 1

    def slot_table(self, target: str) -> dict[str, int]:
        """``{uid: slot}`` of ``target`` (a copy)."""
        return dict(self._slots.get(target, {}))

    # memory --------------------------------------------------------------------------------
    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self._items.values())

    def plan_room(self, new: list[Adapter], replaced: set[str], pinned: set[str]) -> list[str]:
        """Nicknames to unload (oldest first) so the loaded bytes fit after adding ``new``.

        Raises:
            InvalidRequestError (``param="lora_path"``): one new adapter alone is larger than the
                bound, or even unloading every adapter not in use would not make room.
        """
        for a in new:
            if a.nbytes > self.max_bytes:
                raise InvalidRequestError(
                    f"LoRA {a.nickname!r} needs {a.nbytes / 2**20:.1f} MiB on this rank, more "
                    f"than the whole adapter memory bound of {self.max_bytes / 2**20:.1f} MiB "
                    "(--max-loaded-lora-gb); raise the budget or use a smaller adapter",
                    param="lora_path",
                )
        keep = {n: a for n, a in self._items.items() if n not in replaced}
        total = sum(a.nbytes for a in keep.values()) + sum(a.nbytes for a in new)
        evict = []
        for n, a in keep.items():  # oldest first
            if total <= self.max_bytes:
                break
            if n in pinned:
                continue
            evict.append(n)
            total -= a.nbytes
        if total > self.max_bytes:
            raise InvalidRequestError(
                f"loading would need {total / 2**20:.1f} MiB of LoRA weights, over the adapter memory "
                f"bound of {self.max_bytes / 2**20:.1f} MiB (--max-loaded-lora-gb), with every other "
                "adapter in use; unset or unload one first",
                param="lora_path",
            )
        return evict
