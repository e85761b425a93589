"""Which adapters a forward applies: compositions of slots, the per-row mapping, the context.

* :class:`Composition`: ``((slot, strength), ...)``, a frozen value (equality and hash by value)
  naming adapters by their slot index, the same index on every layer of one model target. It
  caches its slots and strengths as device tensors, so the forward sees them as tensor values.
* :class:`RowMapping`: one composition per row of a batched forward (the input's leading
  dimension is the row index), grouped by composition.
* :class:`LoRAContext`: one per model target, shared by every LoRA layer of the target; it holds
  the mapping of the forwards running now (``with ctx.rows(mapping): model(...)``). The thread
  that runs the forwards sets it right before calling the model; there is no thread-local and no
  module global.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from sglang.multimodal_gen.layers.lora.row_strengths import RowStrengths

__all__ = ["Composition", "LoRAContext", "RowGroup", "RowMapping", "lora_context_of"]


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


class Composition:
    """A frozen, hashable composition ``((slot, strength), ...)`` in the order given.

    ``slot`` is an adapter's slot index on the layers of one model target, ``strength`` the
    user's multiplier of its ``alpha / r``. Equality and hash are by value; ``Composition.EMPTY``
    (equal to ``Composition(())``) means no LoRA. Picklable (the cached tensors are not pickled).

    Raises:
        ValueError: a slot that is not a non-negative int, a slot given twice, a strength that is
            not a finite number.
    """

    __slots__ = ("_entries", "_hash", "_tensors")
    EMPTY: ClassVar[Composition]

    def __init__(self, entries: Iterable[tuple[int, float]] = ()):
        out = []
        seen = set()
        for item in entries:
            slot, strength = item
            if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
                raise ValueError(f"a LoRA slot must be an int >= 0, got {slot!r}")
            strength = float(strength)
            if not math.isfinite(strength):
                raise ValueError(f"strength {strength} for LoRA slot {slot} is not finite")
            if slot in seen:
                raise ValueError(f"LoRA slot {slot} appears twice in one composition")
            seen.add(slot)
            out.append((int(slot), strength))
        object.__setattr__(self, "_entries", tuple(out))
        object.__setattr__(self, "_hash", hash(self._entries))
        object.__setattr__(self, "_tensors", {})

    @classmethod
    def of(cls, value: Composition | Iterable[tuple[int, float]] | None) -> Composition:
        """``value`` as a composition (a composition is returned as is; ``None``: empty)."""
        if isinstance(value, Composition):
            return value
        return cls.EMPTY if value is None else cls(value)

    # ------------------------------------------------------------------ value
    @property
    def entries(self) -> tuple[tuple[int, float], ...]:
        return self._entries

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self._entries)

    @property
    def strengths(self) -> tuple[float, ...]:
        return tuple(v for _, v in self._entries)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Composition):
            return NotImplemented
        return self._hash == other._hash and self._entries == other._entries

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Composition is immutable")

    def __reduce__(self):
        return (Composition, (self._entries,))

    def __repr__(self) -> str:
        return f"Composition({self._entries!r})"

    # ------------------------------------------------------------------ tensors
    def slot_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The slots as an int64 ``[K]`` tensor on ``device`` (cached; never write into it)."""
        key = ("slots", _device(device))
        t = self._tensors.get(key)
        if t is None:
            with torch.inference_mode(False):
                t = torch.tensor(self.slots, dtype=torch.int64, device=key[1])
            self._tensors[key] = t
        return t

    def strength_tensor(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The strengths as a ``[K]`` tensor (float32 by default) on ``device`` (cached)."""
        key = ("strengths", _device(device), dtype)
        t = self._tensors.get(key)
        if t is None:
            with torch.inference_mode(False):
                t = torch.tensor(self.strengths, dtype=dtype, device=key[1])
            self._tensors[key] = t
        return t


Composition.EMPTY = Composition(())


class RowGroup:
    """The rows of a :class:`RowMapping` that share one composition.

    Attributes:
        composition: their :class:`Composition`.
        rows: their row indices (ascending), or ``None`` when the group is every row.
        span: ``(lo, hi)`` when the rows are consecutive, else ``None``.
    """

    __slots__ = ("composition", "rows", "span", "_index")

    def __init__(self, composition: Composition, rows: tuple[int, ...] | None):
        self.composition = composition
        self.rows = rows
        #: ``(lo, hi)`` when the rows are ``lo, lo + 1, ..., hi - 1`` (a slice serves them)
        self.span = None
        if rows and rows == tuple(range(rows[0], rows[0] + len(rows))):
            self.span = (rows[0], rows[0] + len(rows))
        self._index: dict[torch.device, torch.Tensor] = {}

    def index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The rows as an int64 ``[n]`` tensor on ``device`` (cached per device).

        Raises:
            ValueError: the group is every row (``rows is None``).
        """
        if self.rows is None:
            raise ValueError("this row group covers every row; it has no index")
        dev = _device(device)
        t = self._index.get(dev)
        if t is None:
            with torch.inference_mode(False):
                t = torch.tensor(self.rows, dtype=torch.int64, device=dev)
            self._index[dev] = t
        return t

    def __repr__(self) -> str:
        return f"RowGroup({self.composition!r}, rows={self.rows})"


class RowMapping:
    """The composition of each row of a batched forward (the input's leading dimension).

    Built with :meth:`of` (one composition per row). A mapping with one distinct composition
    (:attr:`uniform`, e.g. :meth:`whole`) applies to every row of any input; otherwise the
    input's leading dimension must be :attr:`rows`. Equality and hash are by value.

    Attributes:
        compositions: one :class:`Composition` per row.
        groups: one :class:`RowGroup` per distinct composition, in order of first appearance; a
            single group has ``rows=None`` (every row).
    """

    __slots__ = ("compositions", "groups")

    def __init__(self, compositions: Sequence[Composition | Iterable[tuple[int, float]]]):
        comps = tuple(Composition.of(c) for c in compositions)
        if not comps:
            raise ValueError("a RowMapping needs at least one row")
        self.compositions = comps
        order: dict[Composition, list[int]] = {}
        for i, c in enumerate(comps):
            order.setdefault(c, []).append(i)
        if len(order) == 1:
            self.groups = (RowGroup(comps[0], None),)
        else:
            self.groups = tuple(RowGroup(c, tuple(rows)) for c, rows in order.items())

    @classmethod
    def of(cls, compositions: Sequence[Composition | Iterable[tuple[int, float]]]) -> RowMapping:
        """One composition per row: row ``i`` of the forward's input uses ``compositions[i]``."""
        return cls(compositions)

    @classmethod
    def whole(cls, composition: Composition | Iterable[tuple[int, float]]) -> RowMapping:
        """One composition for every row of any input (a one-row mapping)."""
        return cls([composition])

    @property
    def rows(self) -> int:
        """The number of rows (the leading dimension a non-uniform mapping requires)."""
        return len(self.compositions)

    @property
    def uniform(self) -> bool:
        """Whether one composition covers every row (then any leading dimension is accepted)."""
        return len(self.groups) == 1

    def select(self, lo: int, hi: int) -> RowMapping:
        """Rows ``lo:hi`` (the rows of one CFG branch); a one-row mapping is returned as is.

        Raises:
            ValueError: an empty or out-of-range slice.
        """
        if len(self.compositions) == 1:
            return self
        if not 0 <= lo < hi <= len(self.compositions):
            raise ValueError(f"rows {lo}:{hi} of a RowMapping of {len(self.compositions)} rows")
        return RowMapping(self.compositions[lo:hi])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowMapping):
            return NotImplemented
        return self.compositions == other.compositions

    def __hash__(self) -> int:
        return hash(self.compositions)

    def __reduce__(self):
        return (RowMapping, (self.compositions,))

    def __repr__(self) -> str:
        return f"RowMapping({len(self.compositions)} rows, groups={list(self.groups)})"


