"""The parts of the HunyuanVideo 1.0 DiT that are not the shared MM-DiT blocks: the patch
embedding, the conditioning embedder, the token refiner and the 3-D RoPE tables.

Follows diffusers 0.42.1 ``models/transformers/transformer_hunyuan_video.py``
(``HunyuanVideoPatchEmbed``, ``HunyuanVideoConditionEmbedding``, ``HunyuanVideoTokenRefiner`` and
its blocks, ``HunyuanVideoRotaryPosEmbed``); module names are diffusers' except the refiner's
fused ``attn.to_qkv`` (``attn.to_q|to_k|to_v``, shard ids ``"q"|"k"|"v"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoArchConfig, HunyuanVideoDims
from sglang.multimodal_gen.layers.attention import sdpa_bshd
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.mmdit import DualStreamBlock
from sglang.multimodal_gen.models.dits.common import tp_kwargs

__all__ = [
    "HunyuanVideoConditionEmbed",
    "HunyuanVideoPatchEmbed",
    "HunyuanVideoTokenRefiner",
    "hunyuan_video_dual_blocks",
    "hunyuan_video_rope",
    "trim_padding",
]


# ------------------------------------------------------------------------------- patch embed
class HunyuanVideoPatchEmbed(nn.Module):
    """The latent video cut into ``(p_t, p, p)`` patches and projected to ``D``: diffusers'
    ``HunyuanVideoPatchEmbed``, a ``Conv3d`` with kernel = stride = the patch, computed as the
    equal linear map on flattened patches (``proj``, a ``ReplicatedLinear`` ``[D, C * p_t * p *
    p]``; the checkpoint's 5-D conv weight ``[D, C, p_t, p, p]`` is flattened when loaded).

    Shapes: ``x [B, C, F, H, W]`` (``F``, ``H``, ``W`` divisible by the patch) -> ``[B, F/p_t *
    H/p * W/p, D]`` in the weight dtype, tokens in ``(frame, row, column)`` order.
    """

    def __init__(self, cfg: HunyuanVideoArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        self.patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
        self.proj = ReplicatedLinear(
            cfg.in_channels * cfg.patch_volume,
            cfg.inner_dim,
            bias=True,
            **tp_kwargs(f"{prefix}.proj", tp_rank, tp_size, dtype),
        )
        base = self.proj.weight.weight_loader

        def load_conv_weight(param, loaded, shard_id=None):
            t = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
            base(param, t.reshape(t.shape[0], -1), shard_id)

        self.proj.weight.weight_loader = load_conv_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        pt, ph, pw = self.patch
        x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)
        return self.proj(x)[0]


# ------------------------------------------------------------------------------ conditioning
class HunyuanVideoConditionEmbed(nn.Module):
    """``temb = MLP(sinusoid(t)) [+ MLP(sinusoid(guidance))] + MLP(pooled)``: diffusers'
    ``HunyuanVideoConditionEmbedding`` (``image_condition_type`` other than ``token_replace``),
    summed in its order ``(t + g) + pooled``; with ``guidance=False`` (no guidance embedder) it is
    ``CombinedTimestepTextProjEmbeddings``, the token refiner's embedder.

    Shapes: ``t [B]`` (the scheduler's timestep, 0..1000), ``pooled [B, pooled_dim]``,
    ``g [B] | None`` (the guidance scale already multiplied by 1000) -> ``[B, D]`` in the weight
    dtype. Sinusoids have 256 features (cos half first), cast to ``pooled.dtype``.
    """

    def __init__(self, dim: int, pooled_dim: int, guidance: bool, prefix: str, **kw):
        super().__init__()
        f = HunyuanVideoArchConfig.T_FREQ_DIM
        self.freq_dim = f
        self.timestep_embedder = TimestepEmbedding(f, dim, f"{prefix}.timestep_embedder", **kw)
        self.text_embedder = TimestepEmbedding(pooled_dim, dim, f"{prefix}.text_embedder", **kw)
        self.guidance_embedder = (
            TimestepEmbedding(f, dim, f"{prefix}.guidance_embedder", **kw) if guidance else None
        )

    def forward(self, t, pooled, g=None) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(pooled.dtype))
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(timestep_sinusoid(g, self.freq_dim).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


# ------------------------------------------------------------------------------ token refiner
class _SiluFeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="linear-silu")``: ``net.2(silu(net.0.proj(x)))``,
    ``net.0.proj`` column-parallel, ``net.2`` row-parallel (one all-reduce).

    Shapes: ``[..., dim]`` -> ``[..., dim]``.
    """

    def __init__(self, dim: int, hidden: int, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        proj = ColumnParallelLinear(
            dim, hidden, bias=True, **tp_kwargs(f"{prefix}.net.0.proj", tp_rank, tp_size, dtype)
        )
        out = RowParallelLinear(
            hidden,
            dim,
            bias=True,
            input_is_parallel=True,
            **tp_kwargs(f"{prefix}.net.2", tp_rank, tp_size, dtype),
        )
        net0 = nn.Module()
        net0.proj = proj
        self.net = nn.ModuleList([net0, nn.Identity(), out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.silu(self.net[0].proj(x)[0]))[0]


class _RefinerAttention(nn.Module):
    """The refiner's self-attention (diffusers ``Attention`` with ``AttnProcessor2_0``, no q/k
    norm) over the text tokens, heads split over TP, with the refiner's padding rule.

    The reference's mask is ``[B, 1, L, L]``: ``mask[i] & mask[j]``, in HunyuanVideo 1.0 with
    column 0 forced on (``first_key_always``; 1.5 does not force it). With it, a valid query
    attends to the valid keys and key 0 and a padded query to key 0 alone, whose output is
    exactly ``v[0]``: computed as one key-masked attention (valid keys + key 0) with the padded
    rows replaced by ``v[0]``, the same values. Without it, the keys are the valid tokens; the
    padded queries (which the reference leaves with no key at all) get the valid keys too: no
    valid token reads them (they are masked keys here, and the 1.5 DiT zeroes them afterwards).

    Shapes: ``x [B, L, D]``, ``mask [B, L] bool | None`` -> ``[B, L, D]`` (all-reduced over TP).
    """

    def __init__(
        self, cfg: HunyuanVideoDims, prefix: str, tp_rank, tp_size, dtype, first_key_always: bool
    ):
        super().__init__()
        self.first_key_always = first_key_always
        d, hd, heads = cfg.inner_dim, cfg.attention_head_dim, cfg.num_attention_heads
        self.head_dim = hd
        self.to_qkv = QKVParallelLinear(
            d, hd, heads, heads, bias=True, **tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype)
        )
        self.num_heads = self.to_qkv.num_heads
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.to_qkv(x)[0].unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        if mask is None:
            out = sdpa_bshd(q, k, v)
        elif not self.first_key_always:
            out = sdpa_bshd(q, k, v, mask)
        else:
            keys = mask.clone()
            keys[:, 0] = True
            out = sdpa_bshd(q, k, v, keys)
            out = torch.where(mask[:, :, None], out, v[:, :1].flatten(2).to(out.dtype))
        return self.to_out[0](out.to(q.dtype))[0]


class _RefinerBlock(nn.Module):
    """diffusers' ``HunyuanVideoIndividualTokenRefinerBlock`` (1.5's
    ``HunyuanVideo15IndividualTokenRefinerBlock`` is the same)::

        gate_a, gate_f = norm_out.linear(silu(temb))
        x = x + attn(LN1(x)) * gate_a
        x = x + ff(LN2(x)) * gate_f          # ff: linear -> SiLU -> linear

    ``norm1``/``norm2`` are affine LayerNorms (eps 1e-6). Shapes: ``x [B, L, D]``, ``temb [B, D]``,
    ``mask [B, L] bool | None`` -> ``[B, L, D]``.
    """

    def __init__(
        self, cfg: HunyuanVideoDims, prefix: str, tp_rank, tp_size, dtype, first_key_always: bool
    ):
        super().__init__()
        d, eps = cfg.inner_dim, cfg.NORM_EPS
        self.norm1 = nn.LayerNorm(d, eps=eps, elementwise_affine=True, dtype=dtype)
        self.attn = _RefinerAttention(
            cfg, f"{prefix}.attn", tp_rank, tp_size, dtype, first_key_always
        )
        self.norm2 = nn.LayerNorm(d, eps=eps, elementwise_affine=True, dtype=dtype)
        self.ff = _SiluFeedForward(
            d, cfg.refiner_mlp_hidden, f"{prefix}.ff", tp_rank, tp_size, dtype
        )
        norm_out = nn.Module()
        norm_out.linear = ReplicatedLinear(
            d, 2 * d, bias=True, **tp_kwargs(f"{prefix}.norm_out.linear", tp_rank, tp_size, dtype)
        )
        self.norm_out = norm_out

    def forward(self, x, temb, mask):
        attn = self.attn(self.norm1(x), mask)
        gate_a, gate_f = self.norm_out.linear(F.silu(temb))[0].chunk(2, dim=1)
        x = x + attn * gate_a.unsqueeze(1)
        return x + self.ff(self.norm2(x)) * gate_f.unsqueeze(1)


class HunyuanVideoTokenRefiner(nn.Module):
    """The text features' refiner (``context_embedder``): diffusers' ``HunyuanVideoTokenRefiner``
    and ``HunyuanVideo15TokenRefiner`` (the same modules and math but for the 1.0 attention's
    forced first key, ``first_key_always``).

    ``pooled`` = the mean of the text features over the valid tokens (fp32 sums, then the input
    dtype); ``temb = timestep_embedder(sinusoid(t)) + text_embedder(pooled)``
    (``time_text_embed``); the features go through ``proj_in`` and ``num_refiner_layers``
    refiner blocks (self-attention with the padding rule of :class:`_RefinerAttention`).

    Args:
        cfg: the DiT's config (1.0 or 1.5: ``inner_dim``, heads, ``text_embed_dim``,
            ``num_refiner_layers``, ``refiner_mlp_hidden``).
        first_key_always: HunyuanVideo 1.0's mask rule (key 0 attended by every query); 1.5's
            reference does not force it (``False``).

    Shapes: ``x [B, L, text_embed_dim]``, ``t [B]``, ``mask [B, L] | None`` (nonzero = valid;
    ``None``: all valid) -> ``[B, L, D]`` in the weight dtype.
    """

    def __init__(
        self,
        cfg: HunyuanVideoDims,
        prefix: str,
        tp_rank,
        tp_size,
        dtype,
        first_key_always: bool = True,
    ):
        super().__init__()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        d = cfg.inner_dim
        self.time_text_embed = HunyuanVideoConditionEmbed(
            d, cfg.text_embed_dim, False, f"{prefix}.time_text_embed", **kw
        )
        self.proj_in = ReplicatedLinear(
            cfg.text_embed_dim,
            d,
            bias=True,
            **tp_kwargs(f"{prefix}.proj_in", tp_rank, tp_size, dtype),
        )
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(
            _RefinerBlock(
                cfg,
                f"{prefix}.token_refiner.refiner_blocks.{i}",
                tp_rank,
                tp_size,
                dtype,
                first_key_always,
            )
            for i in range(cfg.num_refiner_layers)
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None):
        if mask is None:
            pooled = x.mean(dim=1)
        else:
            m = mask.float().unsqueeze(-1)
            pooled = ((x * m).sum(dim=1) / m.sum(dim=1)).to(x.dtype)
            mask = mask.to(x.device).bool()
        temb = self.time_text_embed(t, pooled)
        h = self.proj_in(x)[0]
        for block in self.token_refiner.refiner_blocks:
            h = block(h, temb, mask)
        return h


# ------------------------------------------------------------------------------ dual blocks
def hunyuan_video_dual_blocks(cfg: HunyuanVideoDims, tp_rank, tp_size, dtype) -> nn.ModuleList:
    """``transformer_blocks``: ``num_layers`` shared ``layers.mmdit.DualStreamBlock`` with
    HunyuanVideo's choices, the same in 1.0 and 1.5 (diffusers' ``HunyuanVideoTransformerBlock``
    and ``HunyuanVideo15TransformerBlock``): joint order ``[video, text]`` (RoPE on the video
    prefix), diffusers' RMSNorm on q/k, no fp16 clipping; heads and feed-forward width
    (``mlp_hidden``) split over TP. Forward: ``block(x, ctx, temb, (cos, sin), key_mask)``."""
    return nn.ModuleList(
        DualStreamBlock(
            cfg.inner_dim,
            cfg.attention_head_dim,
            cfg.num_attention_heads,
            cfg.mlp_hidden,
            cfg.NORM_EPS,
            qk_norm="diffusers",
            text_first=False,
            clip_fp16=False,
            prefix=f"transformer_blocks.{i}",
            tp_rank=tp_rank,
            tp_size=tp_size,
            dtype=dtype,
        )
        for i in range(cfg.num_layers)
    )


# ------------------------------------------------------------------------------------ padding
def trim_padding(x: torch.Tensor, mask: torch.Tensor | None):
    """``(x, mask)`` without the trailing positions that are padding in every item of the batch
    (the 1.0 and 1.5 DiTs' text streams; padding is at the end of each item).

    Masked keys weigh 0 in attention and the padded positions' own outputs are never read (1.0)
    or zeroed (1.5), so dropping them changes only which exact zeros the softmax sums, and a
    batch whose items have the same length runs without padding.

    Shapes: ``x [B, L, C]``, ``mask [B, L]`` (bool or 0/1, nonzero = real; ``None``: all real)
    -> ``x [B, L', C]`` and a bool ``[B, L']`` mask on ``x.device`` (``1 <= L' <= L``).
    """
    if mask is None:
        return x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    mask = mask.to(x.device).bool()
    real = mask.any(dim=0).nonzero()
    keep = int(real.max()) + 1 if real.numel() else 1
    return x[:, :keep], mask[:, :keep]


# ------------------------------------------------------------------------------------- RoPE
def hunyuan_video_rope(
    grid: tuple[int, int, int], axes_dim: tuple[int, ...], theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables of the video tokens: diffusers' ``HunyuanVideoRotaryPosEmbed`` (positions
    ``(frame, row, column)`` of the patch grid, one axis per ``axes_dim`` entry, built with
    ``get_1d_rotary_pos_embed(use_real=True)`` in fp32, not float64 as Flux's).

    Args:
        grid: ``(F', H', W')`` patches per axis; axes_dim: channels per axis (sum = head_dim);
        theta: RoPE base; device: where to build the tables.

    Returns:
        ``(cos, sin)`` each ``[F' * H' * W', head_dim / 2]`` fp32, one value per channel pair
        (``layers.rotary.apply_rope_real``), tokens in ``(frame, row, column)`` order.
    """
    axes = [torch.arange(n, dtype=torch.float32, device=device) for n in grid]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0).reshape(3, -1)
    cos_parts, sin_parts = [], []
    for i, dim in enumerate(axes_dim):
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        inv = 1.0 / (theta**exponents) / 1.0
        ang = torch.outer(pos[i], inv)
        cos_parts.append(ang.cos())
        sin_parts.append(ang.sin())
    return torch.cat(cos_parts, dim=1), torch.cat(sin_parts, dim=1)
