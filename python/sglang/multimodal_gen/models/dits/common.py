"""Helpers shared by the DiT modules of every family."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["loaded_shape", "tp_kwargs"]


def tp_kwargs(prefix: str, tp_rank: int | None, tp_size: int | None, dtype) -> dict:
    """The keyword arguments every ``ParallelLinear`` of a DiT takes: its module name
    (``prefix``, used in loading errors), the TP coordinates (``None``: this process's group) and
    the parameter dtype."""
    return dict(prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)


def loaded_shape(t: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors lazy slice (``get_shape()``), as a tuple."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())
