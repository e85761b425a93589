"""The bookkeeping every step-cache policy shares: requests, rows, states, and rank agreement.

* A :class:`RequestCache` is one request's (one generation's) cache: its configuration, its
  states and its counts.
* A :class:`CacheRow` tells which request (and which branch context) a row of a DiT call belongs
  to.
* A state (:class:`CacheState`, subclassed by each policy) is keyed by
  ``(sequence name, id(denoiser), branch context, LoRA composition)``, so that what was computed
  under one adapter composition, expert or CFG branch is never reused under another.
* A :class:`Group` is the rows of one call that share a state; its *region* of a stream is its
  rows, and for ``streams[0]`` its tokens up to the longest of its own lengths
  (:attr:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence.lengths`), so that the
  padding another request brings into a batch changes nothing it measures or stores.
* Agreement: :func:`sum_over_shards` adds per-group statistics over the sequence-parallel shards
  (and the CFG-parallel branches of a joint request); :func:`agree_to_compute` takes the maximum
  of the compute flags over the TP and SP groups, so every rank of a model replica runs the same
  blocks and collectives.
"""

from __future__ import annotations

import contextlib
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
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, Streams
from sglang.multimodal_gen.layers.lora.composition import RowMapping, lora_context_of
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig

__all__ = [
    "CacheRow",
    "CacheState",
    "Group",
    "RequestCache",
    "agree_to_compute",
    "groups_of",
    "lora_rows",
    "region",
    "regions",
    "sum_over_shards",
]


@dataclass
class CacheState:
    """One request's cache for one (denoiser, sequence, branch, LoRA composition).

    Attributes:
        calls: DiT calls of this state so far (the denoising step index of the next call when
            every step calls the DiT once per branch).
    """

    calls: int = 0


