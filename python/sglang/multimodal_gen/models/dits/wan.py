"""The Wan2.1 / Wan2.2 video DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``WanTransformer3DModel`` (follows diffusers 0.42.1
``models/transformers/transformer_wan.py``; Wan-AI, "Wan: Open and Advanced Large-Scale Video
Generative Models", 2025), text-to-video only: a Conv3d patch embedding of the latent video, then
``num_layers`` blocks of

* self-attention over all video tokens with 3-axis RoPE (frames, rows, columns) and q/k RMSNorm
  over the whole ``inner_dim`` (all heads together),
* cross-attention to the projected text features (same q/k norm, no RoPE, no mask),
* a GELU(tanh) FFN,

modulated by the timestep embedding through a learned per-block ``scale_shift_table`` (adaLN
with shift/scale/gate for self-attention and FFN; the cross-attention is not modulated), then an
adaLN output norm, a linear head and unpatchify. Both Wan2.2 layouts use this class: the A14B
experts (Wan2.1 14B shapes) and TI2V-5B (``in_channels = out_channels = 48``, per-token
timesteps, see :meth:`WanTransformer.forward`).

Module names equal diffusers' (a diffusers state dict loads 1:1 through ``WAN_NAME_MAP`` in
``wan_names.py``) except two fused layers per block:

* ``blocks.N.attn1.to_qkv``: ``QKVParallelLinear`` from ``attn1.to_q/to_k/to_v`` (shard ids
  ``"q"``, ``"k"``, ``"v"``);
* ``blocks.N.attn2.to_kv``: ``MergedColumnParallelLinear`` ``[D, D]`` from ``attn2.to_k/to_v``
  (shard ids ``0``, ``1``); the cross-attention query ``attn2.to_q`` reads the video tokens, not
  the text, so it stays a separate ``ColumnParallelLinear``.

Tensor parallelism (``D = inner_dim``, ``n = tp_size``): attention heads are split over the ranks
(``attn1.to_qkv``, ``attn2.to_q``, ``attn2.to_kv`` column-parallel; ``attn1.to_out.0``,
``attn2.to_out.0`` row-parallel), FFN hidden units are split (``ffn.net.0.proj`` column,
``ffn.net.2`` row). The q/k RMSNorms normalise over all ``D`` channels, i.e. over heads that live
on other ranks: each rank sums the squares of its ``D / n`` channels in fp32, one all-reduce adds
the sums of q and k together (one collective per attention, not two), and each rank divides by
the full ``D`` (see :class:`WanRMSNormAcrossHeads`). Per block: two all-reduces of ``[B, S, 1]``
/ ``[B, L, 1]`` sums and three of ``[B, S, D]`` (the row-parallel outputs). The patch embedding,
condition embedder, ``scale_shift_table``s, norms and the head are replicated.

Dtypes: as diffusers' ``from_pretrained(torch_dtype=...)`` with ``_keep_in_fp32_modules``, the
timestep embedder (``condition_embedder.time_embedder``), every ``scale_shift_table`` and the
affine cross-attention norms (``blocks.N.norm2``) are kept in fp32 whatever ``dtype`` is; the
modulation arithmetic and the LayerNorms run in fp32, the rest in ``dtype``.
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
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.attention import attention, sdpa_bshd
from sglang.multimodal_gen.layers.feedforward import GeluTanhFeedForward
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import LayerNormNoAffine
from sglang.multimodal_gen.models.dits.flux_embed import timestep_sinusoid

__all__ = [
    "WanRMSNormAcrossHeads",
    "WanRotaryEmbed",
    "WanTransformer",
    "apply_wan_rope",
    "wan_from_diffusers_module",
]


def _tp_kwargs(prefix: str, tp_rank: int | None, tp_size: int | None, dtype) -> dict:
    return dict(prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)


def _shape(t) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors lazy slice."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


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
        if _shape(loaded) != (self.dim,):
            raise ValueError(
                f"{self.prefix}: norm weight has shape {list(_shape(loaded))}, expected "
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
    fp32, tokens in ``(frame, row, col)`` row-major order (the Conv3d's flatten order).
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


def apply_wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(a, b) -> (a cos - b sin, a sin + b cos)``.

    Args:
        x: ``[B, S, H, D]`` any float dtype.
        cos, sin: ``[S, D / 2]`` fp32 (from :class:`WanRotaryEmbed`), broadcast over batch and
            heads.

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``; the products and sums in fp32 (the tables' dtype), one
        rounding at the end: the reference's ``apply_rotary_emb`` in ``WanAttnProcessor``.
    """
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------- embeddings
class WanMLP(nn.Module):
    """``linear_2(act(linear_1(x)))`` on replicated layers.

    diffusers' ``TimestepEmbedding`` (``act="silu"``, the time embedder) and
    ``PixArtAlphaTextProjection(act_fn="gelu_tanh")`` (the text embedder).

    Shapes: ``x [..., in_features]`` -> ``[..., out_features]`` in the weight dtype.
    """

    def __init__(self, in_features: int, out_features: int, act: str, prefix: str, **kw):
        super().__init__()
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
        self.time_embedder = WanMLP(
            cfg.freq_dim, d, "silu", f"{prefix}.time_embedder", params_dtype=torch.float32, **kw
        )
        self.time_proj = ReplicatedLinear(
            d,
            cfg.MODULATION_CHUNKS * d,
            prefix=f"{prefix}.time_proj",
            params_dtype=dtype,
            **kw,
        )
        self.text_embedder = WanMLP(
            cfg.text_dim, d, "gelu_tanh", f"{prefix}.text_embedder", params_dtype=dtype, **kw
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


# ------------------------------------------------------------------------------- attention
class WanSelfAttention(nn.Module):
    """Self-attention with q/k RMSNorm across heads and RoPE (diffusers' ``attn1``:
    ``WanAttention`` + ``WanAttnProcessor``). Heads split over TP.

    Shapes: ``x [B, S, D]``, ``cos``/``sin`` ``[S, head_dim / 2]`` -> ``[B, S, D]``
    (all-reduced over TP).
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd, heads = cfg.inner_dim, cfg.attention_head_dim, cfg.num_attention_heads
        self.head_dim = hd
        self.to_qkv = QKVParallelLinear(
            d,
            hd,
            heads,
            heads,
            bias=True,
            **_tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype),
        )
        # local widths [D/n, D/n, D/n], fixed here so a LoRA wrapper replacing the layer is fine
        self.split_sizes = list(self.to_qkv.output_partition_sizes)
        self.norm_q = WanRMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_q", dtype)
        self.norm_k = WanRMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_k", dtype)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    d,
                    d,
                    bias=True,
                    input_is_parallel=True,
                    **_tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_qkv(x)[0].split(self.split_sizes, dim=-1)
        q, k = rms_norm_qk(self.norm_q, q, self.norm_k, k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        q = apply_wan_rope(q, cos, sin)
        k = apply_wan_rope(k, cos, sin)
        out = attention(q, k, v).type_as(q)
        return self.to_out[0](out)[0]


class WanCrossAttention(nn.Module):
    """Cross-attention of the video tokens to the text (diffusers' ``attn2``, text-to-video): q
    from ``x``, fused k|v from the text, q/k RMSNorm across heads, no RoPE, no mask. Heads split
    over TP.

    Shapes: ``x [B, S, D]``, ``ctx [B, L, D]`` -> ``[B, S, D]`` (all-reduced over TP).
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd = cfg.inner_dim, cfg.attention_head_dim
        self.head_dim = hd
        self.to_q = ColumnParallelLinear(
            d, d, bias=True, **_tp_kwargs(f"{prefix}.to_q", tp_rank, tp_size, dtype)
        )
        self.to_kv = MergedColumnParallelLinear(
            d, [d, d], bias=True, **_tp_kwargs(f"{prefix}.to_kv", tp_rank, tp_size, dtype)
        )
        self.kv_split_sizes = list(self.to_kv.output_partition_sizes)
        self.norm_q = WanRMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_q", dtype)
        self.norm_k = WanRMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_k", dtype)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    d,
                    d,
                    bias=True,
                    input_is_parallel=True,
                    **_tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q = self.to_q(x)[0]
        k, v = self.to_kv(ctx)[0].split(self.kv_split_sizes, dim=-1)
        q, k = rms_norm_qk(self.norm_q, q, self.norm_k, k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        out = sdpa_bshd(q, k, v).type_as(q)
        return self.to_out[0](out)[0]


# ------------------------------------------------------------------------------------ block
class WanFP32LayerNorm(nn.Module):
    """Affine LayerNorm computed in fp32 with fp32 ``weight``/``bias`` ``[dim]`` (diffusers'
    ``FP32LayerNorm(elementwise_affine=True)``, kept in fp32 as its ``_keep_in_fp32_modules``).

    Shapes: ``x [..., dim]`` -> same shape, in ``x.dtype``.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (self.dim,), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class WanBlock(nn.Module):
    """One Wan transformer block (diffusers' ``WanTransformerBlock``).

    With ``m = scale_shift_table + timestep_proj`` (fp32) split into ``shift_a, scale_a, gate_a,
    shift_f, scale_f, gate_f``::

        x = x + gate_a * attn1(LN(x) * (1 + scale_a) + shift_a)      # fp32 residual arithmetic
        x = x + attn2(norm2(x), text)                                 # norm2: affine LN or identity
        x = x + gate_f * ffn(LN(x) * (1 + scale_f) + shift_f)

    each modulated input and each residual sum rounded to ``x.dtype`` as the reference does.

    Shapes: ``x [B, S, D]``; ``ctx [B, L, D]``; ``timestep_proj [B, 6, D]`` (one timestep per
    item) or ``[B, S, 6, D]`` (per-token timesteps); ``cos``/``sin`` ``[S, head_dim / 2]`` ->
    ``[B, S, D]``.
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, eps = cfg.inner_dim, cfg.eps
        self.norm1 = LayerNormNoAffine(d, eps=eps)
        self.attn1 = WanSelfAttention(cfg, f"{prefix}.attn1", tp_rank, tp_size, dtype)
        self.attn2 = WanCrossAttention(cfg, f"{prefix}.attn2", tp_rank, tp_size, dtype)
        self.norm2 = WanFP32LayerNorm(d, eps) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = GeluTanhFeedForward(
            cfg.inner_dim, cfg.ffn_dim, f"{prefix}.ffn", tp_rank, tp_size, dtype
        )
        self.norm3 = LayerNormNoAffine(d, eps=eps)
        # fp32 like diffusers' _keep_in_fp32_modules ("scale_shift_table"); filled by the loader
        self.scale_shift_table = nn.Parameter(
            torch.zeros(1, cfg.MODULATION_CHUNKS, d, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x, ctx, timestep_proj, cos, sin):
        if timestep_proj.ndim == 4:  # per-token timesteps: [B, S, 6, D] -> six [B, S, D]
            mods = (self.scale_shift_table.unsqueeze(0) + timestep_proj.float()).chunk(6, dim=2)
            mods = [m.squeeze(2) for m in mods]
        else:  # [B, 6, D] -> six [B, 1, D]
            mods = (self.scale_shift_table + timestep_proj.float()).chunk(6, dim=1)
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mods

        h = (self.norm1(x.float()) * (1 + scale_a) + shift_a).type_as(x)
        x = (x.float() + self.attn1(h, cos, sin) * gate_a).type_as(x)

        h = self.norm2(x.float()).type_as(x)
        x = x + self.attn2(h, ctx)

        h = (self.norm3(x.float()) * (1 + scale_f) + shift_f).type_as(x)
        return (x.float() + self.ffn(h).float() * gate_f).type_as(x)


# ---------------------------------------------------------------------------------- model
class WanTransformer(nn.Module):
    """Wan2.1 / Wan2.2 text-to-video DiT (``WanTransformer3DModel``), tensor-parallel.

    Args:
        cfg: architecture (``transformer/config.json``; Wan2.2 A14B: also ``transformer_2``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``); the time embedder, the
            ``scale_shift_table``s and the cross-attention norms stay fp32 (see the module doc).
        device: where to allocate parameters.

    Raises:
        ValueError: ``num_attention_heads`` or ``ffn_dim`` not divisible by the TP size (the
            number and the size named).

    Parameters are allocated uninitialised (norm weights start at 1, ``scale_shift_table``s at
    0); load them with ``models.loader.load_tensors_into(..., WAN_NAME_MAP)`` or
    :func:`wan_from_diffusers_module`.
    """

    def __init__(
        self,
        cfg: WanArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        for what, n in (
            ("num_attention_heads", cfg.num_attention_heads),
            ("ffn_dim", cfg.ffn_dim),
        ):
            if n % tp:
                raise ValueError(
                    f"Wan: {what}={n} is not divisible by tp_size={tp}; use a TP size that "
                    f"divides both num_attention_heads={cfg.num_attention_heads} and "
                    f"ffn_dim={cfg.ffn_dim}"
                )
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        d = cfg.inner_dim
        with torch.device(device or "cpu"):
            self.rope = WanRotaryEmbed(
                cfg.attention_head_dim, cfg.rope_dims, cfg.rope_max_seq_len, cfg.ROPE_THETA
            )
            self.patch_embedding = nn.Conv3d(
                cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size, dtype=dtype
            )
            self.condition_embedder = WanConditionEmbedder(
                cfg, "condition_embedder", tp_rank, tp_size, dtype
            )
            self.blocks = nn.ModuleList(
                WanBlock(cfg, f"blocks.{i}", tp_rank, tp_size, dtype) for i in range(cfg.num_layers)
            )
            self.norm_out = LayerNormNoAffine(d, eps=cfg.eps)
            self.proj_out = ReplicatedLinear(
                d,
                cfg.out_features,
                prefix="proj_out",
                tp_rank=tp_rank,
                tp_size=tp_size,
                params_dtype=dtype,
            )
            self.scale_shift_table = nn.Parameter(
                torch.zeros(1, 2, d, dtype=torch.float32), requires_grad=False
            )
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Predict the flow for a latent video (diffusers' signature and numerics, text only).

        Args:
            hidden_states: ``[B, in_channels, F, H, W]`` latents; ``F``, ``H``, ``W`` divisible
                by ``patch_size`` and at most ``rope_max_seq_len`` patches per axis. Cast to the
                model dtype.
            timestep: the scheduler's timestep (``[0, 1000]``, any float/int dtype), either
                ``[B]`` (or ``[1]``, or a 0-d scalar: one value broadcast to the batch) or, for
                Wan2.2 TI2V-5B (``expand_timesteps``), ``[B, S]`` with one timestep per patch token
                (``S = F/p_t * H/p_h * W/p_w`` in frame-row-column order; ``[1, S]`` broadcasts).
            encoder_hidden_states: ``[B, L, text_dim]`` UMT5 features (the Wan pipelines pad to
                ``L = 512`` with zeros and attend to every position). Cast to the model dtype.

        Returns:
            ``[B, out_channels, F, H, W]`` in the model dtype (a tensor, not a tuple).

        Raises:
            ValueError: wrong ranks or channel counts, a size not divisible by the patch, a grid
                beyond the RoPE tables, or a timestep whose shape fits neither form.
        """
        cfg = self.cfg
        if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got "
                f"{list(hidden_states.shape)}"
            )
        b, _, f, h, w = hidden_states.shape
        p_t, p_h, p_w = cfg.patch_size
        if f % p_t or h % p_h or w % p_w:
            raise ValueError(
                f"latent size (F, H, W)=({f}, {h}, {w}) is not divisible by patch_size "
                f"{list(cfg.patch_size)}"
            )
        ppf, pph, ppw = f // p_t, h // p_h, w // p_w
        if max(ppf, pph, ppw) > cfg.rope_max_seq_len:
            raise ValueError(
                f"patch grid ({ppf}, {pph}, {ppw}) exceeds rope_max_seq_len={cfg.rope_max_seq_len}"
            )
        seq = ppf * pph * ppw
        if (
            encoder_hidden_states.ndim != 3
            or encoder_hidden_states.shape[0] != b
            or encoder_hidden_states.shape[2] != cfg.text_dim
        ):
            raise ValueError(
                f"encoder_hidden_states must be [{b}, L, {cfg.text_dim}], got "
                f"{list(encoder_hidden_states.shape)}"
            )
        if timestep.ndim == 0:
            timestep = timestep.reshape(1)
        per_token = timestep.ndim == 2
        if (
            timestep.ndim not in (1, 2)
            or timestep.shape[0] not in (1, b)
            or (per_token and timestep.shape[1] != seq)
        ):
            raise ValueError(
                f"timestep must be [{b}] or [{b}, {seq}] (one per patch token), got "
                f"{list(timestep.shape)}"
            )

        x = hidden_states.to(self.dtype)
        ctx = encoder_hidden_states.to(self.dtype)
        timestep = timestep.to(x.device)
        cos, sin = self.rope(ppf, pph, ppw, x.device)
        x = self.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()  # [B, S, D]

        temb, tproj, ctx = self.condition_embedder(
            timestep.flatten(), ctx, seq if per_token else None
        )
        # [B, S, 6, D] per token, else [B, 6, D]
        tproj = tproj.unflatten(2 if per_token else 1, (6, -1))
        # sequence parallelism: each rank keeps its chunk of the video tokens (identity without
        # SP); the text keys of the cross-attention stay whole on every rank
        xs = SeqSplit.of(seq)
        x = xs.local(x)
        cos, sin = xs.local(cos, 0), xs.local(sin, 0)
        if per_token:
            tproj, temb = xs.local(tproj), xs.local(temb)

        with sequence_split(xs):
            for block in self.blocks:
                x = block(x, ctx, tproj, cos, sin)

        if per_token:  # temb [B, S, D]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:  # temb [B, D]
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = xs.gather(self.proj_out(x)[0])  # [B, S, p_t * p_h * p_w * C_out]

        x = x.reshape(b, ppf, pph, ppw, p_t, p_h, p_w, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def wan_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> WanTransformer:
    """Our DiT with the weights of an in-memory diffusers ``WanTransformer3DModel`` (benchmarks
    and tests; the same name map and weight loaders as file loading, strict: every tensor of the
    reference is used and every parameter of ours is filled).

    ``dtype`` defaults to the dtype of the reference's first parameter (its patch embedding);
    the fp32-kept modules stay fp32 either way.
    """
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family

    spec = get_family("wan").denoiser()
    return denoiser_from_module(reference, spec, dtype, device, tp_rank, tp_size)
