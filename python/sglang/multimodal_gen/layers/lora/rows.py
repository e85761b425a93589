"""Per-row LoRA compositions: rows of one batched forward that use different adapters.

A batch that mixes requests with different LoRA compositions runs as ONE forward. The union of
every row's adapters is compiled once into ``A_u`` ``[R, in_local]`` and ``B_u``
``[out_local, R]`` with each adapter's ``alpha / r`` folded in, but not its strength; row ``b``
then gets its own coefficient per rank column, ``S[b]`` ``[R]``, so the delta is

    y[b] += ((x[b] @ A_u^T) * S[b]) @ B_u^T

one GEMM pair for the whole batch plus an elementwise scale (the "row-wise scaling of the
concatenated rank dimension"; the LLM analogue is Punica / S-LoRA's segmented gather). A column
of an adapter a row does not use has coefficient 0, so no row ever sees another row's adapter.

Coefficients, with ``s`` the runtime LoRA scale and ``strength_b(a)`` adapter ``a``'s strength in
row ``b`` (0 if absent; a row of ``None`` uses the layer's active composition):
``s * strength_b(a)`` on an unmerged layer, ``s * strength_b(a) - strength_active(a)`` on a
merged one (the merged weight already holds the active composition, so a row asking for it adds
nothing). Output offsets are never merged: coefficient ``s * strength_b(a)``.

Which rows a forward sees is set by the caller, per thread (:func:`lora_rows`): the batched
input's leading dimension is the row index. A model that flattens rows before a linear layer (for
example concatenating every item's patch tokens) says how many leading entries each row has
(:func:`lora_row_tokens`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["RowPlan", "current_row_plan", "lora_row_tokens", "lora_rows"]

Composition = tuple[tuple[str, float], ...]

_LOCAL = threading.local()


@dataclass(frozen=True)
class RowPlan:
    """The LoRA composition of each row of a batched forward.

    Attributes:
        rows: one entry per row: ``((adapter, strength), ...)``, or ``None`` for the layer's own
            active composition. A plan with a single row applies to every row (uniform).
        tokens: for a flattened input, the number of leading entries of each row (set by
            :func:`lora_row_tokens`), else ``None``.
    """

    rows: tuple[Composition | None, ...]
    tokens: tuple[int, ...] | None = None

    @classmethod
    def of(cls, rows: Sequence[Sequence[tuple[str, float]] | None]) -> RowPlan:
        """A plan from per-row compositions (lists of ``(adapter, strength)`` or ``None``)."""
        return cls(tuple(None if r is None else tuple((n, float(s)) for n, s in r) for r in rows))

    @property
    def uniform(self) -> bool:
        """Whether every row has the same composition."""
        return len(set(self.rows)) <= 1

    def select(self, lo: int, hi: int) -> RowPlan:
        """Rows ``lo:hi`` (a CFG branch of the batch); a uniform plan is returned as is."""
        return self if len(self.rows) == 1 else RowPlan(self.rows[lo:hi])


def current_row_plan() -> RowPlan | None:
    """The plan set by :func:`lora_rows` on this thread, or ``None`` (every row: the layer's
    active composition)."""
    return getattr(_LOCAL, "plan", None)


@contextlib.contextmanager
def lora_rows(plan: RowPlan | None) -> Iterator[None]:
    """Run the block's LoRA forwards with ``plan`` (``None``: the layers' own compositions).

    The plan is per thread: the thread that runs a batched forward sets it."""
    previous = current_row_plan()
    _LOCAL.plan = plan
    try:
        yield
    finally:
        _LOCAL.plan = previous


@contextlib.contextmanager
def lora_row_tokens(tokens: Sequence[int]) -> Iterator[None]:
    """Inside the block, a layer input's leading dimension is ``sum(tokens)`` entries, ``tokens[b]``
    of them for row ``b`` (rows concatenated). A no-op without a multi-row plan."""
    plan = current_row_plan()
    if plan is None or len(plan.rows) == 1:
        yield
        return
    if len(tokens) != len(plan.rows):
        raise ValueError(f"{len(tokens)} token counts for a LoRA row plan of {len(plan.rows)} rows")
    with lora_rows(RowPlan(plan.rows, tuple(int(t) for t in tokens))):
        yield


@dataclass
class _Compiled:
    """A layer's union form for one plan (see the module docstring)."""

    a_u: torch.Tensor | None  # [R, in_local]
    b_u: torch.Tensor | None  # [out_local, R], scale alpha/r folded in
    coef: torch.Tensor | None  # [rows, R]
    offsets: torch.Tensor | None  # [E, out_local], offset scale folded in
    off_coef: torch.Tensor | None  # [rows, E]


