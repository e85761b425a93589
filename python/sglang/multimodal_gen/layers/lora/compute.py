"""The arithmetic of LoRA layers: the delta of a composition, the chunked merge, its workspace.

Kept apart from the layer classes (``layer.py``), which decide *when* to add a delta or merge;
this module only says *how*.

Delta (:func:`add_lora_delta`): the adapters of a composition are gathered from the layer's slot
tensors (``slots.py``) by their slot indices, ``K`` adapters of column width ``R`` each::

    A    = lora_a[slots].reshape(K*R, in_local)
    Bt   = lora_b[slots].reshape(K*R, out_local)
    coef = (strengths[:, None] * col_scale[slots]).reshape(K*R)
    y   += ((x @ A^T) * coef) @ Bt

pure tensor ops: which adapters and which strengths are tensor values (a ``torch.compile`` of the
caller sees no Python constant for them); only ``K`` and ``R`` are shapes. An adapter's columns
on a fused q/k/v or gate/up layer hold each shard's ``B`` at that shard's rows and zeros
elsewhere, so sections of unequal height compose block-diagonally (Punica / S-LoRA's gathered
form, one pair of GEMMs for ``K`` adapters).

Per-row delta (:func:`add_lora_delta_rows`, the form a compiled block traces): every slot of the
layer at once with a coefficient per row and slot, ``coef`` ``[n, S]`` (0 for a slot the row does
not use), so the graph has fixed shapes whatever the compositions are::

    h    = x @ lora_a.reshape(S*R, in_local)^T                        # [n, ..., S*R]
    y   += (h * (coef[:, :, None] * col_scale).reshape(n, 1.., S*R)) @ lora_b.reshape(S*R, out_local)

Merge: ``W' = W + sum_i s_i c_i B_i A_i`` accumulated in fp32 and rounded once to the weight dtype,
computed ``chunk_rows`` output rows at a time so the fp32 workspace is bounded
(:data:`MERGE_CHUNK_BYTES`) and released when the merge returns (Hu et al. 2021, "LoRA", eq. 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from sglang.multimodal_gen.layers.batch_invariant import (
    addmm_rows_invariant_,
    linear_rows_invariant,
)

__all__ = [
    "MERGE_CHUNK_BYTES",
    "MergeTerm",
    "add_lora_delta",
    "add_lora_delta_rows",
    "add_offset_delta",
    "add_offset_delta_rows",
    "merged_weight",
    "workspace_stats",
]

#: Bound of the fp32 merge workspace of one merge (bytes); a chunk is at least one row.
MERGE_CHUNK_BYTES = 64 << 20

# live / peak bytes of merge workspaces (one merging thread per process, like the merge itself)
_WS = {"live": 0, "peak": 0, "allocations": 0}


def workspace_stats(reset_peak: bool = False) -> dict[str, int]:
    """``{"live", "peak", "allocations"}``: bytes of fp32 merge workspace held now, the most held
    at once since the last reset, and how many were allocated. ``live`` is 0 between merges."""
    out = dict(_WS)
    if reset_peak:
        _WS["peak"] = _WS["live"]
    return out


@contextlib.contextmanager
def _workspace(rows: int, cols: int, device: torch.device) -> Iterator[torch.Tensor]:
    """An fp32 ``[rows, cols]`` buffer that is freed (and un-counted) when the block ends."""
    with torch.inference_mode(False):
        buf = torch.empty(rows, cols, dtype=torch.float32, device=device)
    size = rows * cols * 4
    _WS["live"] += size
    _WS["allocations"] += 1
    _WS["peak"] = max(_WS["peak"], _WS["live"])
    try:
        yield buf
    finally:
        _WS["live"] -= size
        del buf


# ---------------------------------------------------------------------------- delta
def add_lora_delta(
    y: torch.Tensor,
    x_local: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    col_scale: torch.Tensor,
    slots: torch.Tensor,
    strengths: torch.Tensor,
) -> torch.Tensor:
    """``y += ((x_local @ A^T) * coef) @ Bt`` for the adapters in ``slots`` (see the module
    docstring); returns ``y``.

    Args:
        y: ``[..., out_local]`` contiguous, the base GEMM's output (written in place).
        x_local: ``[..., in_local]`` the input the base GEMM saw.
        lora_a: ``[S, R, in_local]``; lora_b: ``[S, R, out_local]`` (B transposed per slot);
            col_scale: ``[S, R]`` (each column's ``alpha / r``, 0 in padding columns).
        slots: int64 ``[K]``; strengths: ``[K]`` in ``col_scale``'s dtype.

    The product ``h * coef`` is computed in ``col_scale``'s dtype (float32, or float64 for a
    float64 layer) and rounded once to the compute dtype. The GEMMs are row-invariant on the CPU
    (:mod:`~sglang.multimodal_gen.layers.batch_invariant`): a row's delta does not depend on the
    other rows of the call.
    """
    k = slots.shape[0]
    r = lora_a.shape[1]
    a = lora_a.index_select(0, slots).reshape(k * r, lora_a.shape[2])
    bt = lora_b.index_select(0, slots).reshape(k * r, lora_b.shape[2])
    coef = (strengths[:, None] * col_scale.index_select(0, slots)).reshape(k * r)
    h = linear_rows_invariant(x_local, a)  # [..., K*R]
    h = (h.to(coef.dtype) * coef).to(y.dtype)
    addmm_rows_invariant_(y.view(-1, y.shape[-1]), h.reshape(-1, k * r), bt)
    return y


def add_offset_delta(
    y: torch.Tensor,
    lora_offset: torch.Tensor,
    offset_scale: torch.Tensor,
    slots: torch.Tensor,
    strengths: torch.Tensor,
) -> torch.Tensor:
    """``y += (strengths * offset_scale[slots]) @ lora_offset[slots]`` (bias deltas, computed in
    ``lora_offset``'s dtype and rounded once); returns ``y``. Only the rank that adds the bias
    calls it."""
    coef = strengths * offset_scale.index_select(0, slots)  # [K]
    off = coef[None, :] @ lora_offset.index_select(0, slots)  # [1, out_local]
    y.add_(off[0].to(y.dtype))
    return y


def _per_row(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``c`` ``[n, m]`` viewed to broadcast against ``like`` ``[n, ..., m]`` (``[m]`` for a 1-D
    ``like``, taking row 0)."""
    if like.dim() < 2:
        return c[0]
    return c.reshape(c.shape[0], *([1] * (like.dim() - 2)), c.shape[1])


def add_lora_delta_rows(
    y: torch.Tensor,
    x_local: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    col_scale: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:
    """``y + delta`` where row ``i`` of the input gets ``sum_s coef[i, s] * scale_s B_s A_s x``
    over every slot ``s`` (out of place: a new tensor).

    Args:
        y: ``[n, ..., out_local]``, the base GEMM's output.
        x_local: ``[n, ..., in_local]``, the input the base GEMM saw.
        lora_a: ``[S, R, in_local]``; lora_b: ``[S, R, out_local]``; col_scale: ``[S, R]``.
        coef: ``[n, S]`` (or ``[1, S]``: the same for every row) in ``col_scale``'s dtype or
            float32: the strength of each slot for each row, 0 where the row does not use it.

    Fixed shapes: which adapters and which strengths are values of ``coef``, never shapes; the
    work is that of all ``S * R`` columns (zero-coefficient columns included). ``h * coef`` is
    computed in the coefficient dtype and rounded once to the compute dtype, as in
    :func:`add_lora_delta`.
    """
    s, r = lora_a.shape[0], lora_a.shape[1]
    a = lora_a.reshape(s * r, lora_a.shape[2]).to(x_local.dtype)
    bt = lora_b.reshape(s * r, lora_b.shape[2]).to(y.dtype)
    c = (coef[:, :, None] * col_scale).reshape(coef.shape[0], s * r)  # [n, S*R]
    h = torch.matmul(x_local, a.t())  # [n, ..., S*R]
    h = (h.to(c.dtype) * _per_row(c, h)).to(y.dtype)
    return y + torch.matmul(h, bt)


def add_offset_delta_rows(
    y: torch.Tensor, lora_offset: torch.Tensor, offset_scale: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """``y + (coef * offset_scale) @ lora_offset`` per row (out of place): the bias deltas of
    :func:`add_offset_delta` with a coefficient per row and slot, ``coef`` ``[n, S]``,
    ``lora_offset`` ``[S, out_local]``, ``offset_scale`` ``[S]``. Only the rank that adds the
    bias calls it."""
    off = (coef * offset_scale).to(lora_offset.dtype) @ lora_offset  # [n, out_local]
    return y + _per_row(off, y).to(y.dtype)


# ---------------------------------------------------------------------------- merge
#: ``(strength x scale, A [r, in_local], B [rows, r], first local row)`` of one shard of one
#: adapter (``B`` may be a view of the slot tensors).
MergeTerm = tuple[float, torch.Tensor, torch.Tensor, int]


def merged_weight(
    base: torch.Tensor, terms: Sequence[MergeTerm], chunk_bytes: int = MERGE_CHUNK_BYTES
) -> torch.Tensor:
    """``base + sum_i eff_i B_i A_i`` ``[out_local, in_local]`` in ``base``'s dtype, a new tensor.

    Accumulated in fp32 ``chunk`` output rows at a time (``chunk x in_local x 4 <= chunk_bytes``,
    at least one row), each chunk rounded once to the weight dtype, so the result equals the
    unchunked fp32 sum rounded once. Each term touches only its shard's rows. The fp32 workspace
    is freed before returning.
    """
    out_rows, in_cols = base.shape
    chunk = max(1, min(out_rows, chunk_bytes // max(1, 4 * in_cols)))
    live = [t for t in terms if t[1].shape[0]]
    with torch.inference_mode(base.is_inference()):  # like the weight: swappable into it
        out = torch.empty_like(base, memory_format=torch.contiguous_format)
    with torch.inference_mode(False), torch.no_grad():
        a32 = [a.float() for _, a, _, _ in live]
        with _workspace(chunk, in_cols, base.device) as ws:
            for r0 in range(0, out_rows, chunk):
                r1 = min(out_rows, r0 + chunk)
                acc = ws[: r1 - r0]
                acc.copy_(base[r0:r1])
                for (eff, _, b, start), a in zip(live, a32):
                    lo, hi = max(r0, start), min(r1, start + b.shape[0])
                    if lo >= hi:
                        continue
                    acc[lo - r0 : hi - r0].addmm_(b[lo - start : hi - start].float(), a, alpha=eff)
                with torch.inference_mode(out.is_inference()):
                    out[r0:r1].copy_(acc)
        del a32
    return out
