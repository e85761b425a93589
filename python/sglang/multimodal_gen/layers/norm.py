"""Normalization layers used by the DiTs, and the adaLN modulations built on them.

Follows diffusers 0.42.1 ``models/normalization.py``:

* ``RMSNorm``: the mean of squares is taken in fp32, the input is scaled by ``rsqrt(mean + eps)``
  (promoting to fp32), cast to the weight's dtype when that is half precision, then multiplied
  by the weight (diffusers' ``RMSNorm``);
* ``LayerNormNoAffine`` and ``FP32LayerNorm`` (diffusers' ``FP32LayerNorm``);
* ``RMSNormAcrossHeads`` (``qk_norm="rms_norm_across_heads"`` of the Wan and LTX-2 DiTs: one
  RMSNorm over every head's channels, with the heads split over tensor parallelism) and
  :func:`rms_norm_qk` (q and k with one all-reduce);
* :func:`modulate` (``x * (1 + scale) + shift``) and the adaLN modules that compute their
  ``shift``/``scale`` from a conditioning vector: ``AdaLayerNormZero`` (diffusers'
  ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle``) and ``AdaLayerNormContinuous``. Their
  linears are replicated ``ReplicatedLinear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_reduce,
)
from sglang.multimodal_gen.layers.linear import ReplicatedLinear

__all__ = [
    "AdaLayerNormContinuous",
    "AdaLayerNormZero",
    "FP32LayerNorm",
    "LayerNormNoAffine",
    "RMSNorm",
    "RMSNormAcrossHeads",
    "modulate",
    "rms_norm_qk",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (Zhang & Sennrich, 2019).

    Args:
        dim: size of the normalized (last) dimension.
        eps: added to the mean of squares before the reciprocal square root.
        elementwise_affine: learn a per-channel ``weight`` of shape ``[dim]`` (initialised to 1).

    Shapes:
        ``x``: ``[..., dim]`` any float dtype -> same shape. The output dtype is the weight's dtype
        when the weight is fp16/bf16, else the promotion of the input dtype with fp32 (as diffusers).
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        shape = (self.dim,)
        # Fused kernels where they give the reference's exact rounding: one rounding to x.dtype
        # (no weight, or fp32), then the half-precision weight product as the reference does.
        if w is None:
            return F.rms_norm(x, shape, None, self.eps)
        if x.dtype == w.dtype:
            if w.dtype in (torch.float16, torch.bfloat16):
                return F.rms_norm(x, shape, None, self.eps) * w
            return F.rms_norm(x, shape, w, self.eps)
        y = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        if w.dtype in (torch.float16, torch.bfloat16):
            y = y.to(w.dtype)
        return y * w

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


class LayerNormNoAffine(nn.Module):
    """``LayerNorm`` without learned scale/shift (``elementwise_affine=False``).

    Shapes: ``[..., dim]`` -> same shape and dtype. Computed by ``torch.nn.functional.layer_norm``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (self.dim,), eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class FP32LayerNorm(nn.Module):
    """Affine LayerNorm computed in fp32 with fp32 ``weight``/``bias`` ``[dim]`` (diffusers'
    ``FP32LayerNorm(elementwise_affine=True)``, ``normalization.py``; a model keeps it in fp32
    with its ``_keep_in_fp32_modules``, e.g. Wan's cross-attention norms).

    Shapes: ``x [..., dim]`` any float dtype -> same shape, in ``x.dtype``.
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


# ------------------------------------------------------------------------------ modulation
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation ``x * (1 + scale) + shift`` (the expression of diffusers' adaLN norms,
    ``normalization.py``, and of the DiT blocks that modulate their feed-forward input).

    Shapes: ``x [B, S, D]``; ``shift`` and ``scale`` broadcast against it (``[B, 1, D]`` for one
    vector per item, ``[B, S, D]`` per token); the result has the promoted dtype of the three
    (callers round it back where the reference does).
    """
    return x * (1 + scale) + shift


class AdaLayerNormZero(nn.Module):
    """adaLN-Zero: ``linear(silu(temb))`` gives ``n_chunks`` vectors of ``[B, D]``; the first two
    (shift, scale) modulate a LayerNorm (no affine) of ``x``.

    ``n_chunks=6``: diffusers' ``AdaLayerNormZero`` (``normalization.py``, the norms of an MMDiT
    double block), returns ``(x_mod, gate_msa, shift_mlp, scale_mlp, gate_mlp)``.
    ``n_chunks=3``: ``AdaLayerNormZeroSingle``, returns ``(x_mod, gate)``.

    Args:
        dim: ``D``.
        n_chunks: 6 or 3 (see above).
        eps: the LayerNorm's epsilon (1e-6 in diffusers).
        prefix: the module's dotted name (loading errors).
        **kw: passed to ``ReplicatedLinear`` (``tp_rank``, ``tp_size``, ``params_dtype``).

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
        x = modulate(self.norm(x), shift[:, None], scale[:, None])
        return (x, *rest)


class AdaLayerNormContinuous(nn.Module):
    """Output norm: ``scale, shift = linear(silu(temb))`` (in that order, unlike BFL's
    ``(shift, scale)``), ``LayerNorm(x) * (1 + scale) + shift`` (diffusers'
    ``AdaLayerNormContinuous(elementwise_affine=False, eps=1e-6)``, ``normalization.py``; the
    ``silu(temb)`` is cast to ``x.dtype`` before the linear, as there).

    Args:
        dim: ``D`` (the conditioning vector has the same width).
        eps: the LayerNorm's epsilon.
        prefix: the module's dotted name (loading errors).
        **kw: passed to ``ReplicatedLinear`` (``tp_rank``, ``tp_size``, ``params_dtype``).

    Shapes: ``x [B, S, D]``, ``temb [B, D]`` -> ``[B, S, D]``.
    """

    def __init__(self, dim: int, eps: float, prefix: str, **kw):
        super().__init__()
        self.linear = ReplicatedLinear(dim, 2 * dim, prefix=f"{prefix}.linear", **kw)
        self.norm = LayerNormNoAffine(dim, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype))[0].chunk(2, dim=1)
        return modulate(self.norm(x), shift[:, None, :], scale[:, None, :])


def _loaded_shape(t) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors lazy slice (``get_shape()``)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


# ------------------------------------------------------------------------------- q/k norm
class RMSNormAcrossHeads(nn.Module):
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
                f"RMSNormAcrossHeads({prefix or '<unnamed>'}): dim {dim} is not divisible by "
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
        if _loaded_shape(loaded) != (self.dim,):
            raise ValueError(
                f"{self.prefix}: norm weight has shape {list(_loaded_shape(loaded))}, expected "
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
    norm_q: RMSNormAcrossHeads,
    q: torch.Tensor,
    norm_k: RMSNormAcrossHeads,
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