def compile_rows(layer, plan: RowPlan, s: float) -> _Compiled:
    """The union form of ``plan`` on ``layer`` (a ``BaseLayerWithLoRA``) at runtime scale ``s``,
    in the weight's dtype and device."""
    weight = layer.base_layer.weight
    active = dict(layer._composition)
    merged = layer.merged
    strengths = []  # per row: {adapter: strength} of the adapters stored on this layer
    for row in plan.rows:
        comp = active if row is None else {n: v for n, v in row if n in layer._adapters}
        strengths.append(comp)
    names = list(dict.fromkeys([n for comp in strengths for n in comp] + list(active)))
    cols, offs = [], []  # per shard: (adapter, LocalLoRA)
    for name in names:
        for w in layer._adapters[name].values():
            cols.append((name, w))
            if w.offset is not None:
                offs.append((name, w))
    out_local, in_local = weight.shape
    dtype, device = weight.dtype, weight.device
    rows = len(plan.rows)
    with torch.inference_mode(False), torch.no_grad():
        a_u = b_u = coef = None
        total_r = sum(w.rank for _, w in cols)
        if total_r:
            a_u = torch.cat([w.lora_A.to(dtype) for _, w in cols], 0)
            b_u = torch.zeros(out_local, total_r, dtype=dtype, device=device)
            c = torch.zeros(rows, total_r, dtype=torch.float32)
            col = 0
            for name, w in cols:
                b_u[w.row_start : w.row_start + w.rows, col : col + w.rank].copy_(
                    w.lora_B.float() * w.scale
                )
                for b, comp in enumerate(strengths):
                    c[b, col : col + w.rank] = s * comp.get(name, 0.0) - (
                        active.get(name, 0.0) if merged else 0.0
                    )
                col += w.rank
            coef = None if not c.any() else c.to(device=device, dtype=dtype)
        offsets = off_coef = None
        if offs:
            offsets = torch.zeros(len(offs), out_local, dtype=torch.float32, device=device)
            oc = torch.zeros(rows, len(offs), dtype=torch.float32)
            for e, (name, w) in enumerate(offs):
                offsets[e, w.row_start : w.row_start + w.rows] = w.offset.float() * w.offset_scale
                for b, comp in enumerate(strengths):
                    oc[b, e] = s * comp.get(name, 0.0)
            offsets = offsets.to(dtype)
            off_coef = None if not oc.any() else oc.to(device=device, dtype=dtype)
    return _Compiled(a_u, b_u, coef, offsets, off_coef)


def _per_entry(coef: torch.Tensor, plan: RowPlan, n: int, prefix: str) -> torch.Tensor:
    """``coef`` ``[rows, K]`` expanded to the input's ``n`` leading entries ``[n, K]``."""
    rows = coef.shape[0]
    if rows == 1 or n == rows and plan.tokens is None:
        return coef
    if plan.tokens is not None and sum(plan.tokens) == n:
        return coef.repeat_interleave(torch.tensor(plan.tokens, device=coef.device), 0)
    raise ValueError(
        f"module {prefix!r}: input with {n} leading entries does not match the LoRA row plan of "
        f"{rows} rows (a model that flattens rows must declare them with lora_row_tokens)"
    )


def row_delta(layer, plan: RowPlan, x_local: torch.Tensor, y: torch.Tensor, s: float) -> None:
    """Add ``plan``'s per-row LoRA terms to ``y`` (the base GEMM's local output, in place).

    Args:
        layer: the ``BaseLayerWithLoRA``; its union form is cached per plan and state (the
            layer drops it when its stored adapters change).
        x_local: ``[n, ..., in_local]`` the input the base GEMM saw; ``n`` is the plan's row
            count (or ``sum(plan.tokens)``).
        y: ``[n, ..., out_local]``.

    Raises:
        ValueError: the input's leading dimension does not match the plan.
    """
    key = (
        plan.rows,
        s,
        layer.merged,
        tuple(layer._composition),
        layer.base_layer.weight.dtype,
        layer.base_layer.weight.device,
    )
    cached = layer._rows_cache
    if cached is None or cached[0] != key:
        cached = (key, compile_rows(layer, plan, s))
        layer._rows_cache = cached
    comp: _Compiled = cached[1]
    n = x_local.shape[0]

    def lead(t: torch.Tensor) -> torch.Tensor:  # [rows or 1 or n, K] -> broadcastable to y
        return t.view((t.shape[0],) + (1,) * (y.dim() - 2) + (-1,))

    if comp.coef is not None:
        coef = _per_entry(comp.coef, plan, n, layer.prefix)
        h = F.linear(x_local, comp.a_u)  # [n, ..., R]
        h = (h * lead(coef)).reshape(-1, h.shape[-1])
        y.view(-1, y.shape[-1]).addmm_(h, comp.b_u.t())
    if comp.off_coef is not None and layer._adds_offset_here():
        y.add_(lead(_per_entry(comp.off_coef, plan, n, layer.prefix) @ comp.offsets))
