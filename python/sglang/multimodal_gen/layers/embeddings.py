"""Timestep and conditioning embedders shared by the DiTs.

Follows diffusers 0.42.1 ``models/embeddings.py``: the sinusoidal timestep features
(``get_timestep_embedding`` / ``Timesteps``) and the two-layer MLP embedder (``TimestepEmbedding``,
which has the same layout as ``PixArtAlphaTextProjection``). Every linear is a replicated
``ReplicatedLinear``: conditioning vectors are small and every TP rank needs all of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.layers.linear import ReplicatedLinear

__all__ = ["TimestepEmbedding", "timestep_sinusoid"]


def timestep_sinusoid(
    t: torch.Tensor, dim: int, max_period: float = 10000.0, scale: float = 1.0
) -> torch.Tensor:
    """Sinusoidal timestep features, ``cos`` half first then ``sin``.

    With ``w_k = exp(-ln(max_period) * k / (dim / 2))`` for ``k < dim / 2`` and the angles
    ``scale * (t * w_k)``; an odd ``dim`` gets one zero column at the end. Same operations in the
    same order as diffusers' ``get_timestep_embedding(flip_sin_to_cos=True,
    downscale_freq_shift=0, scale=scale)`` (``embeddings.py``; the ``Timesteps`` module), which is
    also Z-Image's ``TimestepEmbedder.timestep_embedding`` (``transformer_z_image.py``): the scale
    multiplies the angles, not ``t`` (``scale=1`` leaves them untouched).

    Args:
        t: ``[N]`` timesteps, any numeric dtype (cast to fp32).
        dim: number of features.
        max_period: the longest period of the sinusoids.
        scale: multiplies the angles (Qwen-Image: 1000).

    Returns:
        ``[N, dim]`` fp32 on ``t.device``.
    """
    half = dim // 2
    k = torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp((-math.log(max_period) * k) / half)
    angles = t.float()[:, None] * freqs[None, :]
    if scale != 1:
        angles = scale * angles
    out = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return F.pad(out, (0, 1)) if dim % 2 else out


class TimestepEmbedding(nn.Module):
    """``linear_2(act(linear_1(x)))`` on replicated layers.

    diffusers' ``TimestepEmbedding`` (``embeddings.py``; ``act_fn="silu"``) and, with the same
    module names, ``PixArtAlphaTextProjection`` (``act_fn="silu"`` or ``"gelu_tanh"``): the DiTs use
    it for their timestep, guidance and text / pooled-text embedders (BFL's ``MLPEmbedder``).

    Args:
        in_features, out_features: ``linear_1`` is ``in -> out``, ``linear_2`` ``out -> out``.
        prefix: the module's dotted name (loading errors).
        act: ``"silu"`` or ``"gelu_tanh"`` (tanh-approximate GELU).
        **kw: passed to both ``ReplicatedLinear`` (``tp_rank``, ``tp_size``, ``params_dtype``).

    Shapes: ``x [..., in_features]`` -> ``[..., out_features]`` in the weight dtype.

    Raises:
        ValueError: an unknown ``act``.
    """

    ACTIVATIONS = ("silu", "gelu_tanh")

    def __init__(self, in_features: int, out_features: int, prefix: str, act: str = "silu", **kw):
        super().__init__()
        if act not in self.ACTIVATIONS:
            raise ValueError(f"{prefix}: activation {act!r} is not one of {self.ACTIVATIONS}")
        self.act = act
        self.linear_1 = ReplicatedLinear(
            in_features, out_features, prefix=f"{prefix}.linear_1", **kw
        )
        self.linear_2 = ReplicatedLinear(
            out_features, out_features, prefix=f"{prefix}.linear_2", **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)[0]
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return self.linear_2(h)[0]

    def extra_repr(self) -> str:
        return f"act={self.act}"
