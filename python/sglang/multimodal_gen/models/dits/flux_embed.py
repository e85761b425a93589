"""Flux.1 position, timestep/text and modulation embeddings (diffusers 0.42.1
``transformer_flux.py`` and ``embeddings.py``), split from the DiT module: RoPE over
``axes_dims_rope`` with real cos/sin (``FluxPosEmbed``, :func:`apply_rope_real`), the timestep
(+ guidance) and pooled-text embedding (``FluxTimeTextEmbed``), and the adaLN modulations
(``FluxAdaLNZero``, ``FluxAdaLNContinuous``). Every linear is a replicated ``ReplicatedLinear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.flux import FluxArchConfig
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.norm import LayerNormNoAffine

__all__ = [
    "FluxAdaLNContinuous",
    "FluxAdaLNZero",
    "FluxPosEmbed",
    "FluxTimeTextEmbed",
    "apply_rope_real",
    "timestep_sinusoid",
]


# --------------------------------------------------------------------------------------- RoPE
class FluxPosEmbed(nn.Module):
    """3-axis rotary tables as real ``(cos, sin)``, each angle repeated for its channel pair.

    Axis ``i`` owns ``axes_dims[i]`` channels of every head. For position ``p`` on that axis and
    pair ``j < axes_dims[i] / 2`` the angle is ``p * theta ** (-2j / axes_dims[i])``; channels
    ``2j`` and ``2j + 1`` both get it. As the reference (``FluxPosEmbed`` +
    ``get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True)``): positions are cast to
    fp32, inverse frequencies, angles, ``cos`` and ``sin`` are computed in float64 and the tables
    rounded to fp32 (float64 on devices that have it; MPS computes on the CPU and copies).

    Shapes: ``ids [S, n_axes]`` (any numeric dtype) -> ``(cos, sin)``, each ``[S, head_dim]`` fp32
    on ``ids.device``. No parameters.
    """

    def __init__(self, theta: float, axes_dims):
        super().__init__()
        self.theta = float(theta)
        self.axes_dims = tuple(int(d) for d in axes_dims)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.ndim != 2 or ids.shape[-1] != len(self.axes_dims):
            raise ValueError(
                f"position ids must be [S, {len(self.axes_dims)}], got {list(ids.shape)}"
            )
        out_device = ids.device
        work = ids if ids.device.type in ("cpu", "cuda") else ids.cpu()
        pos = work.float().to(torch.float64)  # the reference's fp32 positions, widened exactly
        cos_parts, sin_parts = [], []
        for axis, dim in enumerate(self.axes_dims):
            exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=work.device) / dim
            inv_freq = 1.0 / (self.theta**exponents)  # [dim / 2]
            angles = torch.outer(pos[:, axis], inv_freq)  # [S, dim / 2] float64
            cos_parts.append(angles.cos().repeat_interleave(2, dim=1).float())
            sin_parts.append(angles.sin().repeat_interleave(2, dim=1).float())
        cos = torch.cat(cos_parts, dim=-1).to(out_device)
        sin = torch.cat(sin_parts, dim=-1).to(out_device)
        return cos, sin

    def extra_repr(self) -> str:
        return f"theta={self.theta}, axes_dims={list(self.axes_dims)}"


def apply_rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(a, b) -> (a cos - b sin, b cos + a sin)``.

    Args:
        x: ``[B, S, H, D]`` any float dtype.
        cos, sin: ``[S, D]`` fp32 (from :class:`FluxPosEmbed`), broadcast over batch and heads.

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``, computed in fp32 as ``x * cos + rot(x) * sin`` with
        ``rot(x)`` the pairs ``(-b, a)`` (diffusers' ``apply_rotary_emb`` with
        ``use_real_unbind_dim=-1``, same operation order).
    """
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-b, a), dim=-1).flatten(3)
    c = cos[None, :, None, :].to(x.device)
    s = sin[None, :, None, :].to(x.device)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


