"""The GELU-tanh feed-forward of diffusers' DiTs on our tensor-parallel layers.

diffusers' ``FeedForward(activation_fn="gelu-approximate")`` is ``net.0`` (``GELU``: a Linear
``proj`` then tanh-approximate GELU), ``net.1`` (dropout) and ``net.2`` (Linear). Here ``net.0.proj``
is column-parallel and ``net.2`` row-parallel, so the block needs one all-reduce; the module
names stay diffusers' so checkpoints and LoRA files load 1:1 (Flux's ``ff``/``ff_context``, Wan's
``ffn``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["GeluTanhFeedForward", "GeluTanhProj"]


def _kw(prefix: str, tp_rank, tp_size, dtype) -> dict:
    return dict(prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)


class GeluTanhProj(nn.Module):
    """Column-parallel ``proj`` then tanh-approximate GELU.

    Shapes: ``[..., dim]`` -> ``[..., hidden / tp]``.
    """

    def __init__(self, dim: int, hidden: int, prefix: str, tp_rank=None, tp_size=None, dtype=None):
        super().__init__()
        self.proj = ColumnParallelLinear(
            dim, hidden, bias=True, **_kw(f"{prefix}.proj", tp_rank, tp_size, dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x)[0], approximate="tanh")


class GeluTanhFeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))`` with ``hidden`` split over TP.

    Shapes: ``x [..., dim]`` -> ``[..., dim]`` (all-reduced over TP).

    Raises:
        ValueError: ``hidden`` not divisible by the TP size (names the layer).
    """

    def __init__(self, dim: int, hidden: int, prefix: str, tp_rank=None, tp_size=None, dtype=None):
        super().__init__()
        self.net = nn.ModuleList(
            [
                GeluTanhProj(dim, hidden, f"{prefix}.net.0", tp_rank, tp_size, dtype),
                nn.Identity(),
                RowParallelLinear(
                    hidden,
                    dim,
                    bias=True,
                    input_is_parallel=True,
                    **_kw(f"{prefix}.net.2", tp_rank, tp_size, dtype),
                ),  # fmt: skip
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))[0]
