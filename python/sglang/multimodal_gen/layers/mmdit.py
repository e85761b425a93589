"""Dual-stream (MM-DiT) and single-stream transformer blocks, tensor-parallel.

The two block kinds of the Flux.1 / HunyuanVideo family of DiTs (Esser et al. 2024, "Scaling
Rectified Flow Transformers", for the dual-stream MM-DiT block; the single-stream block with
parallel attention and MLP from one fused input projection is Black Forest Labs' Flux.1):

* :class:`DualStreamBlock`: image (video) tokens ``x`` and text tokens ``ctx`` keep separate
  weights (adaLN-Zero modulation, fused QKV, per-head q/k RMSNorm, output projection, GELU-tanh
  FFN) and attend together over one joint sequence;
* :class:`SingleStreamBlock`: one weight set over the joint sequence, with ``[q | k | v | mlp]``
  from one fused projection and ``proj_out([attention | gelu_tanh(mlp)])``.

What differs between the models is a parameter, not a copy:

==========================  ==============================  ===================================
                            Flux.1 (diffusers                HunyuanVideo 1.0 (diffusers
                            ``transformer_flux.py``)         ``transformer_hunyuan_video.py``)
==========================  ==============================  ===================================
joint order                 ``[text, image]``                ``[video, text]``
(``text_first``)
RoPE                        every token (text ids)           the video tokens only
q/k RMSNorm (``qk_norm``)   ``torch.nn.RMSNorm``             diffusers' ``RMSNorm``
                            (``"torch"``)                    (``"diffusers"``)
attention mask              none                             text padding (a key mask)
fp16 clipping               text after a dual block, the     none
(``clip_fp16``)             sequence after a single block
==========================  ==============================  ===================================

RoPE rule: the ``(cos, sin)`` tables given to a block cover the *first* ``cos.shape[0]`` tokens
of the joint sequence; the rest are not rotated. Flux passes tables for the whole ``[text,
image]`` sequence, HunyuanVideo for the video prefix of ``[video, text]``.

Module names are diffusers' (so checkpoints and LoRA files load through the models' name maps)
except the fused layers: ``attn.to_qkv`` (``attn.to_q|to_k|to_v``), ``attn.to_added_qkv``
(``attn.add_q_proj|add_k_proj|add_v_proj``) and, in a single block, ``to_qkv_mlp``
(``attn.to_q|to_k|to_v`` + ``proj_mlp``).

Tensor parallelism (``n = tp_size``): heads are split over the ranks (each attends with its
``heads / n`` heads over the whole joint sequence), FFN hidden units are split (column-parallel
in, row-parallel out), and a single block's rank ``r`` holds ``[q_r | k_r | v_r | mlp_r]`` and
feeds ``[attn_r | gelu(mlp_r)]`` to ``proj_out``, a ``RowParallelLinear`` with
``input_sizes=[D, mlp_hidden]``. One all-reduce per row-parallel layer (four per dual block, one
per single block); the adaLN linears are replicated. Under sequence parallelism the blocks see
this rank's chunk of each stream and ``layers.attention.attention`` brings the other ranks' keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.layers.attention import attention
from sglang.multimodal_gen.layers.feedforward import GeluTanhFeedForward
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import AdaLayerNormZero, LayerNormNoAffine, RMSNorm, modulate
from sglang.multimodal_gen.layers.rotary import apply_rope_real

__all__ = [
    "DualStreamBlock",
    "JointAttention",
    "QK_NORMS",
    "SingleStreamAttention",
    "SingleStreamBlock",
    "apply_rope_prefix",
    "qk_rms_norm",
]

FP16_MAX = 65504.0
QK_NORMS = ("torch", "diffusers")

Rope = tuple[torch.Tensor, torch.Tensor]


def _kw(prefix: str, tp_rank, tp_size, dtype) -> dict:
    return dict(prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)


def qk_rms_norm(kind: str, head_dim: int, eps: float) -> nn.Module:
    """Per-head RMSNorm over ``head_dim`` with a learned weight (initialised to 1).

    Args:
        kind: ``"torch"``: ``torch.nn.RMSNorm`` (Flux's ``FluxAttention``; its fused kernel
            multiplies by the weight before the single rounding to a half-precision input);
            ``"diffusers"``: :class:`~sglang.multimodal_gen.layers.norm.RMSNorm`, diffusers'
            ``RMSNorm`` (``Attention(qk_norm="rms_norm")``, HunyuanVideo). Same values in fp32.
        head_dim, eps: the normalized size and the epsilon.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "torch":
        return nn.RMSNorm(head_dim, eps=eps, elementwise_affine=True)
    if kind == "diffusers":
        return RMSNorm(head_dim, eps=eps, elementwise_affine=True)
    raise ValueError(f"qk_norm={kind!r} is not one of {QK_NORMS}")


