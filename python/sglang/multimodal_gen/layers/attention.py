"""Attention over this rank's heads and, under sequence parallelism, its share of the tokens.

Heads are split over the TP ranks by the QKV projection; with TP alone attention needs no
communication. Under sequence parallelism (SP) each rank holds a chunk of the tokens
(``distributed.sequence``) and :func:`attention` brings it the keys it lacks:

* **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023): one all-to-all turns "my tokens, all heads"
  into "all tokens, my heads", the local kernel runs on the whole sequence, and a second
  all-to-all turns the output back. Any head count: when the Ulysses degree ``u`` does not
  divide the local heads ``H``, Ulysses rank ``i`` attends ``distributed.sequence.head_split(H,
  u)[i]`` heads (the first ``H % u`` ranks one more), so the busiest rank runs ``ceil(H / u)``
  heads where ``H / u`` would be ideal; layouts where ``u`` divides ``H`` are unchanged. Uneven
  chunks rather than zero padding heads (see ``distributed.sequence``): nothing is sent or
  computed for heads that do not exist.
* **Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): key/value blocks are
  passed around the ring while each rank attends its queries to the block it holds; block results
  are combined with the online-softmax rule (FlashAttention's log-sum-exp merge). Any degree.
* **USP** (Fang & Zhao 2024, "USP: a unified sequence parallelism approach"): Ulysses inside, ring
  across; the layout of ``parallel_state`` puts the Ulysses peers of a ring rank next to each
  other.

The kernel is ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks flash /
memory-efficient / math per device). Ring blocks also need the log-sum-exp, which the public API
does not return: ``_block_attention`` asks the CPU flash kernel or the CUDA memory-efficient kernel
for it and falls back to an explicit fp32 softmax.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sglang.multimodal_gen.distributed.parallel_state import (
    get_ring_group,
    get_ring_rank,
    get_ring_world_size,
    get_ulysses_group,
    get_ulysses_rank,
    get_ulysses_world_size,
)
from sglang.multimodal_gen.distributed.sequence import (
    active_split,
    gather_key_mask,
    heads_to_seq,
    seq_to_heads,
)

logger = logging.getLogger(__name__)


# --attention-backend: the SDPA kernels PyTorch may choose from (None: all, PyTorch's choice)
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
_CPU_BACKENDS = ("auto", "flash", "math")  # PyTorch's CPU SDPA has no efficient/cuDNN kernels
_SDPA_KERNELS: list | None = None


def check_attention_backend(name: str, device: torch.device | str = "cpu") -> str:
    """``name`` if ``device`` offers that SDPA backend (the CPU: ``auto``, ``flash``, ``math``).

    Raises:
        ValueError: an unknown name, or a backend the device does not have (the message names
            ``--attention-backend`` and the choices).
    """
    allowed = _CPU_BACKENDS if torch.device(device).type == "cpu" else ATTENTION_BACKENDS
    if name not in allowed:
        raise ValueError(
            f"--attention-backend {name!r} is not available on {torch.device(device).type}; "
            f"choose from {list(allowed)}"
        )
    return name


def set_attention_backend(name: str, device: torch.device | str = "cpu") -> None:
    """Restrict every local attention kernel call to one SDPA backend (process-wide).

    Args:
        name: ``auto`` (PyTorch picks per call: flash, memory-efficient, cuDNN or math),
            ``flash``, ``efficient``, ``cudnn`` or ``math``.
        device: the execution device (the CPU offers ``flash`` and ``math`` only).

    Raises:
        ValueError: as :func:`check_attention_backend`.
    """
    global _SDPA_KERNELS
    from torch.nn.attention import SDPBackend

    check_attention_backend(name, device)
    kernels = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    _SDPA_KERNELS = None if name == "auto" else [kernels[name]]


def _sdpa(q, k, v, attn_mask=None):
    if _SDPA_KERNELS is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_SDPA_KERNELS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def sdpa_bshd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention on ``[B, S, H, D]`` tensors, all local (no sequence parallelism).

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, H, D]``, same dtype.
        key_mask: optional ``[B, Sk]`` bool, True for keys that may be attended to (batch padding
            is False). ``None`` attends to every key.

    Returns:
        ``[B, Sq, H * D]`` in ``q.dtype``; softmax scale ``1 / sqrt(D)``.
    """
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention over the whole (possibly sequence-sharded) sequence.

    Without an active sequence split (``distributed.sequence.sequence_split``) or at SP degree 1
    this is :func:`sdpa_bshd`. Otherwise ``q``/``k``/``v`` hold this rank's chunk of the tokens
    and every query attends to the keys of all ranks.

    Args:
        q, k, v: ``[B, S_local, H, D]`` (RoPE already applied), same dtype.
        key_mask: optional ``[B, S_local]`` bool for this rank's keys.

    Returns:
        ``[B, S_local, H * D]`` in ``q.dtype``.

    Raises:
        ValueError: the chunk does not match the declared split, or the Ulysses degree does not
            divide the heads and ``q`` and ``k``/``v`` differ in head count (the uneven head
            split needs the same heads in all three).
    """
    split = active_split()
    if split is None or split.world == 1:
        return sdpa_bshd(q, k, v, key_mask)
    if q.shape[1] != split.sizes[split.rank]:
        raise ValueError(
            f"attention got {q.shape[1]} tokens but the sequence split gives this rank "
            f"{split.sizes[split.rank]}"
        )
    u = get_ulysses_world_size()
    heads = q.shape[2]
    if u > 1:
        uneven = heads % u or k.shape[2] % u or v.shape[2] % u
        if uneven and not heads == k.shape[2] == v.shape[2]:
            raise ValueError(
                f"{heads} query / {k.shape[2]} key / {v.shape[2]} value heads per rank: "
                f"ulysses_degree={u} splits uneven heads only when the three are equal"
            )
        sizes, group, me = split.ulysses_sizes(), get_ulysses_group(), get_ulysses_rank()
        q, k, v = (seq_to_heads(t, sizes, group, me) for t in (q, k, v))
        if key_mask is not None:
            key_mask = gather_key_mask(key_mask, sizes, group)
    if q.shape[2] == 0:
        # more Ulysses ranks than heads: this rank (and its whole ring group, which shares its
        # Ulysses rank) attends none; it still takes part in both all-to-alls
        out = q.new_empty(q.shape)
    elif get_ring_world_size() > 1:
        out = ring_attention(q, k, v, key_mask, split.ring_sizes())
    else:
        out = sdpa_bshd(q, k, v, key_mask).unflatten(-1, (q.shape[2], q.shape[3]))
    if u > 1:
        out = heads_to_seq(out, split.ulysses_sizes(), me, get_ulysses_group(), heads)
    return out.flatten(2)


# ------------------------------------------------------------------ ring attention
def _math_block(q, k, v, mask):
    """Explicit fp32 softmax attention: ``(out [B,H,Sq,D] fp32, lse [B,H,Sq] fp32)``."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v.float()), lse


