"""The adapters of one LoRA layer, stacked in slot tensors (vLLM's LoRA layers / Punica).

One layer, ``S`` slots (capacity), ``R`` columns per slot (width: the largest total rank of any
adapter stored here), this rank's ``in_local`` inputs and ``out_local`` outputs:

* ``lora_a`` ``[S, R, in_local]`` and ``lora_b`` ``[S, R, out_local]`` (``B`` transposed per slot,
  so ``h @ lora_b[s]`` adds to the output), in the base weight's dtype and device;
* ``col_scale`` ``[S, R]``: the ``alpha / r`` of the shard each column belongs to, 0 in padding
  columns (float32; float64 for a float64 layer);
* once an adapter has an output offset: ``lora_offset`` ``[S, out_local]`` (the shard's offset
  times its own multiplier, float32/float64) and ``offset_scale`` ``[S]`` (1 for a slot with an
  offset here, else 0).

An adapter's columns on a fused q/k/v or gate/up layer are its shards' ranks one after the other,
each shard's ``B`` at that shard's local rows and zeros elsewhere. Padding rows of ``A`` and
columns of ``B`` are zero; so is a slot no adapter uses here. Capacity and width grow by
reallocation (the old contents copied); growing changes the tensors' shapes (a compiled block
recompiles once), nothing else does. The tensors are plain attributes, not buffers: they are not
in the state dict and the DiT offloader leaves them on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang.multimodal_gen.layers.linear import ShardId

__all__ = ["LoRASlots", "ShardColumns", "ShardPiece", "SlotEntry"]


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of scales and offsets for a layer in ``dtype``: float64 for float64, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ShardPiece:
    """This rank's slices of one shard of one adapter, ready to store (weight dtype/device)."""

    shard_id: ShardId
    lora_A: torch.Tensor  # [r, in_local]
    lora_B: torch.Tensor  # [rows, r]
    scale: float
    offset: torch.Tensor | None  # [rows]
    offset_scale: float
    row_start: int  # first local output row of the shard
    rows: int

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])


@dataclass(frozen=True)
class ShardColumns:
    """Where one shard of a stored adapter lives in its slot."""

    shard_id: ShardId
    col: int  # first column
    rank: int
    row_start: int
    rows: int
    scale: float
    has_offset: bool


@dataclass(frozen=True)
class SlotEntry:
    """One stored adapter: its name, its shards' columns, the columns used, its bytes."""

    name: str
    shards: tuple[ShardColumns, ...]
    rank: int
    nbytes: int

    @property
    def has_offset(self) -> bool:
        return any(s.has_offset for s in self.shards)


def entry_nbytes(rank: int, has_offset: bool, in_local: int, out_local: int, dtype) -> int:
    """Bytes an adapter of ``rank`` used columns takes in the slot tensors (its columns of
    ``lora_a``/``lora_b``/``col_scale``, its offset row)."""
    elem = torch.empty((), dtype=dtype).element_size()
    sel = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    return rank * ((in_local + out_local) * elem + sel) + (out_local * sel if has_offset else 0)


