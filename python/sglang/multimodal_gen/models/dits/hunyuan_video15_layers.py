"""The conditioning embedders and blocks of the HunyuanVideo 1.5 DiT, on our parallel layers.

Follows diffusers 0.42.1 ``models/transformers/transformer_hunyuan_video15.py`` (module names are
diffusers', except the fused q/k/v projections, see ``hunyuan_video15_names.py``):

* :class:`HunyuanVideo15TimeEmbedding`: ``time_embed`` (sinusoid of 256 features, cos first, then a
  SiLU MLP; with ``use_meanflow`` a second one for ``timestep_r``, summed);
* :class:`HunyuanVideo15TokenRefiner`: ``context_embedder``, the token refiner on the Qwen2.5-VL
  features (masked mean pooled text + timestep -> ``temb``; ``proj_in``; ``num_refiner_layers``
  self-attention blocks with gated residuals);
* :class:`HunyuanVideo15ByT5Projection`: ``context_embedder_2`` (LayerNorm, three linears, exact
  GELU between them) on the ByT5 glyph features;
* :class:`HunyuanVideo15ImageProjection`: ``image_embedder`` (LayerNorm, linear, GELU, linear,
  LayerNorm) on the SigLIP image features;

The dual-stream blocks are the shared ``layers.mmdit.DualStreamBlock`` (see ``hunyuan_video15.py``).

Tensor parallelism: the refiner's attention heads (q/k/v column-parallel, output row-parallel) and
feed-forward hidden units are split over the ranks; the embedders of the
conditioning vectors, the ByT5 / image projections and the adaLN linears are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig
from sglang.multimodal_gen.layers.attention import sdpa_bshd
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.models.dits.common import tp_kwargs

__all__ = [
    "HunyuanVideo15ByT5Projection",
    "HunyuanVideo15ImageProjection",
    "HunyuanVideo15TimeEmbedding",
    "HunyuanVideo15TokenRefiner",
]


# ------------------------------------------------------------------------------ conditioning
class HunyuanVideo15TimeEmbedding(nn.Module):
    """``time_embed``: ``timestep_embedder(sinusoid(t))`` (+ ``timestep_embedder_r(sinusoid(r))``
    for MeanFlow models given ``timestep_r``); diffusers' ``HunyuanVideo15TimeEmbedding``.

    Shapes: ``t [B]`` (the scheduler's timestep, ``[0, 1000]``), ``r [B] | None`` -> ``[B, D]`` in
    ``dtype`` (the sinusoid is computed in fp32 and cast to ``dtype`` before the MLP).
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        f, d = cfg.T_FREQ_DIM, cfg.inner_dim
        self.freq_dim = f
        self.timestep_embedder = TimestepEmbedding(f, d, f"{prefix}.timestep_embedder", **kw)
        self.timestep_embedder_r = (
            TimestepEmbedding(f, d, f"{prefix}.timestep_embedder_r", **kw)
            if cfg.use_meanflow
            else None
        )

    def forward(self, t: torch.Tensor, dtype: torch.dtype, r: torch.Tensor | None = None):
        emb = self.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(dtype))
        if r is not None:
            if self.timestep_embedder_r is None:
                raise ValueError(
                    "timestep_r is given but this model has no MeanFlow embedder "
                    "(use_meanflow=False)"
                )
            emb = emb + self.timestep_embedder_r(timestep_sinusoid(r, self.freq_dim).to(dtype))
        return emb