# --------------------------------------------------------------------------------- embeddings
def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[B] -> [B, dim]`` fp32, ``cos`` half first then ``sin``.

    Frequencies ``w_k = exp(-ln(max_period) * k / (dim / 2))`` computed in the reference's order
    (diffusers ``get_timestep_embedding`` with ``flip_sin_to_cos=True, downscale_freq_shift=0``).
    """
    half = dim // 2
    k = torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp((-math.log(max_period) * k) / half)
    angles = t.float()[:, None] * freqs[None, :]
    out = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return F.pad(out, (0, 1)) if dim % 2 else out


class FluxMLPEmbedder(nn.Module):
    """``linear_2(silu(linear_1(x)))`` (diffusers' ``TimestepEmbedding`` and
    ``PixArtAlphaTextProjection(act_fn="silu")``; BFL's ``MLPEmbedder``).

    Shapes: ``x [B, in_features]`` -> ``[B, out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, prefix: str, **kw):
        super().__init__()
        self.linear_1 = ReplicatedLinear(
            in_features, out_features, prefix=f"{prefix}.linear_1", **kw
        )
        self.linear_2 = ReplicatedLinear(
            out_features, out_features, prefix=f"{prefix}.linear_2", **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)[0]))[0]


class FluxTimeTextEmbed(nn.Module):
    """``temb = MLP(sinusoid(t)) [+ MLP(sinusoid(guidance))] + MLP(pooled)``.

    Diffusers' ``CombinedTimestepTextProjEmbeddings`` (no guidance) and
    ``CombinedTimestepGuidanceTextProjEmbeddings`` (with ``guidance_embedder``); the sum is taken
    in the same order (``(t + g) + pooled``).

    Shapes: ``t [B]``, ``guidance [B] | None`` (both already multiplied by 1000),
    ``pooled [B, pooled_projection_dim]`` -> ``[B, D]`` in the weight dtype.
    """

    def __init__(self, cfg: FluxArchConfig, prefix: str, **kw):
        super().__init__()
        d, f = cfg.inner_dim, cfg.T_FREQ_DIM
        self.freq_dim = f
        self.timestep_embedder = FluxMLPEmbedder(f, d, f"{prefix}.timestep_embedder", **kw)
        if cfg.guidance_embeds:
            self.guidance_embedder = FluxMLPEmbedder(f, d, f"{prefix}.guidance_embedder", **kw)
        else:
            self.guidance_embedder = None
        self.text_embedder = FluxMLPEmbedder(
            cfg.pooled_projection_dim, d, f"{prefix}.text_embedder", **kw
        )

    def forward(self, t, pooled, guidance=None) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(pooled.dtype))
        if self.guidance_embedder is not None:
            g = self.guidance_embedder(timestep_sinusoid(guidance, self.freq_dim).to(pooled.dtype))
            emb = emb + g
        return emb + self.text_embedder(pooled)


# ------------------------------------------------------------------------------ modulation
class FluxAdaLNZero(nn.Module):
    """adaLN-Zero: ``Linear(silu(temb))`` gives ``n_chunks`` vectors of ``[B, D]``; the first two
    (shift, scale) modulate a LayerNorm (no affine, eps 1e-6) of ``x``.

    ``n_chunks=6``: diffusers' ``AdaLayerNormZero`` (double blocks), returns
    ``(x_mod, gate_msa, shift_mlp, scale_mlp, gate_mlp)``. ``n_chunks=3``:
    ``AdaLayerNormZeroSingle``, returns ``(x_mod, gate)``.

    Shapes: ``x [B, S, D]``, ``temb [B, D]``; ``x_mod [B, S, D]``, the others ``[B, D]``.
    """

    def __init__(self, dim: int, n_chunks: int, eps: float, prefix: str, **kw):
        super().__init__()
        self.n_chunks = n_chunks
        self.linear = ReplicatedLinear(dim, n_chunks * dim, prefix=f"{prefix}.linear", **kw)
        self.norm = LayerNormNoAffine(dim, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor):
        chunks = self.linear(F.silu(temb))[0].chunk(self.n_chunks, dim=1)
        shift, scale, rest = chunks[0], chunks[1], chunks[2:]
        x = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return (x, *rest)


class FluxAdaLNContinuous(nn.Module):
    """Final norm: ``scale, shift = Linear(silu(temb))`` (in that order, unlike BFL's
    ``(shift, scale)``), ``LayerNorm(x) * (1 + scale) + shift`` (diffusers'
    ``AdaLayerNormContinuous(elementwise_affine=False, eps=1e-6)``).

    Shapes: ``x [B, S, D]``, ``temb [B, D]`` -> ``[B, S, D]``.
    """

    def __init__(self, dim: int, eps: float, prefix: str, **kw):
        super().__init__()
        self.linear = ReplicatedLinear(dim, 2 * dim, prefix=f"{prefix}.linear", **kw)
        self.norm = LayerNormNoAffine(dim, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype))[0].chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