class LoRASlots:
    """Slot tensors of one layer and what each slot holds.

    Args:
        in_local, out_local: the layer's local input and output sizes.
    """

    def __init__(self, in_local: int, out_local: int):
        self.in_local = in_local
        self.out_local = out_local
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.col_scale: torch.Tensor | None = None
        self.lora_offset: torch.Tensor | None = None
        self.offset_scale: torch.Tensor | None = None
        self._entries: dict[int, SlotEntry] = {}
        self._names: dict[str, int] = {}

    # ------------------------------------------------------------------ reading
    @property
    def capacity(self) -> int:
        return 0 if self.lora_a is None else int(self.lora_a.shape[0])

    @property
    def width(self) -> int:
        return 0 if self.lora_a is None else int(self.lora_a.shape[1])

    @property
    def names(self) -> list[str]:
        """Stored adapter names, in the order they were added."""
        return list(self._names)

    @property
    def occupied(self) -> frozenset[int]:
        return frozenset(self._entries)

    def slot_of(self, name: str) -> int | None:
        return self._names.get(name)

    def entry(self, slot: int) -> SlotEntry | None:
        return self._entries.get(slot)

    def entry_of(self, name: str) -> SlotEntry | None:
        slot = self._names.get(name)
        return None if slot is None else self._entries[slot]

    def free_slot(self) -> int:
        """The lowest slot no adapter uses."""
        slot = 0
        while slot in self._entries:
            slot += 1
        return slot

    def allocated_bytes(self) -> int:
        """Bytes of the slot tensors, padding and free slots included."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.lora_a, self.lora_b, self.col_scale, self.lora_offset, self.offset_scale)
            if t is not None
        )

    # ------------------------------------------------------------------ changing
    def follow(self, weight: torch.Tensor) -> None:
        """Move/cast the slot tensors to ``weight``'s device and dtype if they differ."""
        if self.lora_a is None:
            return
        dtype, device = weight.dtype, weight.device
        if self.lora_a.device == device and self.lora_a.dtype == dtype:
            return
        sdt = scale_dtype(dtype)
        with torch.inference_mode(False), torch.no_grad():
            self.lora_a = self.lora_a.to(device=device, dtype=dtype)
            self.lora_b = self.lora_b.to(device=device, dtype=dtype)
            self.col_scale = self.col_scale.to(device=device, dtype=sdt)
            if self.lora_offset is not None:
                self.lora_offset = self.lora_offset.to(device=device, dtype=sdt)
                self.offset_scale = self.offset_scale.to(device=device, dtype=sdt)

    def _grow(self, capacity: int, width: int, offsets: bool, dtype, device) -> None:
        """Reallocate to at least ``capacity`` slots and ``width`` columns (copying the old
        contents); allocate the offset tensors when ``offsets``."""
        old_s, old_r = self.capacity, self.width
        new_s = old_s if capacity <= old_s else max(capacity, 2 * old_s)
        new_r = max(width, old_r)
        need_offsets = offsets and self.lora_offset is None
        if (new_s, new_r) == (old_s, old_r) and self.lora_a is not None and not need_offsets:
            return
        sdt = scale_dtype(dtype)
        with torch.inference_mode(False), torch.no_grad():
            if (new_s, new_r) != (old_s, old_r) or self.lora_a is None:
                a = torch.zeros(new_s, new_r, self.in_local, dtype=dtype, device=device)
                b = torch.zeros(new_s, new_r, self.out_local, dtype=dtype, device=device)
                c = torch.zeros(new_s, new_r, dtype=sdt, device=device)
                if self.lora_a is not None:
                    a[:old_s, :old_r].copy_(self.lora_a)
                    b[:old_s, :old_r].copy_(self.lora_b)
                    c[:old_s, :old_r].copy_(self.col_scale)
                self.lora_a, self.lora_b, self.col_scale = a, b, c
            if self.lora_offset is not None or need_offsets:
                o = torch.zeros(new_s, self.out_local, dtype=sdt, device=device)
                os_ = torch.zeros(new_s, dtype=sdt, device=device)
                if self.lora_offset is not None:
                    o[: self.lora_offset.shape[0]].copy_(self.lora_offset)
                    os_[: self.offset_scale.shape[0]].copy_(self.offset_scale)
                self.lora_offset, self.offset_scale = o, os_

    def put(
        self,
        name: str,
        slot: int,
        pieces: Sequence[ShardPiece],
        dtype: torch.dtype,
        device: torch.device,
    ) -> SlotEntry:
        """Store ``pieces`` (one adapter) in ``slot`` under ``name``; the slot is cleared first.

        The caller checked everything: this only allocates and copies.
        """
        rank = sum(p.rank for p in pieces)
        has_offset = any(p.offset is not None for p in pieces)
        self.follow_dtype(dtype, device)
        self._grow(slot + 1, rank, has_offset, dtype, device)
        self._zero(slot)
        shards = []
        col = 0
        with torch.inference_mode(False), torch.no_grad():
            for p in pieces:
                r, rows = p.rank, slice(p.row_start, p.row_start + p.rows)
                if r:
                    self.lora_a[slot, col : col + r].copy_(p.lora_A)
                    self.lora_b[slot, col : col + r, rows].copy_(p.lora_B.t())
                    self.col_scale[slot, col : col + r] = p.scale
                if p.offset is not None:
                    off = p.offset.to(self.lora_offset.dtype) * p.offset_scale
                    self.lora_offset[slot, rows] = off
                    self.offset_scale[slot] = 1.0
                shards.append(
                    ShardColumns(
                        p.shard_id, col, r, p.row_start, p.rows, p.scale, p.offset is not None
                    )
                )
                col += r
        nbytes = entry_nbytes(rank, has_offset, self.in_local, self.out_local, dtype)
        entry = SlotEntry(name, tuple(shards), rank, nbytes)
        self._entries[slot] = entry
        self._names[name] = slot
        return entry

    def follow_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """Bring existing slot tensors to ``dtype``/``device`` before writing into them."""
        if self.lora_a is not None and (self.lora_a.dtype, self.lora_a.device) != (dtype, device):
            self.follow(torch.empty(0, dtype=dtype, device=device))

    def _zero(self, slot: int) -> None:
        if slot >= self.capacity:
            return
        with torch.inference_mode(False), torch.no_grad():
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.col_scale[slot].zero_()
            if self.lora_offset is not None:
                self.lora_offset[slot].zero_()
                self.offset_scale[slot] = 0.0

    def clear(self, slot: int) -> SlotEntry | None:
        """Empty ``slot`` (zeros); when no adapter is left, free every slot tensor."""
        entry = self._entries.pop(slot, None)
        if entry is None:
            return None
        if self._names.get(entry.name) == slot:  # not when the name moved to another slot
            del self._names[entry.name]
        if not self._entries:
            self.lora_a = self.lora_b = self.col_scale = None
            self.lora_offset = self.offset_scale = None
        else:
            self._zero(slot)
        return entry
