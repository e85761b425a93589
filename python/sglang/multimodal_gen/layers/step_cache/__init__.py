"""Step caching of a DiT's blocks: skip or predict the middle blocks of some denoising steps.

Consecutive denoising steps often change the hidden states little. A step cache runs the first
``Fn`` blocks of a :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence` and the last
``Bn`` on every step and, on the steps its policy picks, replaces the middle blocks by what it
cached from computed steps:

* ``fbcache`` / ``dbcache`` (:mod:`.dbcache`): skip while the head residual moved little since
  the last computed step; reuse the middle residual of that step (diffusers'
  ``FirstBlockCacheConfig``, cache-dit's DBCache);
* ``taylorseer`` (:mod:`.taylorseer`): on a fixed schedule, predict the middle residual (or
  output) by a Taylor expansion from finite differences of the computed steps (diffusers'
  ``TaylorSeerCacheConfig``);
* ``teacache`` (:mod:`.teacache`): skip every block while the accumulated, rescaled change of the
  first block's timestep-modulated input (the family's declaration,
  :class:`~sglang.multimodal_gen.layers.block_sequence.ModulatedInput`) stays below the
  threshold; reuse the residual of the last computed step (ali-vilab/TeaCache);
* ``magcache`` (:mod:`.magcache`): skip every block while the accumulated error of the model's
  calibrated magnitude ratios (:mod:`.mag_ratios`, ``sglang calibrate-cache``) stays small; reuse
  the residual of the last computed step (diffusers' ``MagCacheConfig``).

Modules: :mod:`.config` (``--cache-method`` and its knobs), :mod:`.base` (requests, rows, states,
rank agreement), :mod:`.policy` (the interface a method implements), :mod:`.dbcache`,
:mod:`.taylorseer`, :mod:`.teacache`, :mod:`.magcache` (with :mod:`.mag_ratios`, the ratios file), :mod:`.runner`
(:func:`cache_rows`, the interceptor running a call).

Who decides: every state is one *request* (its rows in a call: all its images, and its CFG
branches together or each branch alone, as the family's pipeline declares; diffusers' Flux runs
``cache_context("cond")`` and ``("uncond")``, its Z-Image one batched forward), keyed further by the
denoiser (two-expert models), the block sequence and the LoRA composition of the rows, so what
was computed under one adapter composition or expert is never reused under another. What a
request measures or stores covers its own rows (and tokens up to the longest of its own lengths),
so its results do not depend on which other requests share the batch. Under tensor and sequence
parallelism a statistic policy (DBCache, TeaCache) adds its sums over the sequence-parallel shards and
takes the maximum of the compute flags over the TP and SP groups; a schedule policy
(TaylorSeer) needs no collective, every rank taking the same decisions by construction.
"""

from sglang.multimodal_gen.layers.step_cache.base import CacheRow, CacheState, RequestCache
from sglang.multimodal_gen.layers.step_cache.config import (
    CACHE_METHODS,
    IMPLEMENTED_CACHE_METHODS,
    TAYLOR_TARGETS,
    StepCacheConfig,
)
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy
from sglang.multimodal_gen.layers.step_cache.runner import POLICIES, cache_rows

__all__ = [
    "CACHE_METHODS",
    "IMPLEMENTED_CACHE_METHODS",
    "POLICIES",
    "TAYLOR_TARGETS",
    "CachePolicy",
    "CacheRow",
    "CacheState",
    "RequestCache",
    "StepCacheConfig",
    "cache_rows",
]