class LoRAContext:
    """The LoRA state the forwards of one model target share: the row mapping running now.

    Every LoRA layer of the target holds the same context (``layer.lora_context``) and the
    target's top module has it as ``module.lora_context`` (:func:`lora_context_of`).

    Args:
        target: the target's name (``"transformer"``...), used in messages.

    Attributes:
        mapping: the :class:`RowMapping` of the forwards running now (``None``: every row uses
            the layers' active composition).
        active: the composition the target's layers hold as active (set by the LoRA manager
            when it changes them): a caller whose rows all use it passes no mapping.
        row_strengths: :attr:`mapping` as fixed-shape tensors (kept up to date by :meth:`rows`),
            what the layers' compiled forward reads instead of the mapping.
    """

    def __init__(self, target: str):
        self.target = target
        self.mapping: RowMapping | None = None
        # the composition every layer of the target holds as its active one (kept by the LoRA
        # manager): rows of that composition need no mapping
        self.active: Composition = Composition.EMPTY
        self.row_strengths = RowStrengths()

    @contextlib.contextmanager
    def rows(self, mapping: RowMapping | None) -> Iterator[LoRAContext]:
        """Run the forwards of the block with ``mapping`` (``None``: every row uses each layer's
        active composition); the previous mapping is restored when the block ends.

        Raises:
            TypeError: ``mapping`` is not a :class:`RowMapping` or ``None``.
        """
        if mapping is not None and not isinstance(mapping, RowMapping):
            raise TypeError(f"LoRAContext.rows takes a RowMapping or None, got {mapping!r}")
        previous = self.mapping
        self.mapping = mapping
        self.row_strengths.set(mapping)
        try:
            yield self
        finally:
            self.mapping = previous
            self.row_strengths.set(previous)

    def __repr__(self) -> str:
        return f"LoRAContext({self.target!r}, mapping={self.mapping!r})"


def lora_context_of(module: nn.Module) -> LoRAContext | None:
    """The :class:`LoRAContext` of a module whose layers were wrapped for LoRA (a target's top
    module, or one LoRA layer), else ``None``."""
    ctx = module.__dict__.get("lora_context")
    return ctx if isinstance(ctx, LoRAContext) else None
