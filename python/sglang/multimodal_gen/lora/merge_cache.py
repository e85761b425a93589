"""Byte-bounded LRU cache of merged layer weights.

Switching back to a recently used composition in merge mode then costs one copy per layer instead
of recomputing ``W + sum_i s_i c_i B_i A_i``. Entries are keyed by :class:`MergeKey`: the module,
the version of its base weight (bumped by ``commit_as_base``), and for every active adapter its
file identity, strength and per-shard scale (which carries alpha, rank and rsLoRA).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AdapterKey", "MergeCache", "MergeKey"]


@dataclass(frozen=True)
class AdapterKey:
    """One active adapter as seen by one module.

    Attributes:
        identity: the adapter content identity (``"<content digest>:<config digest>"``), so reloading
            the same unchanged file under any nickname hits, and an edited file misses.
        strength: the user's strength.
        scales: ``((shard_id, scale), ...)`` of the adapter on this module (``scale`` is
            ``alpha / r`` or ``alpha / sqrt(r)``), sorted by ``repr(shard_id)``.
    """

    identity: str
    strength: float
    scales: tuple[tuple[object, float], ...]


@dataclass(frozen=True)
class MergeKey:
    """Key of one cached merged weight: ``module`` at ``base_version`` with ``adapters`` in order."""

    module: str
    base_version: int
    adapters: tuple[AdapterKey, ...]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MergeCache:
    """LRU map ``MergeKey -> merged weight`` bounded by the total bytes of the stored tensors.

    Args:
        max_bytes: the bound; ``0`` disables the cache (every ``put`` is dropped).
        device: where entries are kept (``None``: wherever the tensor given to :meth:`put` is;
            ``"cpu"`` saves accelerator memory at the price of a host-to-device copy per hit).

    Raises:
        ValueError: negative ``max_bytes``.
    """

    def __init__(self, max_bytes: int, device: torch.device | str | None = None):
        if max_bytes < 0:
            raise ValueError(f"merge cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.device = None if device is None else torch.device(device)
        self._entries: OrderedDict[MergeKey, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: MergeKey) -> bool:
        return key in self._entries

    def get(self, key: MergeKey) -> torch.Tensor | None:
        """The cached tensor (marked most recently used), or ``None``; counts a hit or a miss.

        The returned tensor is the cache's own: copy from it, never write into it.
        """
        t = self._entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: MergeKey, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` (not copied unless ``device`` differs; the caller must not modify it).

        Least recently used entries are evicted until it fits. A tensor larger than the whole
        bound is not stored. Returns whether it was stored.
        """
        size = _nbytes(tensor)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= _nbytes(old)
        while self._entries and self.bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= _nbytes(evicted)
            self.evictions += 1
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device)
        self._entries[key] = tensor.detach()
        self.bytes += size
        return True

    def invalidate(self, predicate: Callable[[MergeKey], bool]) -> int:
        """Drop every entry whose key satisfies ``predicate``; returns how many were dropped."""
        drop = [k for k in self._entries if predicate(k)]
        for k in drop:
            self.bytes -= _nbytes(self._entries.pop(k))
        return len(drop)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        """JSON-able counters: entries, bytes, max_bytes, hits, misses, evictions."""
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
