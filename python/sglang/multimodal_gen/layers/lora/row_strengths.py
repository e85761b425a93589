"""The row mapping of a model target as fixed-shape tensors, for compiled blocks.

A compiled block must not read the :class:`~sglang.multimodal_gen.layers.lora.composition.
RowMapping` (Python values: dynamo would guard on them and recompile for every new mapping).
:class:`RowStrengths` keeps the same information as two tensors whose shapes do not depend on the
mapping; :meth:`RowStrengths.set` rewrites their values in place when the target's context
changes mapping (outside any graph)::

    strengths  [rows_cap, width]   strengths[i, s]: the strength of slot s for row i (0: unused)
    use_rows   []                  1: rows follow ``strengths``; 0: no mapping (each layer's own
                                   active composition)

A uniform mapping fills every row (any leading dimension reads row ``i`` or row 0 alike); a
mapping of ``n`` distinct rows fills rows ``0..n-1``. Slot indices are target-wide, so one pair of
tensors serves every layer of the target; each layer keeps its own ``[3, S]`` plan (which slots it
stores, its active and its merged strengths) and combines the two in its traced forward
(:meth:`BaseLayerWithLoRA._forward_traced`).

The shapes change only when ``rows_cap`` must grow (a mapping of more rows than it holds) or the
width must (a layer with more slots reserved it): each costs one recompile of the blocks.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROWS_CAP", "RowStrengths"]

#: Rows the tensors hold from the start (a batch of more rows with distinct compositions grows
#: them: one recompile).
ROWS_CAP = 16

_UNSET = object()


class RowStrengths:
    """The tensor form of one :class:`LoRAContext`'s current row mapping (see the module
    docstring). Nothing is allocated until a LoRA layer :meth:`reserve` s a width (its first
    adapter); until then :meth:`set` only remembers the mapping.

    Attributes:
        strengths: ``[rows_cap, width]`` float32 (float64 once a float64 layer reserved), on the
            layers' device; ``None`` before :meth:`reserve`.
        use_rows: ``[]`` same dtype: 1.0 while a mapping is set, else 0.0.
        updates: how many times the tensors were rewritten (tests and stats).
    """

    def __init__(self):
        self.strengths: torch.Tensor | None = None
        self.use_rows: torch.Tensor | None = None
        self.updates = 0
        self._mapping: Any = _UNSET  # the RowMapping (or None) the tensors hold

    @property
    def width(self) -> int:
        return 0 if self.strengths is None else int(self.strengths.shape[1])

    @property
    def rows_cap(self) -> int:
        return ROWS_CAP if self.strengths is None else int(self.strengths.shape[0])

    def reserve(self, width: int, device: torch.device, dtype: torch.dtype) -> None:
        """Make the tensors at least ``width`` slots wide, on ``device``, at least as precise as
        ``dtype`` (reallocating and refilling them when any of these grows)."""
        t = self.strengths
        if t is not None:
            wide = width <= t.shape[1]
            precise = t.dtype == torch.float64 or dtype != torch.float64
            if wide and precise and t.device == torch.device(device):
                return
            width = max(width, int(t.shape[1]))
        self._allocate(self.rows_cap, width, torch.device(device), dtype)

    def _allocate(self, rows: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        old = self.strengths
        if old is not None and old.dtype == torch.float64:
            dtype = torch.float64
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        with torch.inference_mode(False):
            self.strengths = torch.zeros(rows, width, dtype=dtype, device=device)
            self.use_rows = torch.zeros((), dtype=dtype, device=device)
        mapping, self._mapping = self._mapping, _UNSET
        self.set(None if mapping is _UNSET else mapping)

    def set(self, mapping: Any) -> None:
        """Write ``mapping`` (a ``RowMapping``; ``None``: no mapping; this module does not import
        ``composition``, which imports it) into the tensors, in place (a no-op when they
        hold that mapping object already; growing ``rows_cap`` when it has more rows)."""
        if mapping is self._mapping:
            return
        if self.strengths is None:
            self._mapping = mapping
            return
        rows = 1 if mapping is None or mapping.uniform else mapping.rows
        if rows > self.strengths.shape[0]:
            cap = max(rows, 2 * int(self.strengths.shape[0]))
            self._mapping = mapping
            self._allocate(cap, self.width, self.strengths.device, self.strengths.dtype)
            return
        cap, width = self.strengths.shape
        host = torch.zeros(cap, width, dtype=self.strengths.dtype)
        if mapping is not None:
            if mapping.uniform:
                for slot, v in mapping.groups[0].composition:
                    if slot < width:
                        host[:, slot] = v
            else:
                for i, comp in enumerate(mapping.compositions):
                    for slot, v in comp:
                        if slot < width:
                            host[i, slot] = v
        with torch.inference_mode(False), torch.no_grad():
            self.strengths.copy_(host)
            self.use_rows.fill_(0.0 if mapping is None else 1.0)
        self._mapping = mapping
        self.updates += 1

    def __repr__(self) -> str:
        return f"RowStrengths(rows_cap={self.rows_cap}, width={self.width})"
