"""Scaled-dot-product attention over this rank's heads.

Heads are split over the TP ranks by the QKV projection; attention itself needs no communication.
The kernel is ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks flash /
memory-efficient / math per device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_bshd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention on ``[B, S, H, D]`` tensors.

    Args:
        q, k, v: ``[B, S, H, D]`` same dtype.
        key_mask: optional ``[B, S]`` bool, True for keys that may be attended to (batch padding
            is False). ``None`` attends to every key.

    Returns:
        ``[B, S, H * D]`` in ``q.dtype``; softmax scale ``1 / sqrt(D)``.
    """
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2).flatten(2)