_FAST_BLOCK_FAILED: set[str] = set()


def _block_attention(q, k, v, mask):
    """Attention of one key/value block with its log-sum-exp.

    Args: ``q [B,H,Sq,D]``, ``k``/``v [B,H,Sk,D]``, ``mask [B,Sk]`` bool or ``None``.
    Returns: ``(out [B,H,Sq,D], lse [B,H,Sq] fp32)``; rows whose block has no valid key get
    ``lse = -inf`` (so the merge gives them weight 0).
    """
    out = lse = None
    kind = q.device.type
    if kind not in _FAST_BLOCK_FAILED:
        try:
            bias = None
            if mask is not None:
                bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                bias = bias.masked_fill(~mask, float("-inf"))[:, None, None, :]
                bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            if kind == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, False, attn_mask=bias
                )[:2]
            elif kind == "cuda":
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, bias, True
                )[:2]
                lse = lse[..., : q.shape[2]]  # padded to a multiple of 32 queries
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
            _FAST_BLOCK_FAILED.add(kind)
            logger.warning("ring attention: fused block kernel unavailable on %s (%s)", kind, e)
            out = lse = None
    if out is None:
        return _math_block(q, k, v, mask)
    lse = lse.float()
    if mask is not None:  # the fused kernels report lse 0 for rows with no valid key
        lse = lse.masked_fill(~mask.any(-1)[:, None, None], float("-inf"))
    return out, lse


def _merge(out, lse, blk_out, blk_lse):
    """Online-softmax combination of two partial attentions over disjoint key sets."""
    if out is None:
        return blk_out.float(), blk_lse
    new = torch.logaddexp(lse, blk_lse)
    wa = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)  # nan where both are -inf
    wb = torch.exp(blk_lse - new).nan_to_num(0.0).unsqueeze(-1)
    return out * wa + blk_out.float() * wb, new


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    sizes: tuple[int, ...],
) -> torch.Tensor:
    """Ring attention over the ring group.

    Args:
        q, k, v: ``[B, sizes[me], H, D]`` this ring rank's tokens.
        key_mask: ``[B, sizes[me]]`` bool or ``None`` (travels with its keys).
        sizes: tokens held by each ring rank.

    Returns:
        ``[B, sizes[me], H, D]`` in ``q.dtype``. Each step sends this rank's current key/value
        block to the next rank while attending to it: ``R - 1`` exchanges of ``2 * B * S_k * H *
        D`` elements per rank.
    """
    group = get_ring_group()
    r, n = get_ring_rank(), get_ring_world_size()
    nxt = dist.get_global_rank(group, (r + 1) % n)
    prv = dist.get_global_rank(group, (r - 1) % n)
    qh = q.transpose(1, 2)
    kv = torch.stack([k, v]).transpose(2, 3).contiguous()  # [2, B, H, S, D]
    mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
    out = lse = None
    for step in range(n):
        reqs = []
        if step < n - 1:
            src = (r - step - 1) % n  # the owner of the block arriving now
            kv_in = kv.new_empty(*kv.shape[:3], sizes[src], kv.shape[-1])
            ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, kv_in, prv)]
            if mask is not None:
                m_in = mask.new_empty(mask.shape[0], sizes[src])
                ops += [dist.P2POp(dist.isend, mask, nxt), dist.P2POp(dist.irecv, m_in, prv)]
            reqs = dist.batch_isend_irecv(ops)
        blk = _block_attention(qh, kv[0], kv[1], None if mask is None else mask.bool())
        out, lse = _merge(out, lse, *blk)
        for req in reqs:
            req.wait()
        if step < n - 1:
            kv = kv_in
            mask = None if mask is None else m_in
    return out.transpose(1, 2).to(q.dtype)
