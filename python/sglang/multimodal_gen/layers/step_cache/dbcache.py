"""First-block cache (FBCache) and dual-block cache (DBCache): skip the middle blocks while the
head residual moves little, reusing the middle residual of the last computed step.

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
cache-dit's step limits bound what a state may skip: after ``max_cached_steps`` skipped calls
every later call computes, and after ``max_continuous_cached_steps`` skipped calls in a row the
next one computes (``None``: no limit; counted per state on the agreed decisions, so every rank
counts the same). cache-dit's TaylorSeer calibration is not implemented.

The statistic of a request is measured over its own region (its rows, tokens up to its own
length), so its decisions do not depend on which other requests share the batch. Under tensor
and sequence parallelism the sums are all-reduced over the sequence-parallel group (the shards),
then the compute flags are all-reduced (max) over the TP and SP groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang.multimodal_gen.layers.block_sequence import Streams
from sglang.multimodal_gen.layers.step_cache.base import (
    CacheRow,
    CacheState,
    Group,
    agree_to_compute,
    regions,
    sum_over_shards,
)
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy

__all__ = ["DBCachePolicy", "DBCacheState"]


def _at_limit(count: int, limit: int | None) -> bool:
    """cache-dit's step limits: ``count`` skipped calls reached ``limit`` (``None``: never)."""
    return limit is not None and count >= limit


@dataclass
class DBCacheState(CacheState):
    """Attributes:
    prev: ``r_prev``, the head residual region of the last computed call (``[rows, S, D]``).
    residuals: per stream, the middle output - head output region of the last computed call.

    cached: calls skipped so far; continuous: calls skipped since the last computed one.
    """

    prev: torch.Tensor | None = None
    residuals: tuple[torch.Tensor, ...] | None = None
    cached: int = 0
    continuous: int = 0


class DBCachePolicy(CachePolicy):
    """FBCache / DBCache (see the module docstring)."""

    uses_head_statistic = True

    def new_state(self, config: StepCacheConfig) -> DBCacheState:
        return DBCacheState()

    def decide(
        self, groups: list[Group], rows: Sequence[CacheRow], inputs: Streams, head: Streams
    ) -> None:
        device = head[0].device
        stats = torch.zeros(len(groups), 3, dtype=torch.float32, device=device)
        for j, g in enumerate(groups):
            h = regions(head, g)
            cur = h[0] - regions(inputs[:1], g)[0]
            st = g.state
            cfg = g.cache.config
            fresh = (
                st.calls < cfg.warmup
                or _at_limit(st.cached, cfg.max_cached_steps)
                or _at_limit(st.continuous, cfg.max_continuous_cached_steps)
                or st.prev is None
                or st.prev.shape != cur.shape
                or st.residuals is None
                or any(res.shape != x.shape for res, x in zip(st.residuals, h))
            )
            if fresh:
                stats[j, 0] = 1.0
            else:
                prev = st.prev.float()
                stats[j, 1] = (cur.float() - prev).abs().sum()
                stats[j, 2] = prev.abs().sum()
        sum_over_shards(stats, rows)
        flags = []
        for (fresh, diff, base), g in zip(stats.tolist(), groups):
            # diffusers: compute when mean|r - r_prev| / mean|r_prev| > threshold
            flags.append(
                1.0 if fresh > 0 or base == 0 or diff / base > g.cache.config.threshold else 0.0
            )
        agree_to_compute(groups, flags, device)
        for g in groups:  # the agreed decisions: the same counts on every rank
            st = g.state
            if g.compute:
                st.continuous = 0
            else:
                st.cached += 1
                st.continuous += 1

    def approximate(self, g: Group, head: Streams) -> Streams:
        return tuple(res + h for res, h in zip(g.state.residuals, head))

    def record(self, g: Group, inputs: Streams, head: Streams, mid: Streams) -> None:
        g.state.residuals = tuple(m - h for m, h in zip(mid, head))
        g.state.prev = head[0] - inputs[0]
