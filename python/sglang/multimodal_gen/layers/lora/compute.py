"""The arithmetic of LoRA layers: the fused compose, the chunked merge and its workspace.

Kept apart from the layer classes (``layer.py``), which decide *when* to compose or merge; this
module only says *how*.

Fused compose: the active adapters ``i`` (strength ``s_i``, scale ``c_i``) on shards ``k`` become
``A_cat = [A_1k; A_2k; ...]`` ``[R, in_local]`` (R = sum of ranks) and a block matrix ``B_cat``
``[out_local, R]`` whose block for (adapter i, shard k) holds ``s_i c_i B_ik`` at the shard's
local rows and zeros elsewhere (q/k/v or gate/up sections of unequal height compose
block-diagonally). N adapters cost one pair of GEMMs of rank ``R``.

Merge: ``W' = W + sum_i s_i c_i B_i A_i`` accumulated in fp32 and rounded once to the weight dtype,
computed ``chunk_rows`` output rows at a time so the fp32 workspace is bounded
(:data:`MERGE_CHUNK_BYTES`) and released when the merge returns (Hu et al. 2021, "LoRA", eq. 3).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MERGE_CHUNK_BYTES",
    "LocalLoRA",
    "compile_entries",
    "get_runtime_lora_scale",
    "merged_weight",
    "runtime_lora_scale",
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


# ---------------------------------------------------------------------------- runtime scale
_RUNTIME_SCALE: float = 1.0


def get_runtime_lora_scale() -> float:
    """The multiplier currently applied to every active adapter's scale in forwards (default 1)."""
    return _RUNTIME_SCALE


@contextlib.contextmanager
def runtime_lora_scale(scale: float) -> Iterator[None]:
    """Multiply every active adapter's scale by ``scale`` for the forwards inside the block.

    Stored state (weights, composition, merged weights) is not touched. Nested blocks multiply.
    On a merged layer the forward adds ``(scale - 1) * delta`` on top of the merged weight, so the
    result is the same as in unmerged mode.

    Raises:
        ValueError: ``scale`` is not finite.
    """
    global _RUNTIME_SCALE
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"runtime_lora_scale: scale must be finite, got {scale}")
    previous = _RUNTIME_SCALE
    _RUNTIME_SCALE = previous * scale
    try:
        yield
    finally:
        _RUNTIME_SCALE = previous


# ---------------------------------------------------------------------------- adapters
@dataclass
class LocalLoRA:
    """This rank's slices of one shard of one adapter (dtype as given, device of the weight)."""

    lora_A: torch.Tensor  # [r, in_local]
    lora_B: torch.Tensor  # [rows_local, r]
    scale: float
    offset: torch.Tensor | None  # [rows_local]
    row_start: int  # first local row of the base weight this shard covers
    rows: int  # number of local rows
    offset_scale: float = 1.0  # the offset's multiplier besides the strength

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    @property
    def nbytes(self) -> int:
        n = self.lora_A.numel() * self.lora_A.element_size()
        n += self.lora_B.numel() * self.lora_B.element_size()
        if self.offset is not None:
            n += self.offset.numel() * self.offset.element_size()
        return n


#: ``(strength x scale, strength x offset_scale, weights)`` of one active shard.
Entry = tuple[float, float, LocalLoRA]


def compile_entries(
    entries: Sequence[Entry], weight: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The fused form ``(A_cat [R, in_local], B_cat [out_local, R], offset [out_local])`` of
    ``entries`` in ``weight``'s dtype and device, strengths and scales folded into ``B_cat`` and
    the offset; ``None`` parts when there is no rank / no offset."""
    if not entries:
        return None, None, None
    dtype, device = weight.dtype, weight.device
    out_local, in_local = weight.shape
    with torch.inference_mode(False), torch.no_grad():
        total_r = sum(w.rank for _, _, w in entries)
        a_cat = torch.empty(total_r, in_local, dtype=dtype, device=device)
        b_cat = torch.zeros(out_local, total_r, dtype=dtype, device=device)
        offset = None
        col = 0
        for eff, eff_offset, w in entries:
            a_cat[col : col + w.rank].copy_(w.lora_A)
            b_cat[w.row_start : w.row_start + w.rows, col : col + w.rank].copy_(
                w.lora_B.float() * eff
            )
            col += w.rank
            if w.offset is not None:
                if offset is None:
                    offset = torch.zeros(out_local, dtype=torch.float32, device=device)
                offset[w.row_start : w.row_start + w.rows] += w.offset.float() * eff_offset
    if not total_r:  # bias deltas alone (rank 0) leave no GEMM to run
        a_cat = b_cat = None
    return a_cat, b_cat, None if offset is None else offset.to(dtype)


def merged_weight(
    base: torch.Tensor, entries: Sequence[Entry], chunk_bytes: int = MERGE_CHUNK_BYTES
) -> torch.Tensor:
    """``base + sum_i s_i c_i B_i A_i`` ``[out_local, in_local]`` in ``base``'s dtype, a new tensor.

    Accumulated in fp32 ``chunk`` output rows at a time (``chunk x in_local x 4 <= chunk_bytes``,
    at least one row), each chunk rounded once to the weight dtype, so the result equals the
    unchunked fp32 sum rounded once. The fp32 workspace is freed before returning.
    """
    out_rows, in_cols = base.shape
    chunk = max(1, min(out_rows, chunk_bytes // max(1, 4 * in_cols)))
    live = [(eff, w) for eff, _, w in entries if w.rank]
    with torch.inference_mode(base.is_inference()):  # like the weight: swappable into it
        out = torch.empty_like(base, memory_format=torch.contiguous_format)
    with torch.inference_mode(False), torch.no_grad():
        a32 = {id(w): w.lora_A.float() for _, w in live}
        with _workspace(chunk, in_cols, base.device) as ws:
            for r0 in range(0, out_rows, chunk):
                r1 = min(out_rows, r0 + chunk)
                acc = ws[: r1 - r0]
                acc.copy_(base[r0:r1])
                for eff, w in live:
                    lo, hi = max(r0, w.row_start), min(r1, w.row_start + w.rows)
                    if lo >= hi:
                        continue
                    b = w.lora_B[lo - w.row_start : hi - w.row_start].float()
                    acc[lo - r0 : hi - r0].addmm_(b, a32[id(w)], alpha=eff)
                with torch.inference_mode(out.is_inference()):
                    out[r0:r1].copy_(acc)
        del a32
    return out
