"""Building blocks of the LTX-2.x DiT: RoPE coordinates and tables, the adaLN-single timestep
embedders and the attention layer shared by all six attentions of a block.

Same numerics as diffusers 0.42.1 ``models/transformers/transformer_ltx2.py``
(``LTX2AudioVideoRotaryPosEmbed``, ``apply_interleaved_rotary_emb`` / ``apply_split_rotary_emb``,
``LTX2AdaLayerNormSingle``, ``LTX2Attention`` with ``LTX2AudioVideoAttnProcessor`` /
``LTX2PerturbedAttnProcessor``); the architecture and its parallel layout are described in
:mod:`sglang.multimodal_gen.models.dits.ltx2`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig
from sglang.multimodal_gen.distributed.sequence import SeqSplit
from sglang.multimodal_gen.layers.attention import attention, sdpa_bshd
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import RMSNormAcrossHeads, rms_norm_qk
from sglang.multimodal_gen.models.dits.common import tp_kwargs

__all__ = [
    "LTX2AdaLayerNormSingle",
    "LTX2Attention",
    "LTX2Rope",
    "Perturbation",
    "apply_ltx2_rope",
    "ltx2_audio_coords",
    "ltx2_video_coords",
]


# ------------------------------------------------------------------------------ coordinates
def ltx2_video_coords(
    cfg: LTX2ArchConfig,
    batch_size: int,
    num_frames: int,
    height: int,
    width: int,
    device: torch.device | str | None = None,
    fps: float = 24.0,
) -> torch.Tensor:
    """Patch boundaries of a latent video in pixel units / seconds (diffusers'
    ``LTX2AudioVideoRotaryPosEmbed.prepare_video_coords``).

    Each latent patch gets ``[start, end)`` on the (time, row, column) axes: latent indices times
    ``vae_scale_factors``; on the time axis shifted by ``causal_offset - vae_scale_factors[0]``
    (the VAE keeps the first frame alone), clamped at 0 and divided by ``fps`` (seconds).

    Args:
        cfg: the DiT config (patch sizes, ``vae_scale_factors``, ``causal_offset``).
        batch_size: ``B``.
        num_frames, height, width: latent sizes (frames, rows, columns).
        device: where to build the tensor.
        fps: frames per second of the video.

    Returns:
        ``[B, 3, F' * H' * W', 2]`` fp32 (``F' = ceil(num_frames / patch_size_t)`` etc., patches
        in frame-row-column order).
    """
    pt, p = cfg.patch_size_t, cfg.patch_size
    axes = [
        torch.arange(0, n, step, dtype=torch.float32, device=device)
        for n, step in ((num_frames, pt), (height, p), (width, p))
    ]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, F', H', W']
    size = torch.tensor((pt, p, p), dtype=grid.dtype, device=grid.device).view(3, 1, 1, 1)
    latent = torch.stack([grid, grid + size], dim=-1).flatten(1, 3)  # [3, N, 2]
    latent = latent.unsqueeze(0).repeat(batch_size, 1, 1, 1)
    scale = torch.tensor(cfg.vae_scale_factors, device=latent.device).view(1, 3, 1, 1)
    pixel = latent * scale
    t0 = cfg.vae_scale_factors[0]
    pixel[:, 0, ...] = (pixel[:, 0, ...] + cfg.causal_offset - t0).clamp(min=0)
    pixel[:, 0, ...] = pixel[:, 0, ...] / fps
    return pixel


def ltx2_audio_coords(
    cfg: LTX2ArchConfig,
    batch_size: int,
    num_frames: int,
    device: torch.device | str | None = None,
    shift: int = 0,
) -> torch.Tensor:
    """Start/end time in seconds of each audio latent frame (diffusers'
    ``prepare_audio_coords``).

    Latent frame ``i`` (``i`` from ``shift``) spans mel frames ``[i * s, (i + p) * s)``
    (``s = audio_scale_factor``, ``p = audio_patch_size_t``), shifted by ``causal_offset - s``
    and clamped at 0, times ``audio_hop_length / audio_sampling_rate`` seconds.

    Returns:
        ``[B, 1, N, 2]`` fp32 (``N = ceil(num_frames / audio_patch_size_t)``).
    """
    s, p = cfg.audio_scale_factor, cfg.audio_patch_size_t
    f = torch.arange(shift, num_frames + shift, p, dtype=torch.float32, device=device)
    start = (f * s + cfg.causal_offset - s).clip(min=0) * cfg.audio_hop_length
    start = start / cfg.audio_sampling_rate
    end = ((f + p) * s + cfg.causal_offset - s).clip(min=0) * cfg.audio_hop_length
    end = end / cfg.audio_sampling_rate
    coords = torch.stack([start, end], dim=-1)
    return coords.unsqueeze(0).expand(batch_size, -1, -1).unsqueeze(1)


# ------------------------------------------------------------------------------------ RoPE
@dataclass(frozen=True)
class LTX2Rope:
    """RoPE tables from fractional positions (diffusers' ``LTX2AudioVideoRotaryPosEmbed.forward``).

    A position on axis ``i`` is the patch midpoint divided by ``max_positions[i]``, mapped to
    ``[-1, 1]``; frequency ``k`` of ``F = dim // (2 * n_axes)`` is ``theta ** (k / (F - 1)) *
    pi / 2`` (float64 powers when ``double_precision``), the angles are laid out frequency-major,
    axis-minor, and the channels the axes do not fill are padded at the front (cos 1, sin 0).

    Attributes:
        dim: the rotated width (a projection's full output width).
        heads: the channel groups of the ``split`` layout (the reference's ``num_attention_heads``
            of this RoPE; for the audio-video cross-attention RoPE of the video side it is the
            *video* head count, applied to the audio-width projections).
        max_positions: the normalising extent of each axis.
        theta, double_precision, rope_type: as the config.

    ``__call__(coords) -> (cos, sin)``: ``coords [B, n_axes, N, 2]`` boundaries (or ``[B,
    n_axes, N]`` positions) -> ``interleaved``: ``[B, N, dim]`` each (every value twice, for
    both channels of its pair); ``split``: ``[B, N, dim // 2]`` (group ``g`` holds
    ``[g * dim / (2 * heads), (g + 1) * dim / (2 * heads))``). fp32.
    """

    dim: int
    heads: int
    max_positions: tuple[float, ...]
    theta: float
    double_precision: bool
    rope_type: str

    def __call__(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_axes = coords.shape[1]
        if coords.ndim == 4:
            start, end = coords.chunk(2, dim=-1)
            coords = ((start + end) / 2.0).squeeze(-1)
        grid = torch.stack([coords[:, i] / self.max_positions[i] for i in range(n_axes)], dim=-1)
        n_elems = 2 * n_axes
        wide = torch.float64 if self.double_precision else torch.float32
        steps = torch.linspace(0.0, 1.0, self.dim // n_elems, dtype=wide, device=grid.device)
        freqs = (torch.pow(self.theta, steps) * math.pi / 2.0).to(torch.float32)
        ang = (grid.unsqueeze(-1) * 2 - 1) * freqs  # [B, N, n_axes, F]
        ang = ang.transpose(-1, -2).flatten(2)  # [B, N, F * n_axes]
        if self.rope_type == "interleaved":
            cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
            pad = self.dim % n_elems
        else:
            cos, sin = ang.cos(), ang.sin()
            pad = self.dim // 2 - ang.shape[-1]
        if pad:
            cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)
            sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
        return cos, sin

    def local(
        self, table: tuple[torch.Tensor, torch.Tensor], tp_rank: int, tp_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of ``(cos, sin)`` for this TP rank's contiguous ``dim / tp_size`` channels."""
        if tp_size == 1:
            return table
        w = table[0].shape[-1] // tp_size
        return tuple(t[..., tp_rank * w : (tp_rank + 1) * w] for t in table)


def apply_ltx2_rope(
    x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], rope_type: str, groups: int
) -> torch.Tensor:
    """Rotate ``x [B, N, C]`` (C: this rank's channels) with a local table of :class:`LTX2Rope`.

    ``interleaved``: channel pairs ``(2i, 2i + 1)`` rotate together (``cos``/``sin`` ``[B, N,
    C]``); ``split``: ``x`` is ``groups`` groups of ``2r`` channels, the first half of a group
    rotating with its second half (``cos``/``sin`` ``[B, N, C / 2]``). The tables' batch dim may
    be 1 (one table for every item). Computed in fp32 with the
    reference's operation order, returned in ``x.dtype``.
    """
    cos, sin = table
    if rope_type == "interleaved":
        real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(2)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)
    b, n, c = x.shape
    r = c // (2 * groups)
    xs = x.reshape(b, n, groups, 2, r).float()
    cos_u = cos.reshape(cos.shape[0], n, groups, 1, r)
    sin_u = sin.reshape(sin.shape[0], n, groups, 1, r)
    out = xs * cos_u
    out[..., :1, :].addcmul_(-sin_u, xs[..., 1:, :])
    out[..., 1:, :].addcmul_(sin_u, xs[..., :1, :])
    return out.reshape(b, n, c).to(x.dtype)


