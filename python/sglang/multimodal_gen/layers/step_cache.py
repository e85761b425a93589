"""Step caching of a DiT's blocks: first-block cache (FBCache) and dual-block cache (DBCache).

Consecutive denoising steps often change the hidden states little. These caches run the first
``Fn`` blocks of a :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence` every step,
measure how much their residual moved since the last fully computed step, and when it moved
little, skip the middle blocks: their output is the first blocks' output plus the residual the
middle blocks added at the last computed step. The last ``Bn`` blocks always run.

FBCache follows diffusers 0.42.1 ``hooks/first_block_cache.py`` (``FirstBlockCacheConfig``; from
ParaAttention's "first block cache"):

* ``r`` = output - input of the head block(s) on the main hidden stream (``streams[0]``);
* the step is skipped when ``mean|r - r_prev| / mean|r_prev| <= threshold`` (computed when it is
  greater, and always when there is no ``r_prev`` yet);
* ``r_prev`` and the cached residuals are only updated on computed steps;
* on a skipped step every stream's output is its head output + its cached residual (both streams
  of dual-stream blocks).

The ratio is taken as ``sum|r - r_prev| / sum|r_prev|`` in fp32 (the element counts cancel),
which is what lets sequence-parallel ranks add their shards' sums.

DBCache follows cache-dit's "Dual Block Cache" (vipshop/cache-dit, ``DBCacheConfig``:
``Fn_compute_blocks``, ``Bn_compute_blocks``, ``residual_diff_threshold``, ``max_warmup_steps``):
the first ``Fn`` blocks decide as above, the cached residual spans the middle blocks
``Fn .. L - Bn - 1``, the last ``Bn`` blocks are computed on every step from the (computed or
approximated) middle output, and the first ``warmup`` calls of a state always compute.
FBCache is DBCache with ``Fn = 1, Bn = 0, warmup = 0`` (and diffusers' threshold default 0.05);
the DBCache defaults are cache-dit's (F8B0, 0.08, 8 warmup steps). cache-dit's other knobs
(``max_cached_steps``, ``max_continuous_cached_steps``, TaylorSeer calibration) are not
implemented.

Who decides: every state is one *request* (its rows in a call: all its images, and its CFG
branches together or each branch alone, as the family's pipeline declares; diffusers' Flux runs
``cache_context("cond")`` and ``("uncond")``, its Z-Image one batched forward), keyed further by the
denoiser (two-expert models), the block sequence and the LoRA composition of the rows, so a
residual computed under one adapter composition or expert is never reused under another. The
statistic of a request is measured over its own rows (and tokens up to the longest of its own
lengths), so its decisions do not depend on which other requests share the batch. Under tensor
and sequence parallelism the sums are all-reduced over the sequence-parallel group (the shards),
then the compute flags are all-reduced (max) over the TP and SP groups, so every rank of a model
replica takes the same decision and runs the same collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sglang.multimodal_gen.distributed import (
    get_cfg_group,
    get_cfg_world_size,
    get_sp_group,
    get_sp_world_size,
    get_tp_group,
    get_tp_world_size,
)
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, Streams, intercept_blocks
from sglang.multimodal_gen.layers.lora.composition import RowMapping, lora_context_of

__all__ = [
    "CACHE_METHODS",
    "IMPLEMENTED_CACHE_METHODS",
    "CacheRow",
    "RequestCache",
    "StepCacheConfig",
    "cache_rows",
]

#: ``--cache-method`` values of the full contract (``fbcache`` is DBCache's F1B0 preset).
CACHE_METHODS = ("none", "fbcache", "dbcache", "teacache", "magcache", "taylorseer")
#: The values implemented so far.
IMPLEMENTED_CACHE_METHODS = ("none", "fbcache", "dbcache")

_PRESETS = {  # method -> (threshold, Fn, Bn, warmup)
    "fbcache": (0.05, 1, 0, 0),  # diffusers' FirstBlockCacheConfig
    "dbcache": (0.08, 8, 0, 8),  # cache-dit's DBCache defaults (F8B0)
}


@dataclass(frozen=True)
class StepCacheConfig:
    """What to cache (``--cache-method`` and its knobs).

    Attributes:
        method: one of :data:`IMPLEMENTED_CACHE_METHODS`.
        threshold: skip when the relative L1 change of the head residual is ``<=`` this.
        fn: blocks that always run first and decide (``Fn``, >= 1).
        bn: blocks that always run last (``Bn``, >= 0).
        warmup: the first calls of each state that always compute.
    """

    method: str = "none"
    threshold: float = 0.05
    fn: int = 1
    bn: int = 0
    warmup: int = 0

    @classmethod
    def of(
        cls,
        method: str,
        threshold: float | None = None,
        fn: int | None = None,
        bn: int | None = None,
        warmup: int | None = None,
        flag: str = "--cache-method",
    ) -> StepCacheConfig:
        """The method's preset with the given knobs replaced.

        Raises:
            ValueError: an unknown or not yet implemented method (the message names ``flag``),
                a negative threshold, ``fn < 1``, ``bn < 0`` or ``warmup < 0`` (the message names
                the ``--cache-*`` flag).
        """
        if method not in CACHE_METHODS:
            raise ValueError(
                f"{flag} {method!r} is unknown; choose from {', '.join(CACHE_METHODS)}"
            )
        if method not in IMPLEMENTED_CACHE_METHODS:
            raise ValueError(
                f"{flag} {method!r} is not implemented yet; implemented: "
                f"{', '.join(IMPLEMENTED_CACHE_METHODS)}"
            )
        if method == "none":
            return cls()
        t, f, b, w = _PRESETS[method]
        cfg = cls(
            method,
            t if threshold is None else float(threshold),
            f if fn is None else int(fn),
            b if bn is None else int(bn),
            w if warmup is None else int(warmup),
        )
        for name, value, low in (
            ("--cache-threshold", cfg.threshold, 0),
            ("--cache-fn", cfg.fn, 1),
            ("--cache-bn", cfg.bn, 0),
            ("--cache-warmup", cfg.warmup, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class _State:
    """One request's cache for one (denoiser, sequence, branch, LoRA composition)."""

    calls: int = 0
    prev: torch.Tensor | None = None  # r_prev: the head residual of the last computed call
    residuals: tuple[torch.Tensor, ...] | None = None  # per stream: middle output - head output


