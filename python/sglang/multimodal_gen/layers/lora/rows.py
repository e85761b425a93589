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
from dataclasses import dataclass, field

import torch

from sglang.multimodal_gen.layers.batch_invariant import (
    addmm_rows_invariant_,
    linear_rows_invariant,
)

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
class _Union:
    """A layer's adapters concatenated for per-row coefficients (see the module docstring)."""

    names: frozenset[str]  # the adapters it holds
    cols: list[tuple[str, int, int]]  # per shard: (adapter, first column, rank)
    offs: list[str]  # per offset row of ``offsets``: its adapter
    a_u: torch.Tensor | None  # [R, in_local]
    b_u: torch.Tensor | None  # [out_local, R], scale alpha/r folded in
    offsets: torch.Tensor | None  # [E, out_local], offset scale folded in
    coefs: dict = field(default_factory=dict)  # plan key -> (coef [n, R], off_coef [n, E])


#: Coefficient sets a layer keeps per union (one per distinct plan seen in a batch).
MAX_PLANS = 16


def _union(layer, names: set[str]) -> _Union:
    """``layer``'s union form of adapters ``names`` (stored order), in the weight's dtype/device."""
    weight = layer.base_layer.weight
    out_local, _ = weight.shape
    dtype, device = weight.dtype, weight.device
    cols, offs, shards = [], [], []
    col = 0
    for name, local in layer._adapters.items():
        if name not in names:
            continue
        for w in local.values():
            cols.append((name, col, w.rank))
            shards.append(w)
            col += w.rank
            if w.offset is not None:
                offs.append((name, w))
    a_u = b_u = offsets = None
    with torch.inference_mode(False), torch.no_grad():
        if col:
            a_u = torch.cat([w.lora_A.to(device=device, dtype=dtype) for w in shards], 0)
            b_u = torch.zeros(out_local, col, dtype=dtype, device=device)
            for (_, c0, r), w in zip(cols, shards):
                rows = slice(w.row_start, w.row_start + w.rows)
                b_u[rows, c0 : c0 + r].copy_(w.lora_B.float() * w.scale)
        if offs:
            offsets = torch.zeros(len(offs), out_local, dtype=torch.float32, device=device)
            for e, (_, w) in enumerate(offs):
                offsets[e, w.row_start : w.row_start + w.rows] = w.offset.float() * w.offset_scale
            offsets = offsets.to(dtype)
    return _Union(frozenset(names), cols, [n for n, _ in offs], a_u, b_u, offsets)


def _coefficients(layer, u: _Union, plan: RowPlan, s: float):
    """``(coef [n, R] or None, off_coef [n, E] or None)`` of ``plan`` over union ``u``, expanded
    to the plan's tokens when it has them (``n`` = rows or ``sum(tokens)``)."""
    active = dict(layer._composition)
    merged = layer.merged
    strengths = [
        active if row is None else {n: v for n, v in row if n in layer._adapters}
        for row in plan.rows
    ]
    rows = len(plan.rows)
    c = torch.zeros(rows, u.a_u.shape[0] if u.a_u is not None else 0)
    for name, c0, r in u.cols:
        sub = active.get(name, 0.0) if merged else 0.0
        for b, comp in enumerate(strengths):
            c[b, c0 : c0 + r] = s * comp.get(name, 0.0) - sub
    oc = torch.zeros(rows, len(u.offs))
    for e, name in enumerate(u.offs):
        for b, comp in enumerate(strengths):
            oc[b, e] = s * comp.get(name, 0.0)
    if plan.tokens is not None and rows > 1:
        idx = torch.tensor(plan.tokens)
        c, oc = c.repeat_interleave(idx, 0), oc.repeat_interleave(idx, 0)
    weight = layer.base_layer.weight

    def out(t):
        return t.to(device=weight.device, dtype=weight.dtype) if t.numel() and t.any() else None

    return out(c), out(oc)


def _compiled(layer, plan: RowPlan, s: float):
    """``(union, coef, off_coef)`` for ``plan``, from the layer's cache when possible."""
    weight = layer.base_layer.weight
    needed = {n for row in plan.rows if row is not None for n, _ in row if n in layer._adapters}
    if any(row is None for row in plan.rows) or layer.merged:
        needed |= {n for n, _ in layer._composition}
    u: _Union | None = layer._rows_cache
    if (
        u is None
        or not needed <= u.names
        or (u.a_u is not None and (u.a_u.dtype, u.a_u.device) != (weight.dtype, weight.device))
    ):
        u = _union(layer, needed | (u.names if u is not None else set()))
        layer._rows_cache = u
    key = (plan.rows, plan.tokens, s, layer.merged, tuple(layer._composition))
    coefs = u.coefs.get(key)
    if coefs is None:
        if len(u.coefs) >= MAX_PLANS:
            u.coefs.pop(next(iter(u.coefs)))
        coefs = u.coefs[key] = _coefficients(layer, u, plan, s)
    return u, coefs


def _check_rows(n: int, coef: torch.Tensor, prefix: str) -> None:
    if coef.shape[0] not in (1, n):
        raise ValueError(
            f"module {prefix!r}: input with {n} leading entries does not match the LoRA row plan "
            f"of {coef.shape[0]} rows (a model that flattens rows must declare them with "
            "lora_row_tokens)"
        )


def row_delta(layer, plan: RowPlan, x_local: torch.Tensor, y: torch.Tensor, s: float) -> None:
    """Add ``plan``'s per-row LoRA terms to ``y`` (the base GEMM's local output, in place).

    Args:
        layer: the ``BaseLayerWithLoRA``; it caches one union form (grown when a plan needs
            more adapters; dropped when its stored adapters change or the batch ends) and the
            coefficients of up to :data:`MAX_PLANS` plans over it.
        x_local: ``[n, ..., in_local]`` the input the base GEMM saw; ``n`` is the plan's row
            count (or ``sum(plan.tokens)``).
        y: ``[n, ..., out_local]``.

    Raises:
        ValueError: the input's leading dimension does not match the plan.
    """
    u, (coef, off_coef) = _compiled(layer, plan, s)
    n = x_local.shape[0]

    def lead(t: torch.Tensor) -> torch.Tensor:  # [1 or n, K] -> broadcastable to y
        return t.view((t.shape[0],) + (1,) * (y.dim() - 2) + (-1,))

    if coef is not None:
        _check_rows(n, coef, layer.prefix)
        h = linear_rows_invariant(x_local, u.a_u)  # [n, ..., R]
        h = (h * lead(coef)).reshape(-1, h.shape[-1])
        addmm_rows_invariant_(y.view(-1, y.shape[-1]), h, u.b_u.t())
    if off_coef is not None and layer._adds_offset_here():
        _check_rows(n, off_coef, layer.prefix)
        y.add_(lead(linear_rows_invariant(off_coef, u.offsets.t())))