@dataclass
class RequestCache:
    """The step cache of one request (one generation): its states and its counts.

    Attributes:
        config: the request's cache configuration.
        states: keyed by ``(sequence name, id(denoiser), branch context, LoRA composition)``.
        computed, skipped: DiT calls (per state) whose middle blocks ran / were skipped.
        blocks_computed, blocks_skipped: blocks run / skipped over those calls.
        num_steps: the request's denoising steps, for the policies whose rule names the last
            step (TeaCache forces it) or the step count (MagCache's retention and resampled
            ratios): ``num_inference_steps`` when the generation starts, then the steps the loop
            runs once its timesteps are final (:meth:`~sglang.multimodal_gen.pipelines.base.
            StagedPipeline.__call__`; image-to-image at ``strength`` < 1 runs fewer); ``None``:
            unknown. The policies count DiT calls of a state against it: a sampler that calls
            the DiT more than once per step (LTX-2's res_2s: two calls, three in a last step to
            0) makes more calls than steps, so TeaCache's forced call is call ``num_steps - 1``,
            not the last one, and MagCache's ratios (resampled to ``num_steps``) run out before
            the calls do (``1.0`` past the list).
        calibration: what the server calibrated for the request's method (MagCache: the model's
            :class:`~sglang.multimodal_gen.layers.step_cache.mag_ratios.MagRatios`), or ``None``.
        report: further entries of :meth:`summary` a policy adds (MagCache's calibration mode:
            ``"mag_ratios"``, the measured ratios per state).
    """

    config: StepCacheConfig
    states: dict[Any, CacheState] = field(default_factory=dict)
    computed: int = 0
    skipped: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0
    num_steps: int | None = None
    calibration: Any = None
    report: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, int | str]:
        """``{"method", "steps_computed", "steps_skipped", "blocks_computed",
        "blocks_skipped"}`` (a step here is one DiT call of one state: one CFG branch when the
        branches decide alone), with the entries of :attr:`report`."""
        return {
            "method": self.config.method,
            "steps_computed": self.computed,
            "steps_skipped": self.skipped,
            "blocks_computed": self.blocks_computed,
            "blocks_skipped": self.blocks_skipped,
            **self.report,
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


@dataclass
class Group:
    """The rows of one DiT call that share one state.

    Attributes:
        rows: their indices in the call's batch.
        state: their state (created by ``new_state`` on first use).
        cache: their request's cache.
        length: tokens of ``streams[0]`` their region covers (``None``: all).
        compute: whether the middle blocks run for them in this call (set by the policy).
        key: their state's key in ``cache.states``.
        sequence: the block sequence being run (a policy reading its declarations, e.g.
            TeaCache's :attr:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence.
            modulated_input`).
    """

    rows: list[int]
    state: CacheState
    cache: RequestCache
    length: int | None
    compute: bool = True
    key: Any = None
    sequence: BlockSequence | None = None


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
def lora_rows(owner, index: list[int]) -> Iterator[None]:
    """The owner's per-row LoRA mapping narrowed to the rows ``index``."""
    ctx = lora_context_of(owner)
    if ctx is None or ctx.mapping is None or ctx.mapping.uniform:
        yield
        return
    with ctx.rows(RowMapping.of([ctx.mapping.compositions[i] for i in index])):
        yield


def groups_of(seq: BlockSequence, rows: Sequence[CacheRow], new_state) -> list[Group]:
    """The groups of a call's rows, in first-row order.

    Args:
        seq: the block sequence being run (its name, owner and lengths).
        rows: ``rows[i]`` is the cache of row ``i``.
        new_state: ``new_state(config) -> CacheState`` for a state met the first time.
    """
    comps = _row_compositions(seq.owner, len(rows))
    order: dict[Any, Group] = {}
    for i, (row, comp) in enumerate(zip(rows, comps)):
        key = (id(row.cache), row.context, comp)
        g = order.get(key)
        if g is None:
            state_key = (seq.name, id(seq.owner), row.context, comp)
            state = row.cache.states.get(state_key)
            if state is None:
                state = row.cache.states[state_key] = new_state(row.cache.config)
            g = order[key] = Group([], state, row.cache, None, key=state_key, sequence=seq)
        g.rows.append(i)
    for g in order.values():
        if seq.lengths is not None:
            g.length = max(seq.lengths[i] for i in g.rows)
    return list(order.values())


def region(t: torch.Tensor, g: Group, main: bool = True) -> torch.Tensor:
    """The group's rows of ``t`` (``[B, S, ...]``), tokens up to its length when ``main`` (the
    stream is ``streams[0]``)."""
    idx = torch.tensor(g.rows, device=t.device)
    out = t.index_select(0, idx)
    return out if g.length is None or not main else out[:, : g.length]


def regions(streams: Streams, g: Group) -> Streams:
    """:func:`region` of every stream (only ``streams[0]`` is cut to the group's length)."""
    return tuple(region(s, g, k == 0) for k, s in enumerate(streams))


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(t, op=op, group=group)


def sum_over_shards(stats: torch.Tensor, rows: Sequence[CacheRow]) -> None:
    """Add ``stats`` (``[groups, k]`` fp32 sums, in place) over the sequence-parallel shards, and
    over the CFG-parallel ranks when every row is a joint-branch row (the other rank holds the
    other branch's rows of the same request)."""
    if get_sp_world_size() > 1:  # the shards' sums
        _all_reduce(stats, get_sp_group())
    if get_cfg_world_size() > 1 and all(row.joint for row in rows):  # the other branch's rows
        _all_reduce(stats, get_cfg_group())


def agree_to_compute(groups: list[Group], flags: list[float], device) -> None:
    """Set each group's ``compute`` to the maximum of its flag (``1.0``: compute) over the TP and
    SP groups: every rank of a model replica takes the same decision."""
    agreed = torch.tensor(flags, dtype=torch.float32, device=device)
    for size, group in ((get_tp_world_size(), get_tp_group), (get_sp_world_size(), get_sp_group)):
        if size > 1:
            _all_reduce(agreed, group(), dist.ReduceOp.MAX)
    for flag, g in zip(agreed.tolist(), groups):
        g.compute = flag > 0
