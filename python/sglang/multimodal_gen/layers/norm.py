"""Normalization layers used by the DiTs.

``RMSNorm`` follows the numerics of diffusers' ``diffusers.models.normalization.RMSNorm`` (0.42):
the mean of squares is taken in fp32, the input is scaled by ``rsqrt(mean + eps)`` (promoting to
fp32), cast to the weight's dtype when that is half precision, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (Zhang & Sennrich, 2019).

    Args:
        dim: size of the normalized (last) dimension.
        eps: added to the mean of squares before the reciprocal square root.
        elementwise_affine: learn a per-channel ``weight`` of shape ``[dim]`` (initialised to 1).

    Shapes:
        ``x``: ``[..., dim]`` any float dtype -> same shape. The output dtype is the weight's dtype
        when the weight is fp16/bf16, else the promotion of the input dtype with fp32 (as diffusers).
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        shape = (self.dim,)
        # Fused kernels where they give the reference's exact rounding: one rounding to x.dtype
        # (no weight, or fp32), then the half-precision weight product as the reference does.
        if w is None:
            return F.rms_norm(x, shape, None, self.eps)
        if x.dtype == w.dtype:
            if w.dtype in (torch.float16, torch.bfloat16):
                return F.rms_norm(x, shape, None, self.eps) * w
            return F.rms_norm(x, shape, w, self.eps)
        y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if w.dtype in (torch.float16, torch.bfloat16):
            y = y.to(w.dtype)
        return y * w

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


class LayerNormNoAffine(nn.Module):
    """``LayerNorm`` without learned scale/shift (``elementwise_affine=False``).

    Shapes: ``[..., dim]`` -> same shape and dtype. Computed by ``torch.nn.functional.layer_norm``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (self.dim,), eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
