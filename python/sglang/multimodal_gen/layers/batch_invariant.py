"""GEMMs whose rows do not depend on how many rows share the call (CPU batch invariance).

The CPU BLAS rounds a row differently depending on the GEMM's row count: measured on an AMD EPYC
VM, 1-3, 5-7 and 9-11 rows at 2 threads differ from the same rows of a taller GEMM by up to 1e-5;
at 16+ threads more counts do (17-19, 25-27, ... up to 171 rows at 64), never a multiple of 4
(4, 8 and 12 rows included: re-measured at 1-64 threads over 80 shapes, ``F.linear`` and
``addmm_``, against 16-200-row GEMMs). Per-image conditioning vectors (timestep embedding, adaLN
modulation: one row per image) would otherwise make a request's image change when it joins a batch. Every linear
layer (``ParallelLinear.apply_gemm``) and the LoRA paths (``layers/lora``) go through these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "CPU_GEMM_ROW_BLOCK",
    "MIN_CPU_GEMM_ROWS",
    "addmm_rows_invariant_",
    "linear_rows_invariant",
]

# Batch invariance of CPU GEMMs (see ParallelLinear.apply_gemm): inputs run as a multiple of
# CPU_GEMM_ROW_BLOCK rows, and at least MIN_CPU_GEMM_ROWS (one block: a 1-2-row conditioning
# GEMM padded to 4 rows costs about half of one padded to 16 and rounds its rows alike)
MIN_CPU_GEMM_ROWS = 4
CPU_GEMM_ROW_BLOCK = 4
# below this many rows an input that needs padding is padded whole (e.g. 18 audio tokens: one
# 20-row GEMM instead of 16 rows plus a padded 4-row tail and a concatenation; the same bits,
# every multiple of CPU_GEMM_ROW_BLOCK rounding a row alike)
SMALL_CPU_GEMM_ROWS = 64


def _cpu_row_split(x: torch.Tensor) -> tuple[int, int]:
    """``(rows, head)`` of ``x`` viewed as ``[rows, x.shape[-1]]``: the first ``head`` rows can
    run as one GEMM as they are (a multiple of :data:`CPU_GEMM_ROW_BLOCK`, at least
    :data:`MIN_CPU_GEMM_ROWS`; all rows off the CPU), the others run zero-padded."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or x.device.type != "cpu":
        return rows, rows
    head = rows - rows % CPU_GEMM_ROW_BLOCK
    return rows, head if head >= MIN_CPU_GEMM_ROWS else 0


def _padded_tail(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` (``r`` rows) zero-padded to ``max(MIN_CPU_GEMM_ROWS, r rounded up to the block)``."""
    r = x2d.shape[0]
    n = max(MIN_CPU_GEMM_ROWS, -(-r // CPU_GEMM_ROW_BLOCK) * CPU_GEMM_ROW_BLOCK)
    out = x2d.new_zeros(n, x2d.shape[-1])
    out[:r] = x2d
    return out


def linear_rows_invariant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row is computed as it would be among other
    rows, on the CPU: the BLAS rounds a row differently depending on the GEMM's row count
    (measured on an AMD EPYC VM: 1-3, 5-7, 9-11 rows at 2 threads; more counts at 16+ threads,
    up to 171 rows at 64; never a multiple of 4), so the input runs as its
    largest multiple of :data:`CPU_GEMM_ROW_BLOCK` rows plus a zero-padded remainder of
    :data:`MIN_CPU_GEMM_ROWS` rows (all of it padded to a multiple of
    :data:`CPU_GEMM_ROW_BLOCK` when shorter than :data:`SMALL_CPU_GEMM_ROWS`).

    Args:
        x: ``[..., in]``; weight: ``[out, in]``; bias: ``[out]`` or ``None``.

    Returns:
        ``[..., out]``; on the CPU, row ``i`` bit-identical to row ``i`` of the same input
        placed among other rows (a batch), where the BLAS behaves as measured.
    """
    rows, head = _cpu_row_split(x)
    if head == rows:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows < SMALL_CPU_GEMM_ROWS:  # one padded GEMM, not a head GEMM plus a padded tail
        head = 0
    y = F.linear(_padded_tail(x2[head:]), weight, bias)[: rows - head]
    if head:
        y = torch.cat([F.linear(x2[:head], weight, bias), y])
    return y.reshape(*x.shape[:-1], -1)


def addmm_rows_invariant_(
    y2d: torch.Tensor, h2d: torch.Tensor, mat: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``y2d.addmm_(h2d, mat, alpha=alpha)`` (``[rows, n] += alpha [rows, k] @ [k, n]``) with the
    row split of :func:`linear_rows_invariant`; returns ``y2d``."""
    rows, head = _cpu_row_split(h2d)
    if head == rows:
        return y2d.addmm_(h2d, mat, alpha=alpha)
    if head:
        y2d[:head].addmm_(h2d[:head], mat, alpha=alpha)
    y_tail = _padded_tail(y2d[head:])
    y_tail.addmm_(_padded_tail(h2d[head:]), mat, alpha=alpha)
    y2d[head:].copy_(y_tail[: rows - head])
    return y2d