@dataclass
class RequestCache:
    """The step cache of one request (one generation): its states and its counts.

    Attributes:
        config: the request's cache configuration.
        states: keyed by ``(sequence name, id(denoiser), branch context, LoRA composition)``.
        computed, skipped: DiT calls (per state) whose middle blocks ran / were skipped.
        blocks_computed, blocks_skipped: blocks run / skipped over those calls.
    """

    config: StepCacheConfig
    states: dict[Any, _State] = field(default_factory=dict)
    computed: int = 0
    skipped: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0

    def summary(self) -> dict[str, int | str]:
        """``{"method", "steps_computed", "steps_skipped", "blocks_computed",
        "blocks_skipped"}`` (a step here is one DiT call of one state: one CFG branch when the
        branches decide alone)."""
        return {
            "method": self.config.method,
            "steps_computed": self.computed,
            "steps_skipped": self.skipped,
            "blocks_computed": self.blocks_computed,
            "blocks_skipped": self.blocks_skipped,
        }


@dataclass(frozen=True, eq=False)
class CacheRow:
    """The cache a row of a DiT call belongs to.

    Attributes:
        cache: the request's cache.
        context: the branch context (``"cond"`` / ``"uncond"``, or one name for all branches).
        joint: the context spans the CFG branches (then CFG-parallel ranks add their sums).
    """

    cache: RequestCache
    context: str = "cond"
    joint: bool = False


_ROWS: contextvars.ContextVar[Sequence[CacheRow] | None] = contextvars.ContextVar(
    "step_cache_rows", default=None
)


@contextlib.contextmanager
def cache_rows(rows: Sequence[CacheRow] | None) -> Iterator[None]:
    """Run the enclosed DiT call with step caching: ``rows[i]`` is the cache of row ``i`` of
    the call's batched inputs (``None``: no caching)."""
    if not rows:
        yield
        return
    token = _ROWS.set(list(rows))
    try:
        with intercept_blocks(_run_cached):
            yield
    finally:
        _ROWS.reset(token)


# ------------------------------------------------------------------------------ the runner
def _row_compositions(owner, n: int) -> list[Any]:
    """The LoRA composition of each of ``n`` rows (``None`` for a model without LoRA)."""
    ctx = lora_context_of(owner)
    if ctx is None:
        return [None] * n
    m = ctx.mapping
    if m is None:
        return [ctx.active] * n
    if m.uniform:
        return [m.compositions[0]] * n
    return list(m.compositions)


@contextlib.contextmanager
def _lora_rows(owner, index: list[int]) -> Iterator[None]:
    """The owner's per-row LoRA mapping narrowed to the rows ``index``."""
    ctx = lora_context_of(owner)
    if ctx is None or ctx.mapping is None or ctx.mapping.uniform:
        yield
        return
    with ctx.rows(RowMapping.of([ctx.mapping.compositions[i] for i in index])):
        yield


@dataclass
class _Group:
    rows: list[int]
    state: _State
    cache: RequestCache
    length: int | None  # tokens of streams[0] the statistic covers (None: all)
    compute: bool = True


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(t, op=op, group=group)


def _groups(seq: BlockSequence, rows: Sequence[CacheRow], n: int) -> list[_Group]:
    comps = _row_compositions(seq.owner, n)
    order: dict[Any, _Group] = {}
    for i, (row, comp) in enumerate(zip(rows, comps)):
        key = (id(row.cache), row.context, comp)
        g = order.get(key)
        if g is None:
            state_key = (seq.name, id(seq.owner), row.context, comp)
            state = row.cache.states.setdefault(state_key, _State())
            g = order[key] = _Group([], state, row.cache, None)
        g.rows.append(i)
    for g in order.values():
        if seq.lengths is not None:
            g.length = max(seq.lengths[i] for i in g.rows)
    return list(order.values())


