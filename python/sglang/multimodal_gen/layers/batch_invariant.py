"""GEMMs whose rows do not depend on how many rows share the call (CPU batch invariance).

A CPU GEMM may round a row differently depending on the GEMM's row count. The BLAS (MKL's
``sgemm``), measured on an AMD EPYC VM: 1-3, 5-7 and 9-11 rows at 2 threads differ from the same
rows of a taller GEMM by up to 1e-5; at 16+ threads more counts do (17-19, 25-27, ... up to 171
rows at 64), never a multiple of 4 (4, 8 and 12 rows included: re-measured at 1-64 threads over
80 shapes, ``F.linear`` and ``addmm_``, against 16-200-row GEMMs). oneDNN (the default CPU GEMM
backend, :mod:`~sglang.multimodal_gen.layers.cpu_gemm`) differs only for a single row. Per-image
conditioning vectors (timestep embedding, adaLN modulation: one row per image) would otherwise
make a request's image change when it joins a batch. Every linear layer
(``ParallelLinear.apply_gemm``) and the LoRA paths (``layers/lora``) go through these, with the
row rule of the kernel that runs the GEMM (:func:`cpu_gemm.row_rule`; ``addmm_`` is always the
BLAS).
"""

from __future__ import annotations

import torch

from sglang.multimodal_gen.layers.cpu_gemm import ROW_RULES, PackedWeight, cpu_linear, row_rule

__all__ = [
    "CPU_GEMM_ROW_BLOCK",
    "MIN_CPU_GEMM_ROWS",
    "addmm_rows_invariant_",
    "linear_rows_invariant",
]

# Batch invariance of the BLAS's GEMMs (see ParallelLinear.apply_gemm): inputs run as a multiple
# of CPU_GEMM_ROW_BLOCK rows, and at least MIN_CPU_GEMM_ROWS (one block: a 1-2-row conditioning
# GEMM padded to 4 rows costs about half of one padded to 16 and rounds its rows alike)
CPU_GEMM_ROW_BLOCK, MIN_CPU_GEMM_ROWS = ROW_RULES["blas"]
# below this many rows an input that needs padding is padded whole (e.g. 18 audio tokens: one
# 20-row GEMM instead of 16 rows plus a padded 4-row tail and a concatenation; the same bits,
# every multiple of CPU_GEMM_ROW_BLOCK rounding a row alike)
SMALL_CPU_GEMM_ROWS = 64


def _cpu_row_split(x: torch.Tensor, rule: tuple[int, int]) -> tuple[int, int]:
    """``(rows, head)`` of ``x`` viewed as ``[rows, x.shape[-1]]``: the first ``head`` rows can
    run as one GEMM as they are (a multiple of the rule's block, at least its minimum; all rows
    off the CPU), the others run zero-padded."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or x.device.type != "cpu":
        return rows, rows
    block, minimum = rule
    head = rows - rows % block
    return rows, head if head >= minimum else 0


def _padded_tail(x2d: torch.Tensor, rule: tuple[int, int]) -> torch.Tensor:
    """``x2d`` (``r`` rows) zero-padded to ``max(minimum, r rounded up to the block)``."""
    r = x2d.shape[0]
    block, minimum = rule
    n = max(minimum, -(-r // block) * block)
    out = x2d.new_zeros(n, x2d.shape[-1])
    out[:r] = x2d
    return out


def linear_rows_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the CPU GEMM backend
    (:func:`~sglang.multimodal_gen.layers.cpu_gemm.cpu_linear`), every row computed as it would
    be among other rows: a GEMM rounds a row differently depending on its row count (the BLAS:
    1-3, 5-7, 9-11 rows at 2 threads, more counts at 16+ threads, never a multiple of 4;
    oneDNN: 1 row), so the input runs as its largest multiple of the backend's row block plus a
    zero-padded remainder (all of it padded when shorter than :data:`SMALL_CPU_GEMM_ROWS`), at
    least the backend's minimum rows (:func:`~sglang.multimodal_gen.layers.cpu_gemm.row_rule`).

    Args:
        x: ``[..., in]``; weight: ``[out, in]``; bias: ``[out]`` or ``None``.
        packed: the caller's packed copy of ``weight`` (``--cpu-gemm-backend onednn-packed``).

    Returns:
        ``[..., out]``; on the CPU, row ``i`` bit-identical to row ``i`` of the same input
        placed among other rows (a batch), where the backend behaves as measured.
    """
    rule = row_rule(x, weight, bias)
    rows, head = _cpu_row_split(x, rule)
    if head == rows:
        return cpu_linear(x, weight, bias, packed)
    x2 = x.reshape(rows, x.shape[-1])
    if rows < SMALL_CPU_GEMM_ROWS:  # one padded GEMM, not a head GEMM plus a padded tail
        head = 0
    y = cpu_linear(_padded_tail(x2[head:], rule), weight, bias, packed)[: rows - head]
    if head:
        y = torch.cat([cpu_linear(x2[:head], weight, bias, packed), y])
    return y.reshape(*x.shape[:-1], -1)


def addmm_rows_invariant_(
    y2d: torch.Tensor, h2d: torch.Tensor, mat: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``y2d.addmm_(h2d, mat, alpha=alpha)`` (``[rows, n] += alpha [rows, k] @ [k, n]``) with the
    BLAS's row split (:data:`CPU_GEMM_ROW_BLOCK`, :data:`MIN_CPU_GEMM_ROWS`); returns ``y2d``."""
    rule = ROW_RULES["blas"]
    rows, head = _cpu_row_split(h2d, rule)
    if head == rows:
        return y2d.addmm_(h2d, mat, alpha=alpha)
    if head:
        y2d[:head].addmm_(h2d[:head], mat, alpha=alpha)
    y_tail = _padded_tail(y2d[head:], rule)
    y_tail.addmm_(_padded_tail(h2d[head:], rule), mat, alpha=alpha)
    y2d[head:].copy_(y_tail[: rows - head])
    return y2d