class _SelfAttention(nn.Module):
    """Masked self-attention of the token refiner (diffusers' ``Attention`` with the default
    processor: fused q/k/v here, no q/k norm), heads split over TP.

    Shapes: ``x [B, L, D]``, ``key_mask [B, L] bool | None`` -> ``[B, L, D]`` (all-reduced).
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd, heads = cfg.inner_dim, cfg.attention_head_dim, cfg.num_attention_heads
        self.head_dim = hd
        self.to_qkv = QKVParallelLinear(
            d, hd, heads, heads, bias=True, **tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype)
        )
        self.split_sizes = list(self.to_qkv.output_partition_sizes)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    d,
                    d,
                    bias=True,
                    input_is_parallel=True,
                    **tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.to_qkv(x)[0].split(self.split_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        return self.to_out[0](sdpa_bshd(q, k, v, key_mask).type_as(x))[0]


class _SiluFeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="linear-silu")``: ``net.2(silu(net.0.proj(x)))``,
    column- then row-parallel (one all-reduce).

    Shapes: ``[..., D]`` -> ``[..., D]``.
    """

    def __init__(self, dim: int, hidden: int, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        proj = ColumnParallelLinear(
            dim, hidden, bias=True, **tp_kwargs(f"{prefix}.net.0.proj", tp_rank, tp_size, dtype)
        )
        head = nn.Module()
        head.proj = proj
        out = RowParallelLinear(
            hidden,
            dim,
            bias=True,
            input_is_parallel=True,
            **tp_kwargs(f"{prefix}.net.2", tp_rank, tp_size, dtype),
        )
        self.net = nn.ModuleList([head, nn.Identity(), out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.silu(self.net[0].proj(x)[0]))[0]


class _RefinerBlock(nn.Module):
    """One token-refiner block (diffusers' ``HunyuanVideo15IndividualTokenRefinerBlock``)::

        gate_a, gate_f = norm_out.linear(silu(temb)).chunk(2)
        x = x + attn(norm1(x), mask) * gate_a
        x = x + ff(norm2(x)) * gate_f

    ``norm1``/``norm2`` are affine LayerNorms (eps 1e-6).

    Shapes: ``x [B, L, D]``, ``temb [B, D]``, ``key_mask [B, L] | None`` -> ``[B, L, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, eps = cfg.inner_dim, cfg.NORM_EPS
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.norm1 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.attn = _SelfAttention(cfg, f"{prefix}.attn", tp_rank, tp_size, dtype)
        self.norm2 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.ff = _SiluFeedForward(
            d, cfg.refiner_mlp_hidden, f"{prefix}.ff", tp_rank, tp_size, dtype
        )
        self.norm_out = nn.Module()
        self.norm_out.linear = ReplicatedLinear(d, 2 * d, prefix=f"{prefix}.norm_out.linear", **kw)

    def forward(self, x, temb, key_mask):
        gate_a, gate_f = self.norm_out.linear(F.silu(temb))[0].unsqueeze(1).chunk(2, dim=-1)
        x = x + self.attn(self.norm1(x), key_mask) * gate_a
        return x + self.ff(self.norm2(x)) * gate_f


class HunyuanVideo15TokenRefiner(nn.Module):
    """``context_embedder``: refines the Qwen2.5-VL text features (diffusers'
    ``HunyuanVideo15TokenRefiner``).

    ``pooled`` is the mean of the valid tokens (every token without a mask), computed in fp32 and
    cast back; ``temb = timestep_embedder(sinusoid(t)) + text_embedder(pooled)`` (SiLU MLPs, the
    sinusoid cast to the features' dtype); then ``proj_in`` and the refiner blocks, whose
    attention sees only the valid tokens as keys. (The reference also masks the padded queries;
    their outputs differ here, but the DiT zeroes and masks those tokens afterwards, so no
    valid token depends on them.)

    Shapes: ``x [B, L, text_embed_dim]``, ``t [B]``, ``mask [B, L] bool | None`` -> ``[B, L, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d = cfg.inner_dim
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.freq_dim = cfg.T_FREQ_DIM
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = TimestepEmbedding(
            cfg.T_FREQ_DIM, d, f"{prefix}.time_text_embed.timestep_embedder", **kw
        )
        self.time_text_embed.text_embedder = TimestepEmbedding(
            cfg.text_embed_dim, d, f"{prefix}.time_text_embed.text_embedder", **kw
        )
        self.proj_in = ReplicatedLinear(cfg.text_embed_dim, d, prefix=f"{prefix}.proj_in", **kw)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(
            _RefinerBlock(
                cfg, f"{prefix}.token_refiner.refiner_blocks.{i}", tp_rank, tp_size, dtype
            )
            for i in range(cfg.num_refiner_layers)
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None):
        if mask is None:
            pooled = x.mean(dim=1)
        else:
            m = mask.float().unsqueeze(-1)
            pooled = ((x * m).sum(dim=1) / m.sum(dim=1)).to(x.dtype)
        tte = self.time_text_embed
        temb = tte.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(pooled.dtype))
        temb = temb + tte.text_embedder(pooled)
        h = self.proj_in(x)[0]
        for block in self.token_refiner.refiner_blocks:
            h = block(h, temb, mask)
        return h


class HunyuanVideo15ByT5Projection(nn.Module):
    """``context_embedder_2``: ``linear_3(gelu(linear_2(gelu(linear_1(LayerNorm(x))))))`` with an
    affine LayerNorm (eps 1e-5) and exact GELU (diffusers' ``HunyuanVideo15ByT5TextProjection``).

    Shapes: ``[B, L2, text_embed_2_dim]`` -> ``[B, L2, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        i, h, d = cfg.text_embed_2_dim, cfg.BYT5_HIDDEN, cfg.inner_dim
        self.norm = nn.LayerNorm(i, dtype=kw.get("params_dtype"))
        self.linear_1 = ReplicatedLinear(i, h, prefix=f"{prefix}.linear_1", **kw)
        self.linear_2 = ReplicatedLinear(h, h, prefix=f"{prefix}.linear_2", **kw)
        self.linear_3 = ReplicatedLinear(h, d, prefix=f"{prefix}.linear_3", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.linear_1(self.norm(x))[0])
        h = F.gelu(self.linear_2(h)[0])
        return self.linear_3(h)[0]


class HunyuanVideo15ImageProjection(nn.Module):
    """``image_embedder``: ``norm_out(linear_2(gelu(linear_1(norm_in(x)))))``, affine LayerNorms
    (eps 1e-5), exact GELU (diffusers' ``HunyuanVideo15ImageProjection``).

    Shapes: ``[B, N_img, image_embed_dim]`` -> ``[B, N_img, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        i, d = cfg.image_embed_dim, cfg.inner_dim
        dtype = kw.get("params_dtype")
        self.norm_in = nn.LayerNorm(i, dtype=dtype)
        self.linear_1 = ReplicatedLinear(i, i, prefix=f"{prefix}.linear_1", **kw)
        self.linear_2 = ReplicatedLinear(i, d, prefix=f"{prefix}.linear_2", **kw)
        self.norm_out = nn.LayerNorm(d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.linear_1(self.norm_in(x))[0])
        return self.norm_out(self.linear_2(h)[0])