def apply_rope_prefix(x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """RoPE on the first ``cos.shape[0]`` tokens of ``x`` (all of them when the tables cover the
    sequence), the others unchanged.

    Shapes: ``x [B, S, H, hd]``; ``rope = (cos, sin)`` each ``[n <= S, hd / 2]`` fp32 or ``None``
    (no rotation) -> ``[B, S, H, hd]`` in ``x.dtype`` (see ``layers.rotary.apply_rope_real``).
    """
    if rope is None:
        return x
    cos, sin = rope
    n = cos.shape[0]
    if n == x.shape[1]:
        return apply_rope_real(x, cos, sin)
    return torch.cat([apply_rope_real(x[:, :n], cos, sin), x[:, n:]], dim=1)


# ------------------------------------------------------------------------------- dual stream
class JointAttention(nn.Module):
    """Joint attention of a dual-stream block: image and text tokens have their own fused QKV,
    per-head RMSNorms and output projections and attend together over one joint sequence
    (diffusers' ``FluxAttention`` + ``FluxAttnProcessor``, ``Attention(added_kv_proj_dim)`` +
    ``HunyuanVideoAttnProcessor2_0``). Heads are split over TP.

    Args:
        dim: model width ``D``; head_dim, heads: ``D = heads * head_dim``.
        eps: q/k RMSNorm epsilon; qk_norm: see :func:`qk_rms_norm`.
        text_first: the joint order (``[text, image]`` if True, else ``[image, text]``).
        prefix, tp_rank, tp_size, dtype: as every ``ParallelLinear``.

    Shapes: ``x [B, S_img, D]``, ``ctx [B, S_txt, D]``, ``rope`` for the first tokens of the joint
    sequence (:func:`apply_rope_prefix`), ``key_mask [B, S_txt + S_img]`` bool in joint order or
    ``None`` -> ``(x_out [B, S_img, D], ctx_out [B, S_txt, D])`` (all-reduced over TP).
    """

    def __init__(
        self,
        dim: int,
        head_dim: int,
        heads: int,
        eps: float,
        qk_norm: str,
        text_first: bool,
        prefix: str,
        tp_rank=None,
        tp_size=None,
        dtype=None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.text_first = text_first
        self.to_qkv = QKVParallelLinear(
            dim,
            head_dim,
            heads,
            heads,
            bias=True,
            **_kw(f"{prefix}.to_qkv", tp_rank, tp_size, dtype),
        )
        self.to_added_qkv = QKVParallelLinear(
            dim,
            head_dim,
            heads,
            heads,
            bias=True,
            **_kw(f"{prefix}.to_added_qkv", tp_rank, tp_size, dtype),
        )
        self.num_heads = self.to_qkv.num_heads
        self.norm_q = qk_rms_norm(qk_norm, head_dim, eps)
        self.norm_k = qk_rms_norm(qk_norm, head_dim, eps)
        self.norm_added_q = qk_rms_norm(qk_norm, head_dim, eps)
        self.norm_added_k = qk_rms_norm(qk_norm, head_dim, eps)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    dim,
                    dim,
                    bias=True,
                    input_is_parallel=True,
                    **_kw(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )
        self.to_add_out = RowParallelLinear(
            dim,
            dim,
            bias=True,
            input_is_parallel=True,
            **_kw(f"{prefix}.to_add_out", tp_rank, tp_size, dtype),
        )

    def _heads(self, layer: nn.Module, x: torch.Tensor):
        """Fused projection -> ``q, k, v`` each ``[B, S, heads_local, hd]``."""
        qkv = layer(x)[0].unflatten(-1, (3, self.num_heads, self.head_dim))
        return qkv.unbind(-3)

    def _joint(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return torch.cat([txt, img] if self.text_first else [img, txt], dim=1)

    def forward(self, x, ctx, rope: Rope | None = None, key_mask: torch.Tensor | None = None):
        q, k, v = self._heads(self.to_qkv, x)
        cq, ck, cv = self._heads(self.to_added_qkv, ctx)
        q = apply_rope_prefix(self._joint(self.norm_q(q), self.norm_added_q(cq)), rope)
        k = apply_rope_prefix(self._joint(self.norm_k(k), self.norm_added_k(ck)), rope)
        v = self._joint(v, cv)
        out = attention(q, k, v, key_mask).to(q.dtype)
        n_txt, n_img = ctx.shape[1], x.shape[1]
        if self.text_first:
            ctx_out, x_out = out[:, :n_txt], out[:, n_txt:]
        else:
            x_out, ctx_out = out[:, :n_img], out[:, n_img:]
        return self.to_out[0](x_out.contiguous())[0], self.to_add_out(ctx_out.contiguous())[0]


class DualStreamBlock(nn.Module):
    """Dual-stream (MM-DiT) block: diffusers' ``FluxTransformerBlock`` and
    ``HunyuanVideoTransformerBlock``.

    For each stream ``s`` in (image ``x``, text ``ctx``), with ``m_s = norm1[_context].linear(
    silu(temb))`` split into ``shift_a, scale_a, gate_a, shift_f, scale_f, gate_f``::

        attn_x, attn_ctx = joint_attention(LN(x) * (1 + scale_a) + shift_a, same for ctx)
        s = s + gate_a * attn_s
        s = s + gate_f * ff_s(LN(s) * (1 + scale_f) + shift_f)

    Args:
        dim, head_dim, heads, mlp_hidden: widths (``dim = heads * head_dim``).
        eps: LayerNorm and q/k RMSNorm epsilon.
        qk_norm, text_first: see :class:`JointAttention`.
        clip_fp16: clip the text stream to the fp16 range after the block when it is fp16
            (Flux's reference does).
        prefix, tp_rank, tp_size, dtype: as every ``ParallelLinear``.

    Shapes: ``x [B, S_img, D]``, ``ctx [B, S_txt, D]``, ``temb [B, D]``, ``rope``/``key_mask`` as
    :class:`JointAttention` -> ``(x, ctx)`` same shapes and dtype.

    Raises:
        ValueError: at construction, heads or ``mlp_hidden`` not divisible by the TP size.
    """

    def __init__(
        self,
        dim: int,
        head_dim: int,
        heads: int,
        mlp_hidden: int,
        eps: float,
        qk_norm: str,
        text_first: bool,
        clip_fp16: bool,
        prefix: str,
        tp_rank=None,
        tp_size=None,
        dtype=None,
    ):
        super().__init__()
        self.clip_fp16 = clip_fp16
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.norm1 = AdaLayerNormZero(dim, 6, eps, f"{prefix}.norm1", **kw)
        self.norm1_context = AdaLayerNormZero(dim, 6, eps, f"{prefix}.norm1_context", **kw)
        self.attn = JointAttention(
            dim,
            head_dim,
            heads,
            eps,
            qk_norm,
            text_first,
            f"{prefix}.attn",
            tp_rank,
            tp_size,
            dtype,
        )
        self.norm2 = LayerNormNoAffine(dim, eps=eps)
        self.ff = GeluTanhFeedForward(dim, mlp_hidden, f"{prefix}.ff", tp_rank, tp_size, dtype)
        self.norm2_context = LayerNormNoAffine(dim, eps=eps)
        self.ff_context = GeluTanhFeedForward(
            dim, mlp_hidden, f"{prefix}.ff_context", tp_rank, tp_size, dtype
        )

    def forward(self, x, ctx, temb, rope: Rope | None = None, key_mask=None):
        nx, gate_a, shift_f, scale_f, gate_f = self.norm1(x, temb)
        nc, c_gate_a, c_shift_f, c_scale_f, c_gate_f = self.norm1_context(ctx, temb)
        attn_x, attn_c = self.attn(nx, nc, rope, key_mask)

        x = x + gate_a.unsqueeze(1) * attn_x
        h = modulate(self.norm2(x), shift_f[:, None], scale_f[:, None])
        x = x + gate_f.unsqueeze(1) * self.ff(h)

        ctx = ctx + c_gate_a.unsqueeze(1) * attn_c
        h = modulate(self.norm2_context(ctx), c_shift_f[:, None], c_scale_f[:, None])
        ctx = ctx + c_gate_f.unsqueeze(1) * self.ff_context(h)
        if self.clip_fp16 and ctx.dtype == torch.float16:
            ctx = ctx.clip(-FP16_MAX, FP16_MAX)
        return x, ctx


# ----------------------------------------------------------------------------- single stream
class SingleStreamAttention(nn.Module):
    """The attention core of a single-stream block: per-head q/k RMSNorm, RoPE on the leading
    tokens, attention over the local heads. Its projections live in the block's fused
    ``to_qkv_mlp``; only ``norm_q``/``norm_k`` are parameters here (diffusers' ``attn.norm_q`` /
    ``attn.norm_k`` of a ``pre_only`` attention).

    Shapes: ``q, k, v [B, S, heads_local, hd]``, ``rope`` as :func:`apply_rope_prefix`,
    ``key_mask [B, S] | None`` -> ``[B, S, heads_local * hd]`` in ``q.dtype``.
    """

    def __init__(self, head_dim: int, eps: float, qk_norm: str):
        super().__init__()
        self.norm_q = qk_rms_norm(qk_norm, head_dim, eps)
        self.norm_k = qk_rms_norm(qk_norm, head_dim, eps)

    def forward(self, q, k, v, rope: Rope | None = None, key_mask=None):
        q = apply_rope_prefix(self.norm_q(q), rope)
        k = apply_rope_prefix(self.norm_k(k), rope)
        return attention(q, k, v, key_mask).to(q.dtype)


class SingleStreamBlock(nn.Module):
    """Single-stream block with parallel attention and MLP: diffusers'
    ``FluxSingleTransformerBlock`` and ``HunyuanVideoSingleTransformerBlock``.

    With ``shift, scale, gate = norm.linear(silu(temb))`` and ``h = LN(x) * (1 + scale) + shift``::

        q | k | v | m = to_qkv_mlp(h)                        # [D, D, D, mlp_hidden] (local parts)
        x = x + gate * proj_out([attention(q, k, v) | gelu_tanh(m)])

    Args:
        dim, head_dim, mlp_hidden, eps, qk_norm: as :class:`DualStreamBlock` (heads =
            ``dim / head_dim``).
        clip_fp16: clip the output to the fp16 range when it is fp16 (Flux's reference does).
        prefix, tp_rank, tp_size, dtype: as every ``ParallelLinear``.

    Shapes: ``x [B, S, D]`` (the joint sequence in the model's order), ``temb [B, D]``, ``rope``
    for its leading tokens, ``key_mask [B, S] | None`` -> ``[B, S, D]``.
    """

    def __init__(
        self,
        dim: int,
        head_dim: int,
        mlp_hidden: int,
        eps: float,
        qk_norm: str,
        clip_fp16: bool,
        prefix: str,
        tp_rank=None,
        tp_size=None,
        dtype=None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.clip_fp16 = clip_fp16
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.norm = AdaLayerNormZero(dim, 3, eps, f"{prefix}.norm", **kw)
        self.to_qkv_mlp = MergedColumnParallelLinear(
            dim,
            [dim, dim, dim, mlp_hidden],
            bias=True,
            **_kw(f"{prefix}.to_qkv_mlp", tp_rank, tp_size, dtype),
        )
        # local section widths [D/n, D/n, D/n, mlp_hidden/n], fixed at construction so a LoRA
        # wrapper that replaces the module later does not matter
        self.split_sizes = list(self.to_qkv_mlp.output_partition_sizes)
        self.attn = SingleStreamAttention(head_dim, eps, qk_norm)
        self.proj_out = RowParallelLinear(
            dim + mlp_hidden,
            dim,
            bias=True,
            input_is_parallel=True,
            input_sizes=[dim, mlp_hidden],
            **_kw(f"{prefix}.proj_out", tp_rank, tp_size, dtype),
        )

    def forward(self, x, temb, rope: Rope | None = None, key_mask=None):
        hx, gate = self.norm(x, temb)
        q, k, v, m = self.to_qkv_mlp(hx)[0].split(self.split_sizes, dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        attn = self.attn(q, k, v, rope, key_mask)
        mlp = F.gelu(m, approximate="tanh")
        x = x + gate.unsqueeze(1) * self.proj_out(torch.cat([attn, mlp], dim=2))[0]
        if self.clip_fp16 and x.dtype == torch.float16:
            x = x.clip(-FP16_MAX, FP16_MAX)
        return x
