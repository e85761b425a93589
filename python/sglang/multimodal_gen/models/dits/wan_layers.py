"""The Wan DiT's building blocks that are not attention: the 3-axis RoPE tables and the condition
embedder (timestep and text). The q/k RMSNorm across tensor-parallel heads is
``layers/norm.py``'s :class:`~sglang.multimodal_gen.layers.norm.RMSNormAcrossHeads`.

Same numerics as diffusers 0.42.1 ``models/transformers/transformer_wan.py``; the architecture and
the tensor-parallel layout are described in :mod:`sglang.multimodal_gen.models.dits.wan`. The
shared pieces (the real-table rotation, the timestep sinusoid and MLP embedders, the fp32
LayerNorm, the q/k norm) are in ``layers/``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import ReplicatedLinear

__all__ = [
    "WanConditionEmbedder",
    "WanRotaryEmbed",
]


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
        t = t.to(self.time_embedder.linear_1.dtype)
        temb = self.time_embedder(t).type_as(encoder_hidden_states)
        timestep_proj = self.time_proj(F.silu(temb))[0]
        return temb, timestep_proj, self.text_embedder(encoder_hidden_states)