def _decide(rows: Sequence[CacheRow], groups: list[_Group], r, head: Streams) -> None:
    """Set each group's ``compute`` (agreed by every rank of the replica)."""
    stats = torch.zeros(len(groups), 3, dtype=torch.float32, device=r.device)
    for j, g in enumerate(groups):
        cur = _region(r, g)
        st = g.state
        fresh = (
            st.calls < g.cache.config.warmup
            or st.prev is None
            or st.prev.shape != cur.shape
            or st.residuals is None
            or any(
                res.shape != (len(g.rows), *h.shape[1:]) for k, (res, h) in
                enumerate(zip(st.residuals, head)) if k > 0 or g.length is None
            )
        )  # fmt: skip
        if fresh:
            stats[j, 0] = 1.0
        else:
            prev = st.prev.float()
            stats[j, 1] = (cur.float() - prev).abs().sum()
            stats[j, 2] = prev.abs().sum()
    if get_sp_world_size() > 1:  # the shards' sums
        _all_reduce(stats, get_sp_group())
    if get_cfg_world_size() > 1 and all(row.joint for row in rows):  # the other branch's rows
        _all_reduce(stats, get_cfg_group())
    flags = []
    for (fresh, diff, base), g in zip(stats.tolist(), groups):
        # diffusers: compute when mean|r - r_prev| / mean|r_prev| > threshold
        flags.append(
            1.0 if fresh > 0 or base == 0 or diff / base > g.cache.config.threshold else 0.0
        )
    agreed = torch.tensor(flags, dtype=torch.float32, device=r.device)
    for size, group in ((get_tp_world_size(), get_tp_group), (get_sp_world_size(), get_sp_group)):
        if size > 1:
            _all_reduce(agreed, group(), dist.ReduceOp.MAX)
    for flag, g in zip(agreed.tolist(), groups):
        g.compute = flag > 0


def _region(t: torch.Tensor, g: _Group) -> torch.Tensor:
    """The group's rows of ``t`` (``[B, S, ...]``), tokens up to its length."""
    idx = torch.tensor(g.rows, device=t.device)
    out = t.index_select(0, idx)
    return out if g.length is None else out[:, : g.length]


def _run_cached(seq: BlockSequence, streams: Streams) -> Streams:
    rows = _ROWS.get()
    n = streams[0].shape[0]
    if rows is None:
        return seq.run_range(streams, 0, seq.num_blocks)
    if len(rows) != n:
        raise ValueError(f"step cache: {len(rows)} cache rows for a call of {n} rows")
    cfgs = {(row.cache.config.fn, row.cache.config.bn) for row in rows}
    if len(cfgs) != 1:
        raise ValueError(f"step cache: the rows of one call need the same Fn/Bn, got {cfgs}")
    fn, bn = cfgs.pop()
    total = seq.num_blocks
    if fn + bn >= total:
        raise ValueError(
            f"step cache: Fn={fn} + Bn={bn} leaves no block to cache in a sequence of {total} "
            f"blocks (lower Fn or Bn)"
        )
    mid_hi = total - bn
    head = seq.run_range(streams, 0, fn)
    r = head[0] - streams[0]
    groups = _groups(seq, rows, n)
    _decide(rows, groups, r, head)
    computing = [g for g in groups if g.compute]
    if len(computing) == len(groups):  # every request computes: the plain arithmetic
        mid = seq.run_range(head, fn, mid_hi)
    else:
        mid = tuple(h.clone() for h in head)
        if computing:
            index = sorted(i for g in computing for i in g.rows)
            idx = torch.tensor(index, device=head[0].device)
            with _lora_rows(seq.owner, index):
                part = seq.select_rows(idx).run_range(
                    tuple(h.index_select(0, idx) for h in head), fn, mid_hi
                )
            for m, p in zip(mid, part):
                m.index_copy_(0, idx, p)
        for g in groups:
            if g.compute:
                continue
            idx = torch.tensor(g.rows, device=head[0].device)
            for k, (m, h, res) in enumerate(zip(mid, head, g.state.residuals)):
                hs = h.index_select(0, idx)
                if g.length is not None and k == 0:
                    hs[:, : g.length] = res + hs[:, : g.length]
                else:
                    hs = res + hs
                m.index_copy_(0, idx, hs)
    for g in groups:
        st = g.state
        st.calls += 1
        if g.compute:
            idx = torch.tensor(g.rows, device=head[0].device)
            res = []
            for k, (m, h) in enumerate(zip(mid, head)):
                d = m.index_select(0, idx) - h.index_select(0, idx)
                res.append(d[:, : g.length] if k == 0 and g.length is not None else d)
            st.residuals = tuple(res)
            st.prev = _region(r, g)
            g.cache.computed += 1
            g.cache.blocks_computed += total
        else:
            g.cache.skipped += 1
            g.cache.blocks_computed += fn + bn
            g.cache.blocks_skipped += mid_hi - fn
    return seq.run_range(mid, mid_hi, total)
