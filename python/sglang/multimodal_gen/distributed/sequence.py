"""Sequence parallelism: how a token sequence is split over the SP group, and the collectives that
move it (Ulysses all-to-all, ring exchange, final gather).

A DiT shards each token stream (image tokens, text tokens) over the SP group right after its
embedding: SP rank ``j`` holds a contiguous chunk of ``sizes[j]`` tokens, with ``torch.
tensor_split``'s rule (the first ``n % sp`` ranks hold one token more), so no padding and no extra
attention mask is ever needed. Per-token work (linear layers, norms, modulation, RoPE) then runs on
the chunk alone; only attention needs the other ranks' tokens (``layers.attention.attention``),
and the output is gathered once before unpatchifying. When several streams are concatenated on
each rank (joint attention: ``[text chunk, image chunk]``), the split of the concatenation is the
element-wise sum of the streams' splits (``split_a + split_b``); non-causal attention does not
depend on the order of its keys, so the interleaving of chunks across ranks is harmless.

The model announces the split of the sequence its attention layers see with
:func:`sequence_split` (a context manager), because an uneven chunk's size alone does not tell a
rank what the others hold.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang.multimodal_gen.distributed.parallel_state import (
    get_ring_world_size,
    get_sp_group,
    get_sp_rank,
    get_sp_world_size,
    get_ulysses_world_size,
)


def even_split(n: int, parts: int) -> tuple[int, ...]:
    """Chunk sizes of ``n`` tokens over ``parts`` ranks (``torch.tensor_split``'s rule)."""
    q, r = divmod(int(n), int(parts))
    return tuple(q + (1 if i < r else 0) for i in range(parts))


@dataclass(frozen=True)
class SeqSplit:
    """A sequence of ``sum(sizes)`` tokens split over the SP group; this rank holds chunk ``rank``.

    Attributes:
        sizes: tokens per SP rank (SP rank ``ring_rank * ulysses_degree + ulysses_rank``).
        rank: this process's SP rank.
    """

    sizes: tuple[int, ...]
    rank: int = 0

    @classmethod
    def of(cls, n: int) -> SeqSplit:
        """The split of ``n`` tokens over the current SP group (one chunk when SP is off)."""
        return cls(even_split(n, get_sp_world_size()), get_sp_rank())

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    def __add__(self, other: SeqSplit) -> SeqSplit:
        if self.world != other.world or self.rank != other.rank:
            raise ValueError("splits over different SP groups cannot be concatenated")
        return SeqSplit(tuple(a + b for a, b in zip(self.sizes, other.sizes)), self.rank)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunk of the full ``x`` (``x.shape[dim] == total``): a view, no copy."""
        if x.shape[dim] != self.total:
            raise ValueError(
                f"cannot shard a sequence of {x.shape[dim]} tokens with a split of {self.total}"
            )
        if self.world == 1:
            return x
        return x.narrow(dim, self.offset, self.sizes[self.rank])

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's chunk (the inverse of :meth:`local`).

        Args:
            x: this rank's chunk, ``x.shape[dim] == sizes[rank]``; other dims equal on all ranks.

        Returns:
            ``[..., total, ...]`` in rank order. One all-gather over the SP group (chunks padded
            to the largest, then trimmed).
        """
        if self.world == 1:
            return x
        dim = dim % x.ndim
        m = max(self.sizes)
        if x.shape[dim] < m:
            pad = list(x.shape)
            pad[dim] = m - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=get_sp_group())
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, self.sizes)], dim)

    # ---- the sub-splits the attention collectives work on (USP: ulysses inside ring)
    def ulysses_sizes(self) -> tuple[int, ...]:
        """Chunk sizes of this rank's Ulysses peers (same ring rank), in Ulysses-rank order."""
        u = get_ulysses_world_size()
        base = (self.rank // u) * u
        return self.sizes[base : base + u]

    def ring_sizes(self) -> tuple[int, ...]:
        """Tokens per ring rank after the Ulysses exchange (each ring rank holds its Ulysses
        peers' chunks together)."""
        u = get_ulysses_world_size()
        return tuple(sum(self.sizes[i * u : (i + 1) * u]) for i in range(get_ring_world_size()))


_STATE = threading.local()


@contextmanager
def sequence_split(split: SeqSplit | None) -> Iterator[None]:
    """Declare the split of the sequence that attention layers see inside the block."""
    prev = getattr(_STATE, "split", None)
    _STATE.split = split
    try:
        yield
    finally:
        _STATE.split = prev


def active_split() -> SeqSplit | None:
    """The split declared by the innermost :func:`sequence_split` (``None`` outside)."""
    return getattr(_STATE, "split", None)


# ------------------------------------------------------------------ Ulysses all-to-all
def head_split(heads: int, ulysses: int) -> tuple[int, ...]:
    """Heads each Ulysses rank attends over: ``heads / ulysses`` each when that divides, else
    :func:`even_split`'s rule (the first ``heads % ulysses`` ranks take one head more; a rank may
    take none when ``ulysses > heads``). Rank ``i`` takes the contiguous heads starting at
    ``sum(head_split(...)[:i])``.
    """
    return even_split(heads, ulysses)


def seq_to_heads(
    x: torch.Tensor,
    sizes: tuple[int, ...],
    group: dist.ProcessGroup | None,
    rank: int | None = None,
) -> torch.Tensor:
    """All-to-all from sequence-sharded to head-sharded (DeepSpeed-Ulysses, Jacobs et al. 2023).

    Args:
        x: ``[B, sizes[me], H, D]`` this rank's tokens, all heads (any ``H``: when ``u`` does not
            divide it the heads are split unevenly, :func:`head_split`).
        sizes: tokens held by each rank of ``group`` (rank order).
        rank: this process's rank in ``group`` (default: asked from ``group``); only needed when
            ``u`` does not divide ``H``.

    Returns:
        ``[B, sum(sizes), head_split(H, u)[me], D]``: every token, the heads of group rank ``me``
        (``[me * H/u, (me+1) * H/u)`` when ``u`` divides ``H``). Bytes moved per rank: ``(u - 1) /
        u`` of ``x`` when ``u`` divides ``H``; otherwise the heads of the other ranks, never a
        padding element.
    """
    u = len(sizes)
    b, s, h, d = x.shape
    if h % u:
        return _seq_to_heads_uneven(x, sizes, group, rank)
    hh = h // u
    inp = x.reshape(b, s, u, hh, d).permute(2, 0, 1, 3, 4).reshape(u * b * s, hh, d)
    out = x.new_empty(b * sum(sizes), hh, d)
    dist.all_to_all_single(out, inp.contiguous(), [b * n for n in sizes], [b * s] * u, group=group)
    parts = [p.view(b, n, hh, d) for p, n in zip(out.split([b * n for n in sizes]), sizes)]
    return torch.cat(parts, 1)


def heads_to_seq(
    x: torch.Tensor,
    sizes: tuple[int, ...],
    rank: int,
    group: dist.ProcessGroup | None,
    heads: int | None = None,
) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, sum(sizes), head_split(H, u)[rank], D]`` ->
    ``[B, sizes[rank], H, D]``.

    Args:
        heads: ``H``, the heads of all ranks together; default ``u`` times this rank's (right
            only when ``u`` divides ``H``: pass it whenever the split may be uneven).
    """
    u = len(sizes)
    b, _, hh, d = x.shape
    h = u * hh if heads is None else int(heads)
    if h % u:
        return _heads_to_seq_uneven(x, sizes, rank, group, h)
    s = sizes[rank]
    inp = torch.cat([c.reshape(b * c.shape[1], hh, d) for c in x.split(list(sizes), 1)], 0)
    out = x.new_empty(u * b * s, hh, d)
    dist.all_to_all_single(out, inp, [b * s] * u, [b * n for n in sizes], group=group)
    return out.view(u, b, s, hh, d).permute(1, 2, 0, 3, 4).reshape(b, s, u * hh, d)


# Uneven heads: the all-to-all chunks differ in head count as well as in tokens, so they travel
# as flat element runs (one all_to_all_single with per-rank element counts) and are re-shaped on
# arrival. Chosen over padding the heads to a multiple of ``u`` with zeros: no zero heads cross
# the network or run through the kernel, and the busiest rank attends ``ceil(H / u)`` heads either
# way.
def _seq_to_heads_uneven(x, sizes, group, rank):
    u = len(sizes)
    b, s, h, d = x.shape
    me = dist.get_rank(group) if rank is None else rank
    hs = head_split(h, u)
    mine = hs[me]
    inp = torch.cat([c.reshape(-1) for c in x.split(list(hs), 2)])
    recv = [b * n * mine * d for n in sizes]
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, inp, recv, [b * s * n * d for n in hs], group=group)
    parts = [p.view(b, n, mine, d) for p, n in zip(out.split(recv), sizes)]
    return torch.cat(parts, 1)


def _heads_to_seq_uneven(x, sizes, rank, group, h):
    u = len(sizes)
    b, _, mine, d = x.shape
    hs = head_split(h, u)
    if mine != hs[rank]:
        raise ValueError(
            f"heads_to_seq got {mine} heads but {h} heads over {u} Ulysses ranks give rank "
            f"{rank} {hs[rank]}"
        )
    s = sizes[rank]
    inp = torch.cat([c.reshape(-1) for c in x.split(list(sizes), 1)])
    recv = [b * s * n * d for n in hs]
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, inp, recv, [b * n * mine * d for n in sizes], group=group)
    return torch.cat([p.view(b, s, n, d) for p, n in zip(out.split(recv), hs)], 2)


def gather_key_mask(
    mask: torch.Tensor, sizes: tuple[int, ...], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[B, sizes[me]]`` bool key mask -> ``[B, sum(sizes)]`` over ``group`` (rank order)."""
    m = max(sizes)
    x = mask.to(torch.uint8)
    if x.shape[1] < m:
        x = torch.cat([x, x.new_zeros(x.shape[0], m - x.shape[1])], 1)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], 1).bool()