# ------------------------------------------------------------------------------ embeddings
class LTX2AdaLayerNormSingle(nn.Module):
    """adaLN-single (PixArt-alpha): ``emb = timestep_embedder(sinusoid_256(t))``, ``mods =
    linear(silu(emb))`` with ``n_mods * dim`` outputs (diffusers' ``LTX2AdaLayerNormSingle``,
    without additional conditions). Replicated layers; module names as diffusers'
    (``emb.timestep_embedder.linear_1|2``, ``linear``).

    Shapes: ``t [N]`` (any numeric dtype) -> ``(mods [N, n_mods * dim], emb [N, dim])`` in the
    weight dtype.
    """

    FREQ_DIM = 256

    def __init__(self, dim: int, n_mods: int, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        self.emb = nn.Module()
        self.emb.timestep_embedder = TimestepEmbedding(
            self.FREQ_DIM,
            dim,
            f"{prefix}.emb.timestep_embedder",
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
        )
        self.linear = ReplicatedLinear(
            dim, n_mods * dim, bias=True, **tp_kwargs(f"{prefix}.linear", tp_rank, tp_size, dtype)
        )

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.linear.dtype
        emb = self.emb.timestep_embedder(timestep_sinusoid(t, self.FREQ_DIM).to(w))
        return self.linear(F.silu(emb))[0], emb


# ------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class Perturbation:
    """STG at one block: ``mask [B, 1, 1]`` (0: replace the attention by its values, 1: keep;
    fractions interpolate), ``all_perturbed``: every item is 0 (attention skipped)."""

    mask: torch.Tensor | None
    all_perturbed: bool


class LTX2Attention(nn.Module):
    """One LTX-2 attention (diffusers' ``LTX2Attention``): q from ``x``, k/v from ``x``
    (``self_attn``: one fused ``to_qkv``) or from a context (``to_q`` + fused ``to_kv``),
    q/k RMSNorm over all heads, optional RoPE on q and k, optional per-head output gate
    ``2 * sigmoid(to_gate_logits(x))`` (LTX-2.3 ``gated_attn``), ``to_out.0``.

    Tensor parallel: heads split over TP (q/k/v and the gate logits column-parallel, ``to_out.0``
    row-parallel); the q/k norm sums its squares over the ranks (:class:`RMSNormAcrossHeads`).

    Args:
        query_dim: width of ``x``; kv_dim: width of the context (``None``: self-attention).
        heads, head_dim: attention shape (``heads * head_dim`` inner width).
        bias, out_bias: biases of q/k/v and of ``to_out.0``.
        gated: build ``to_gate_logits`` (``[query_dim -> heads]``).
        prefix, tp_rank, tp_size, dtype: as every DiT layer.

    Shapes: ``x [B, S, query_dim]``, ``ctx [B, L, kv_dim]`` -> ``[B, S, query_dim]``.
    """

    NORM_EPS = 1e-6  # LTX2Attention's default; the blocks do not pass theirs

    def __init__(
        self,
        query_dim: int,
        kv_dim: int | None,
        heads: int,
        head_dim: int,
        bias: bool,
        out_bias: bool,
        gated: bool,
        prefix: str,
        tp_rank,
        tp_size,
        dtype,
    ):
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.is_self = kv_dim is None
        kw = lambda name: tp_kwargs(f"{prefix}.{name}", tp_rank, tp_size, dtype)  # noqa: E731
        if self.is_self:
            self.to_qkv = QKVParallelLinear(
                query_dim, head_dim, heads, heads, bias=bias, **kw("to_qkv")
            )
            self.split_sizes = list(self.to_qkv.output_partition_sizes)
        else:
            self.to_q = ColumnParallelLinear(query_dim, inner, bias=bias, **kw("to_q"))
            self.to_kv = MergedColumnParallelLinear(
                kv_dim, [inner, inner], bias=bias, **kw("to_kv")
            )
            self.split_sizes = list(self.to_kv.output_partition_sizes)
        eps = self.NORM_EPS
        self.norm_q = RMSNormAcrossHeads(inner, eps, tp_rank, tp_size, f"{prefix}.norm_q", dtype)
        self.norm_k = RMSNormAcrossHeads(inner, eps, tp_rank, tp_size, f"{prefix}.norm_k", dtype)
        self.to_gate_logits = (
            ColumnParallelLinear(query_dim, heads, bias=True, **kw("to_gate_logits"))
            if gated
            else None
        )
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    inner, query_dim, bias=out_bias, input_is_parallel=True, **kw("to_out.0")
                )
            ]
        )

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor | None = None,
        q_rope=None,
        k_rope=None,
        rope_type: str = "interleaved",
        rope_groups: tuple[int, int] = (1, 1),
        key_mask: torch.Tensor | None = None,
        sequence_parallel: bool = False,
        kv_split: SeqSplit | None = None,
        perturbation: Perturbation | None = None,
    ) -> torch.Tensor:
        """Args beyond ``x``/``ctx``:

        * ``q_rope`` / ``k_rope``: this rank's ``(cos, sin)`` for q and k (``k_rope`` ``None``:
          ``q_rope``), ``rope_groups`` their local ``split`` groups; ``q_rope`` ``None``: no RoPE;
        * ``key_mask [B, L]`` bool (text keys);
        * ``sequence_parallel``: ``x`` is this rank's chunk of a sequence-parallel self-attention
          (Ulysses / ring through :func:`~sglang.multimodal_gen.layers.attention.attention`);
        * ``kv_split``: the context is this rank's chunk of a sequence split this way; its keys
          (after norm and RoPE, so ``k_rope`` is the table of the local chunk) and values are
          all-gathered over the SP group before a local attention (the queries stay local);
        * ``perturbation``: STG value pass-through (self-attention of a perturbed block).
        """
        gate_logits = self.to_gate_logits(x)[0] if self.to_gate_logits is not None else None
        if self.is_self:
            q, k, v = self.to_qkv(x)[0].split(self.split_sizes, dim=-1)
        else:
            q = self.to_q(x)[0]
            k, v = self.to_kv(ctx)[0].split(self.split_sizes, dim=-1)
        if perturbation is not None and perturbation.all_perturbed:
            out = v
        else:
            q, k = rms_norm_qk(self.norm_q, q, self.norm_k, k)
            if q_rope is not None:
                q = apply_ltx2_rope(q, q_rope, rope_type, rope_groups[0])
                k_table = k_rope if k_rope is not None else q_rope
                k = apply_ltx2_rope(k, k_table, rope_type, rope_groups[1])
            v_all = v
            if kv_split is not None and kv_split.world > 1:
                kv = kv_split.gather(torch.cat([k, v], dim=-1))  # one all-gather for both
                k, v_all = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
            q4, k4, v4 = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v_all))
            if sequence_parallel:
                out = attention(q4, k4, v4, key_mask)
            else:
                out = sdpa_bshd(q4, k4, v4, key_mask)
            out = out.to(q.dtype)
            if perturbation is not None and perturbation.mask is not None:
                out = torch.lerp(v, out, perturbation.mask.to(v.dtype))
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, S, heads / tp]
            out = (out.unflatten(-1, (-1, self.head_dim)) * gates.unsqueeze(-1)).flatten(2)
        return self.to_out[0](out)[0]
