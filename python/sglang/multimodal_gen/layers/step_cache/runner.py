"""The shared runner: one DiT call's block sequence run with the policies of its rows' requests.

:func:`cache_rows` installs the runner for one DiT call (an interceptor of
:meth:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence.run`). For a sequence of ``L``
blocks and the rows' common ``Fn`` / ``Bn`` (``Fn`` resolved against ``L`` by
:meth:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig.head_blocks`), the runner

1. runs the head blocks ``0 .. Fn - 1`` on every row;
2. groups the rows by state and lets each request's policy decide (:data:`POLICIES`; requests
   with different methods may share a call, they need the same ``Fn`` and ``Bn``);
3. runs the middle blocks on the computing rows only (under their rows' LoRA compositions), or
   on the whole batch when every row computes (then with exactly the uncached arithmetic), and
   takes the skipped rows' middle output from their policy;
4. lets the policies record what the computed rows gave, counts, and runs the tail blocks
   ``L - Bn .. L - 1`` on every row.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch

from sglang.multimodal_gen.layers.block_sequence import BlockSequence, Streams, intercept_blocks
from sglang.multimodal_gen.layers.step_cache.base import (
    CacheRow,
    groups_of,
    lora_rows,
    regions,
)
from sglang.multimodal_gen.layers.step_cache.dbcache import DBCachePolicy
from sglang.multimodal_gen.layers.step_cache.magcache import MagCachePolicy
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy
from sglang.multimodal_gen.layers.step_cache.taylorseer import TaylorSeerPolicy
from sglang.multimodal_gen.layers.step_cache.teacache import TeaCachePolicy

__all__ = ["POLICIES", "cache_rows"]

#: ``--cache-method`` -> its policy.
POLICIES: dict[str, CachePolicy] = {
    "fbcache": DBCachePolicy(),
    "dbcache": DBCachePolicy(),
    "taylorseer": TaylorSeerPolicy(),
    "teacache": TeaCachePolicy(),
    "magcache": MagCachePolicy(),
}

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


def _new_state(config):
    return POLICIES[config.method].new_state(config)


def _run_cached(seq: BlockSequence, streams: Streams) -> Streams:
    rows = _ROWS.get()
    n = streams[0].shape[0]
    if rows is None:
        return seq.run_range(streams, 0, seq.num_blocks)
    if len(rows) != n:
        raise ValueError(f"step cache: {len(rows)} cache rows for a call of {n} rows")
    total = seq.num_blocks
    cfgs = {(row.cache.config.head_blocks(total), row.cache.config.bn) for row in rows}
    if len(cfgs) != 1:
        raise ValueError(f"step cache: the rows of one call need the same Fn/Bn, got {cfgs}")
    fn, bn = cfgs.pop()
    if fn + bn >= total:
        raise ValueError(
            f"step cache: Fn={fn} + Bn={bn} leaves no block to cache in a sequence of {total} "
            f"blocks (lower Fn or Bn)"
        )
    mid_hi = total - bn
    head = seq.run_range(streams, 0, fn)
    groups = groups_of(seq, rows, _new_state)
    by_policy: dict[int, tuple[CachePolicy, list]] = {}
    for g in groups:
        policy = POLICIES[g.cache.config.method]
        by_policy.setdefault(id(policy), (policy, []))[1].append(g)
    for policy, gs in by_policy.values():  # the same order on every rank
        policy.decide(gs, rows, streams, head)
    computing = [g for g in groups if g.compute]
    device = head[0].device
    if len(computing) == len(groups):  # every request computes: the plain arithmetic
        mid = seq.run_range(head, fn, mid_hi)
    else:
        mid = tuple(h.clone() for h in head)
        if computing:
            index = sorted(i for g in computing for i in g.rows)
            idx = torch.tensor(index, device=device)
            with lora_rows(seq.owner, index):
                part = seq.select_rows(idx).run_range(
                    tuple(h.index_select(0, idx) for h in head), fn, mid_hi
                )
            for m, p in zip(mid, part):
                m.index_copy_(0, idx, p)
        for g in groups:
            if g.compute:
                continue
            idx = torch.tensor(g.rows, device=device)
            approx = POLICIES[g.cache.config.method].approximate(g, regions(head, g))
            for k, (m, h, a) in enumerate(zip(mid, head, approx)):
                if g.length is not None and k == 0:  # the tokens beyond keep the head output
                    hs = h.index_select(0, idx)
                    hs[:, : g.length] = a
                else:
                    hs = a
                m.index_copy_(0, idx, hs)
    for g in groups:
        if g.compute:
            POLICIES[g.cache.config.method].record(
                g, regions(streams, g), regions(head, g), regions(mid, g)
            )
            g.cache.computed += 1
            g.cache.blocks_computed += total
        else:
            g.cache.skipped += 1
            g.cache.blocks_computed += fn + bn
            g.cache.blocks_skipped += mid_hi - fn
        g.state.calls += 1
    return seq.run_range(mid, mid_hi, total)
