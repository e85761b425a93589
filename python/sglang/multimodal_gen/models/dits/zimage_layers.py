"""The Z-Image DiT's blocks: attention, SwiGLU feed-forward, the (optionally modulated) block, the
timestep embedder and the final layer, on our tensor-parallel layers.

Same numerics as diffusers 0.42.1 ``models/transformers/transformer_z_image.py``; the model
that assembles them, and its data flow, are in :mod:`sglang.multimodal_gen.models.dits.zimage`.
The shared pieces (RoPE, the timestep sinusoid, the norms) are in ``layers/``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.zimage import ZImageArchConfig
from sglang.multimodal_gen.layers.attention import attention
from sglang.multimodal_gen.layers.embeddings import timestep_sinusoid
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import LayerNormNoAffine, RMSNorm
from sglang.multimodal_gen.layers.rotary import apply_rope_complex
from sglang.multimodal_gen.models.dits.common import tp_kwargs

__all__ = [
    "FINAL_NORM_EPS",
    "QK_NORM_EPS",
    "ZImageAttention",
    "ZImageBlock",
    "ZImageFeedForward",
    "ZImageFinalLayer",
    "ZImageTimestepEmbedder",
]

QK_NORM_EPS = 1e-5  # the reference hard-codes this for the q/k RMSNorm (not ``norm_eps``)
FINAL_NORM_EPS = 1e-6


class ZImageAttention(nn.Module):
    """Self-attention with fused QKV, per-head q/k RMSNorm, 3-axis RoPE, heads split over TP.

    Shapes: ``x [B, S, dim]`` -> ``[B, S, dim]`` (all-reduced over TP).
    """

    def __init__(self, cfg: ZImageArchConfig, prefix: str, tp_rank=None, tp_size=None, dtype=None):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        # The reference builds K/V with n_heads heads (its n_kv_heads is unused).
        self.to_qkv = QKVParallelLinear(
            cfg.dim, hd, cfg.n_heads, cfg.n_heads, bias=False,
            **tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype),
        )  # fmt: skip
        self.num_heads = self.to_qkv.num_heads
        self.num_kv_heads = self.to_qkv.num_kv_heads
        self.split_sizes = [self.to_qkv.q_size, self.to_qkv.kv_size, self.to_qkv.kv_size]
        if cfg.qk_norm:
            self.norm_q = RMSNorm(hd, eps=QK_NORM_EPS)
            self.norm_k = RMSNorm(hd, eps=QK_NORM_EPS)
        else:
            self.norm_q = self.norm_k = None
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    cfg.dim,
                    cfg.dim,
                    bias=False,
                    input_is_parallel=True,
                    **tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )  # fmt: skip
            ]
        )

    def forward(self, x, cis, key_mask):
        qkv, _ = self.to_qkv(x)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.norm_q is not None:
            q = self.norm_q(q)
            k = self.norm_k(k)
        q = apply_rope_complex(q, cis)
        k = apply_rope_complex(k, cis)
        out = attention(q, k, v.to(q.dtype), key_mask).to(q.dtype)
        return self.to_out[0](out)[0]


class ZImageFeedForward(nn.Module):
    """SwiGLU FFN: ``w2(silu(w1 x) * w3 x)`` with ``w1``/``w3`` fused in ``w13``.

    Shapes: ``x [..., dim]`` -> ``[..., dim]`` (all-reduced over TP); hidden ``int(dim / 3 * 8)``.
    """

    def __init__(self, cfg: ZImageArchConfig, prefix: str, tp_rank=None, tp_size=None, dtype=None):
        super().__init__()
        h = cfg.ffn_hidden
        self.w13 = MergedColumnParallelLinear(
            cfg.dim, [h, h], bias=False, **tp_kwargs(f"{prefix}.w13", tp_rank, tp_size, dtype)
        )
        self.w2 = RowParallelLinear(
            h, cfg.dim, bias=False, input_is_parallel=True,
            **tp_kwargs(f"{prefix}.w2", tp_rank, tp_size, dtype),
        )  # fmt: skip

    def forward(self, x):
        gate_up, _ = self.w13(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)[0]


class ZImageBlock(nn.Module):
    """Sandwich-norm transformer block with optional tanh-gated adaLN modulation.

    With modulation (``adaln [B, adaln_dim]``)::

        scale_a, gate_a, scale_f, gate_f = Linear(adaln)           # no activation before it
        x = x + tanh(gate_a) * norm2(attn(norm1(x) * (1 + scale_a)))
        x = x + tanh(gate_f) * ffn_norm2(ffn(ffn_norm1(x) * (1 + scale_f)))

    Without modulation (caption refiner) the scales are 1 and the gates 1.
    Shapes: ``x [B, S, dim]``, ``cis [B, S, head_dim/2]`` complex64, ``key_mask [B, S] bool | None``.
    """

    def __init__(
        self,
        cfg: ZImageArchConfig,
        modulation: bool,
        prefix: str,
        tp_rank=None,
        tp_size=None,
        dtype=None,
    ):
        super().__init__()
        eps = cfg.norm_eps
        self.attention = ZImageAttention(cfg, f"{prefix}.attention", tp_rank, tp_size, dtype)
        self.feed_forward = ZImageFeedForward(
            cfg, f"{prefix}.feed_forward", tp_rank, tp_size, dtype
        )
        self.attention_norm1 = RMSNorm(cfg.dim, eps=eps)
        self.ffn_norm1 = RMSNorm(cfg.dim, eps=eps)
        self.attention_norm2 = RMSNorm(cfg.dim, eps=eps)
        self.ffn_norm2 = RMSNorm(cfg.dim, eps=eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.ModuleList(
                [
                    ReplicatedLinear(
                        cfg.adaln_dim,
                        4 * cfg.dim,
                        bias=True,
                        **tp_kwargs(f"{prefix}.adaLN_modulation.0", tp_rank, tp_size, dtype),
                    )  # fmt: skip
                ]
            )

    def forward(self, x, cis, key_mask, adaln=None):
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), cis, key_mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        mod = self.adaLN_modulation[0](adaln)[0].unsqueeze(1)
        scale_a, gate_a, scale_f, gate_f = mod.chunk(4, dim=2)
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_a), cis, key_mask)
        x = x + gate_a.tanh() * self.attention_norm2(attn)
        ffn = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_f))
        return x + gate_f.tanh() * self.ffn_norm2(ffn)


class ZImageTimestepEmbedder(nn.Module):
    """Sinusoidal timestep features (256: cos half then sin half, period 10000; the shared
    :func:`~sglang.multimodal_gen.layers.embeddings.timestep_sinusoid`, which is the reference's
    ``TimestepEmbedder.timestep_embedding``) -> MLP ``mlp.0`` / SiLU / ``mlp.2``.

    Shapes: ``t [B]`` (already multiplied by ``t_scale``) -> ``[B, adaln_dim]`` in the weight dtype.
    """

    def __init__(self, cfg: ZImageArchConfig, prefix: str, tp_rank=None, tp_size=None, dtype=None):
        super().__init__()
        self.freq_dim = cfg.T_FREQ_DIM
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.mlp = nn.ModuleList(
            [
                ReplicatedLinear(self.freq_dim, cfg.T_MID_DIM, prefix=f"{prefix}.mlp.0", **kw),
                nn.SiLU(),
                ReplicatedLinear(cfg.T_MID_DIM, cfg.adaln_dim, prefix=f"{prefix}.mlp.2", **kw),
            ]
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = timestep_sinusoid(t, self.freq_dim).to(self.mlp[0].dtype)
        h = self.mlp[0](h)[0]
        return self.mlp[2](self.mlp[1](h))[0]


class ZImageFinalLayer(nn.Module):
    """LayerNorm (no affine, eps 1e-6) scaled by ``1 + Linear(silu(adaln))``, then Linear.

    Shapes: ``x [B, S, dim]``, ``adaln [B, adaln_dim]`` -> ``[B, S, out_features]``.
    """

    def __init__(self, cfg: ZImageArchConfig, out_features: int, prefix: str, **kw):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.dim, eps=FINAL_NORM_EPS)
        self.linear = ReplicatedLinear(cfg.dim, out_features, prefix=f"{prefix}.linear", **kw)
        self.adaLN_modulation = nn.ModuleList(
            [
                nn.SiLU(),
                ReplicatedLinear(
                    cfg.adaln_dim, cfg.dim, prefix=f"{prefix}.adaLN_modulation.1", **kw
                ),
            ]
        )

    def forward(self, x, adaln):
        scale = 1.0 + self.adaLN_modulation[1](self.adaLN_modulation[0](adaln))[0]
        return self.linear(self.norm_final(x) * scale.unsqueeze(1))[0]
