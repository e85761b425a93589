"""TeaCache: skip the whole block span while the accumulated, rescaled change of the first
block's timestep-modulated input stays below a threshold.

Follows Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"
(2024) and its reference scripts (ali-vilab/TeaCache: TeaCache4FLUX, TeaCache4HunyuanVideo,
TeaCache4Wan2.1, TeaCache4LTX-Video), mapped onto the block sequence:

* ``m`` = the family's *modulated input*
  (:class:`~sglang.multimodal_gen.layers.block_sequence.ModulatedInput`, e.g. Flux: block 0's
  ``norm1(image, temb)[0]``), computed from the sequence's input on every call;
* on every call that is not forced, ``acc += poly(mean|m - m_prev| / mean|m_prev|)`` with
  ``poly = np.poly1d(coefficients)`` the family's published rescaling; the blocks are skipped
  while ``acc < threshold`` (``rel_l1_thresh``); otherwise they run and ``acc = 0``;
* forced (the blocks run, ``acc = 0``): the first ``warmup`` calls (``ret_steps``; the
  references' ``cnt == 0`` is ``warmup = 1``) and the last step (``cnt == num_steps - 1``, when
  the request's step count is known, :attr:`~.base.RequestCache.num_steps`), and a call whose
  previous ``m`` or residuals are missing or of other shapes;
* ``m_prev`` is updated on every call (computed or skipped), as in the references;
* a skipped call outputs, for every stream, its input + the residual (output - input) of the
  last computed call (the references keep only the image stream's: the text stream's output is
  not used after the blocks).

The step index of a call is the count of the earlier calls of the request's states of the same
sequence, branch and LoRA composition over every denoiser (a two-expert model's low-noise expert
starts at the switch step, so its last call is the request's last step).

Where it differs from the references: the ratio is taken as ``sum|m - m_prev| / sum|m_prev|`` in
fp32 over the request's own region (its rows, tokens up to its length when ``m`` is per token;
the element counts cancel), which is what lets sequence-parallel ranks add their shards' sums
(the references take the means in the model dtype over the whole batch); the decision is agreed
over the TP and SP groups (maximum of the compute flags) before the accumulator is reset or
kept, so every rank keeps the same accumulator. Wan2.1's ``use_ret_steps`` variant does not force
its last step; here the last step always computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang.multimodal_gen.layers.block_sequence import ModulatedInput, Streams
from sglang.multimodal_gen.layers.step_cache.base import (
    CacheRow,
    CacheState,
    Group,
    agree_to_compute,
    region,
    regions,
    sum_over_shards,
)
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy

__all__ = ["TeaCachePolicy", "TeaCacheState", "rescaled", "step_index", "teacache_decision"]


@dataclass
class TeaCacheState(CacheState):
    """Attributes:
    prev: ``m_prev``, the modulated input region of the previous call (any dtype of ``m``).
    accumulated: the accumulated rescaled change since the last computed call.
    residuals: per stream, the output - input region of the last computed call.
    """

    prev: torch.Tensor | None = None
    accumulated: float = 0.0
    residuals: tuple[torch.Tensor, ...] | None = None


def rescaled(change: float, coefficients: Sequence[float]) -> float:
    """``np.poly1d(coefficients)(change)``: the family's estimate of the output's relative change
    from the modulated input's (``coefficients`` highest power first)."""
    return float(np.polyval(np.asarray(coefficients, dtype=np.float64), change))


def teacache_decision(
    accumulated: float, change: float | None, coefficients: Sequence[float], threshold: float
) -> tuple[bool, float]:
    """One call of TeaCache's rule: ``(compute, accumulated after the call if it is skipped)``.

    Args:
        accumulated: the accumulator before the call.
        change: ``mean|m - m_prev| / mean|m_prev|``, or ``None`` for a forced call.
        coefficients: the rescaling polynomial (``np.poly1d`` order).
        threshold: ``rel_l1_thresh``.

    Returns:
        ``compute`` is ``True`` for a forced call or when the new accumulator reaches
        ``threshold`` (then the caller resets it to 0); the accumulator is ``accumulated +
        poly(change)`` (0 for a forced call).
    """
    if change is None:
        return True, 0.0
    acc = accumulated + rescaled(change, coefficients)
    return not acc < threshold, acc  # NaN (a zero m_prev) computes, as in the references


def step_index(g: Group) -> int:
    """The denoising step of the group's call: the calls so far of its request's states of the
    same sequence, branch and LoRA composition, over every denoiser."""
    name, _, context, comp = g.key
    return sum(
        st.calls
        for (n, _, c, p), st in g.cache.states.items()
        if (n, c, p) == (name, context, comp)
    )


def declaration(g: Group) -> ModulatedInput:
    """The modulated-input declaration of the group's sequence.

    Raises:
        ValueError: the family declares none (names ``--cache-method teacache`` and the DiT).
    """
    seq = g.sequence
    decl = None if seq is None else seq.modulated_input
    if decl is None:
        owner = "this model" if seq is None else type(seq.owner).__name__
        raise ValueError(
            f"--cache-method teacache: {owner} declares no modulated input of its first block "
            "(BlockSequence.modulated_input); choose another --cache-method"
        )
    return decl


class TeaCachePolicy(CachePolicy):
    """TeaCache (see the module docstring); runs with ``Fn = Bn = 0``."""

    def new_state(self, config: StepCacheConfig) -> TeaCacheState:
        return TeaCacheState()

    def decide(
        self, groups: list[Group], rows: Sequence[CacheRow], inputs: Streams, head: Streams
    ) -> None:
        decl = declaration(groups[0])
        m = decl.compute(inputs, groups[0].sequence.row_args)
        device = inputs[0].device
        stats = torch.zeros(len(groups), 3, dtype=torch.float32, device=device)
        for j, g in enumerate(groups):
            cur = region(m, g, main=decl.per_token)
            st, cfg = g.state, g.cache.config
            warmup = decl.warmup if cfg.warmup is None else cfg.warmup
            step = step_index(g)
            last = g.cache.num_steps is not None and step == g.cache.num_steps - 1
            forced = (
                step < warmup
                or last
                or st.prev is None
                or st.prev.shape != cur.shape
                or st.residuals is None
                or any(r.shape != x.shape for r, x in zip(st.residuals, regions(inputs, g)))
            )
            if forced:
                stats[j, 0] = 1.0
            else:
                prev = st.prev.float()
                stats[j, 1] = (cur.float() - prev).abs().sum()
                stats[j, 2] = prev.abs().sum()
            st.prev = cur
        sum_over_shards(stats, rows)
        flags, accs = [], []
        for (forced, diff, base), g in zip(stats.tolist(), groups):
            cfg = g.cache.config
            threshold = decl.threshold if cfg.threshold is None else cfg.threshold
            change = None if forced > 0 else (diff / base if base > 0 else float("nan"))
            compute, acc = teacache_decision(
                g.state.accumulated, change, decl.coefficients, threshold
            )
            flags.append(1.0 if compute else 0.0)
            accs.append(acc)
        agree_to_compute(groups, flags, device)
        for g, acc in zip(groups, accs):  # after the agreement: the same on every rank
            g.state.accumulated = 0.0 if g.compute else acc

    def approximate(self, g: Group, head: Streams) -> Streams:
        return tuple(h + r for h, r in zip(head, g.state.residuals))

    def record(self, g: Group, inputs: Streams, head: Streams, mid: Streams) -> None:
        g.state.residuals = tuple(m - x for m, x in zip(mid, inputs))
