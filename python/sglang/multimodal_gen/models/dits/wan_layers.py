"""The Wan DiT's building blocks that are not attention: the q/k RMSNorm across tensor-parallel
heads, the 3-axis RoPE tables and the condition embedder (timestep and text).

Same numerics as diffusers 0.42.1 ``models/transformers/transformer_wan.py``; the architecture and
the tensor-parallel layout are described in :mod:`sglang.multimodal_gen.models.dits.wan`. The
shared pieces (the real-table rotation, the timestep sinusoid and MLP embedders, the fp32
LayerNorm) are in ``layers/``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_reduce,
)
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.models.dits.common import loaded_shape

__all__ = [
    "WanConditionEmbedder",
    "WanRMSNormAcrossHeads",
    "WanRotaryEmbed",
    "rms_norm_qk",
]


# ------------------------------------------------------------------------------- q/k norm
class WanRMSNormAcrossHeads(nn.Module):
    """RMSNorm over the whole ``inner_dim`` of q or k (all heads), with the heads split over TP.

    Diffusers applies ``torch.nn.RMSNorm(inner_dim)`` to the projected ``[B, S, inner_dim]``
    before splitting heads (``qk_norm="rms_norm_across_heads"``), so the mean square runs over the
    channels of every head. A TP rank holds the contiguous channels of heads
    ``[r * H / n, (r + 1) * H / n)`` and the matching slice of the weight. It computes

        ``ss_r = sum(x_r.float() ** 2)`` over its ``D / n`` channels, ``ss = all_reduce(ss_r)``,
        ``y_r = (x_r.float() * rsqrt(ss / D + eps) * w_r.float()).to(x.dtype)``

    i.e. exactly the full-width RMSNorm restricted to its channels (up to the order of the fp32
    additions; one rounding to ``x.dtype`` at the end, as ``torch.nn.functional.rms_norm`` does).
    At TP 1 it calls ``F.rms_norm`` itself, which is the reference's kernel (bitwise equal).

    Args:
        dim: the full normalised width ``D`` (``inner_dim``).
        eps: added to the mean square.
        tp_rank, tp_size: TP coordinates (default: the TP group's).
        prefix: the module's dotted name (error messages).
        dtype: the weight's dtype (default: ``torch.get_default_dtype()``).

    Parameters:
        ``weight`` ``[D / tp_size]`` (this rank's channels), initialised to 1; its
        ``weight_loader`` takes the full ``[D]`` checkpoint tensor (or a lazy slice) and keeps
        this rank's part.

    Shapes: ``x [..., D / tp_size]`` -> same shape and dtype (forward all-reduces over TP).
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        prefix: str = "",
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_size = get_tp_world_size() if tp_size is None else tp_size
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        if dim % self.tp_size:
            raise ValueError(
                f"WanRMSNormAcrossHeads({prefix or '<unnamed>'}): dim {dim} is not divisible by "
                f"tp_size {self.tp_size}"
            )
        self.dim = dim
        self.local_dim = dim // self.tp_size
        self.eps = eps
        self.prefix = prefix
        self.weight = nn.Parameter(torch.ones(self.local_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """Copy this rank's ``[D / tp]`` part of the full ``[D]`` weight into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: a norm weight has no shard {shard_id!r}")
        if loaded_shape(loaded) != (self.dim,):
            raise ValueError(
                f"{self.prefix}: norm weight has shape {list(loaded_shape(loaded))}, expected "
                f"[{self.dim}]"
            )
        start = self.tp_rank * self.local_dim
        param.data.copy_(loaded[start : start + self.local_dim])

    def local_sum_sq(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D / tp]`` -> ``[..., 1]`` fp32: the sum of squares of this rank's channels."""
        return x.float().square().sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """Scale ``x`` by ``rsqrt(sum_sq / D + eps)`` (``sum_sq`` already summed over TP)."""
        y = x.float() * torch.rsqrt(sum_sq / self.dim + self.eps) * self.weight.float()
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        return self.normalize(x, tensor_model_parallel_all_reduce(self.local_sum_sq(x)))

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, local={self.local_dim}, eps={self.eps}, tp={self.tp_rank}/{self.tp_size}"
        )


def rms_norm_qk(
    norm_q: WanRMSNormAcrossHeads,
    q: torch.Tensor,
    norm_k: WanRMSNormAcrossHeads,
    k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_q(q), norm_k(k))`` with one all-reduce for both sums of squares at TP > 1.

    Shapes: ``q [B, S, D / tp]``, ``k [B, L, D / tp]`` (``L`` may differ from ``S``) -> same.
    """
    if norm_q.tp_size == 1:
        return norm_q(q), norm_k(k)
    sq, sk = norm_q.local_sum_sq(q), norm_k.local_sum_sq(k)
    both = tensor_model_parallel_all_reduce(torch.cat([sq.flatten(), sk.flatten()]))
    sq, sk = both.split([sq.numel(), sk.numel()])
    return norm_q.normalize(q, sq.view_as(q[..., :1])), norm_k.normalize(k, sk.view_as(k[..., :1]))


# ------------------------------------------------------------------------------------ RoPE
class WanRotaryEmbed:
    """3-axis RoPE tables for a ``(frames, rows, cols)`` token grid (diffusers'
    ``WanRotaryPosEmbed``).

    Each head's ``head_dim`` channels are split into ``t_dim`` (frame index), ``h_dim`` (row) and
    ``w_dim`` (column) with ``h_dim = w_dim = 2 * (head_dim // 6)``. For position ``p`` on an axis
    of ``d`` channels, pair ``j`` rotates by ``p * theta ** (-2j / d)``. As the reference
    (``get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True,
    freqs_dtype=float64)``): inverse frequencies, angles, ``cos`` and ``sin`` in float64 (float32
    where MPS is available, as diffusers), rounded to fp32 tables of ``max_seq_len`` positions.
    The reference stores each value twice (repeat-interleaved) and reads every other one; we keep
    one value per pair.

    ``__call__(ppf, pph, ppw, device) -> (cos, sin)``, each ``[ppf * pph * ppw, head_dim // 2]``
    fp32, tokens in ``(frame, row, col)`` row-major order (the Conv3d's flatten order), as
    :func:`~sglang.multimodal_gen.layers.rotary.apply_rope_real` takes them.
    """

    def __init__(self, head_dim: int, axes_dims, max_seq_len: int, theta: float):
        self.head_dim = head_dim
        self.axes_dims = tuple(int(d) for d in axes_dims)
        self.max_seq_len = int(max_seq_len)
        self.theta = float(theta)
        self._tables: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _build(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        wide = torch.float32 if torch.backends.mps.is_available() else torch.float64
        pos = torch.arange(self.max_seq_len, device="cpu")
        tables = []
        for d in self.axes_dims:
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=wide, device="cpu") / d))
            ang = torch.outer(pos, inv)  # [max_seq_len, d / 2]
            tables.append((ang.cos().float(), ang.sin().float()))
        return tables

    def tables(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        device = torch.device(device)
        if device not in self._tables:
            cpu = self._tables.get(torch.device("cpu")) or self._build()
            self._tables[torch.device("cpu")] = cpu
            self._tables[device] = [(c.to(device), s.to(device)) for c, s in cpu]
        return self._tables[device]

    def __call__(self, ppf: int, pph: int, ppw: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        (ct, st), (ch, sh), (cw, sw) = self.tables(device)
        grid = (ppf, pph, ppw)

        def expand(t_ax, h_ax, w_ax):
            parts = [
                t_ax[:ppf].view(ppf, 1, 1, -1).expand(*grid, -1),
                h_ax[:pph].view(1, pph, 1, -1).expand(*grid, -1),
                w_ax[:ppw].view(1, 1, ppw, -1).expand(*grid, -1),
            ]
            return torch.cat(parts, dim=-1).reshape(ppf * pph * ppw, -1)

        return expand(ct, ch, cw), expand(st, sh, sw)


# ---------------------------------------------------------------------------- embeddings
class WanConditionEmbedder(nn.Module):
    """Timestep and text conditioning (diffusers' ``WanTimeTextImageEmbedding`` without the image
    branch).

    ``temb = time_embedder(sinusoid(t))`` (fp32 weights, cast to the text dtype afterwards, as the
    reference), ``timestep_proj = time_proj(silu(temb))`` (``6 * D`` modulation inputs of every
    block), ``text = text_embedder(encoder_hidden_states)``.

    Shapes: ``timestep [N]`` (``N = B`` or ``B * seq`` flattened per-token timesteps, with
    ``seq_len`` given), ``encoder_hidden_states [B, L, text_dim]`` ->
    ``temb [B, D]`` / ``[B, seq, D]``, ``timestep_proj [B, 6D]`` / ``[B, seq, 6D]``,
    ``text [B, L, D]``.
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        kw = dict(tp_rank=tp_rank, tp_size=tp_size)
        # kept in fp32 like diffusers' _keep_in_fp32_modules ("time_embedder")
        self.time_embedder = TimestepEmbedding(
            cfg.freq_dim, d, f"{prefix}.time_embedder", params_dtype=torch.float32, **kw
        )
        self.time_proj = ReplicatedLinear(
            d,
            cfg.MODULATION_CHUNKS * d,
            prefix=f"{prefix}.time_proj",
            params_dtype=dtype,
            **kw,
        )
        self.text_embedder = TimestepEmbedding(  # diffusers' PixArtAlphaTextProjection
            cfg.text_dim, d, f"{prefix}.text_embedder", act="gelu_tanh", params_dtype=dtype, **kw
        )

    def forward(
        self,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = timestep_sinusoid(timestep, self.freq_dim)  # [N, freq_dim] fp32
        if seq_len is not None:
            t = t.unflatten(0, (-1, seq_len))
        t = t.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(t).type_as(encoder_hidden_states)
        timestep_proj = self.time_proj(F.silu(temb))[0]
        return temb, timestep_proj, self.text_embedder(encoder_hidden_states)
