"""The interface a step-cache method implements (FBCache / DBCache, TaylorSeer, ...).

The shared runner (:mod:`~sglang.multimodal_gen.layers.step_cache.runner`) splits a
:class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence` of ``L`` blocks into a head
(blocks ``0 .. Fn - 1``, always run), a middle (``Fn .. L - Bn - 1``) and a tail (the last ``Bn``,
always run on the middle's computed or approximated output). For each group of rows sharing a
state (:class:`~sglang.multimodal_gen.layers.step_cache.base.Group`) a policy says:

* :meth:`CachePolicy.decide`: whether the middle blocks run in this call. A policy either measures
  a statistic of the head (DBCache: its residual's relative change; then the ranks of a replica
  must agree, see :func:`~sglang.multimodal_gen.layers.step_cache.base.agree_to_compute`) or
  follows a fixed schedule of the state's call index (TaylorSeer: every rank counts the same calls,
  so the ranks agree by construction and no collective runs);
* :meth:`CachePolicy.approximate`: the middle output of a skipped group from what it cached;
* :meth:`CachePolicy.record`: what it caches from a computed call (DBCache: the middle residual
  per stream; TaylorSeer: the Taylor factors, finite-difference derivatives per stream).

Policies receive a group's *regions* (its rows; tokens of ``streams[0]`` up to its length) and
keep their per-request data in their own :class:`~sglang.multimodal_gen.layers.step_cache.base.
CacheState` subclass; they hold no data of their own (one instance serves every request).
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang.multimodal_gen.layers.block_sequence import Streams
from sglang.multimodal_gen.layers.step_cache.base import CacheRow, CacheState, Group
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig

__all__ = ["CachePolicy"]


class CachePolicy:
    """A step-cache method (see the module docstring); subclasses override every method."""

    #: the policy reads the head residual ``r = head[0] - streams[0]`` in :meth:`decide`
    uses_head_statistic: bool = False

    def new_state(self, config: StepCacheConfig) -> CacheState:
        """A fresh state for a (denoiser, sequence, branch, composition) of a request."""
        raise NotImplementedError

    def decide(
        self, groups: list[Group], rows: Sequence[CacheRow], inputs: Streams, head: Streams
    ) -> None:
        """Set ``g.compute`` of every group (the same on every rank of the replica).

        Args:
            groups: this policy's groups of the call.
            rows: every row of the call (for the CFG-joint test of the agreement).
            inputs: the sequence's input streams (whole batch).
            head: the head blocks' output streams (whole batch).
        """
        raise NotImplementedError

    def approximate(self, g: Group, head: Streams) -> Streams:
        """The middle output of a skipped group: ``head`` is the group's regions of the head
        output; returns tensors of the same shapes and dtypes."""
        raise NotImplementedError

    def record(self, g: Group, inputs: Streams, head: Streams, mid: Streams) -> None:
        """Cache what a computed call gives: the group's regions of the input, head and middle
        output streams. Called after :meth:`decide`, before ``g.state.calls`` is counted."""
        raise NotImplementedError
