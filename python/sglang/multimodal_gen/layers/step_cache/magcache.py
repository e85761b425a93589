"""MagCache: skip whole steps while the accumulated error of the calibrated magnitude ratios
stays small.

Follows diffusers 0.42.1 ``hooks/mag_cache.py`` (``MagCacheConfig``; Ma et al., "MagCache: Fast
Video Generation with Magnitude-Aware Cache", 2025). The residual ``r`` of a call is the block
sequence's main-stream output minus its input (diffusers: the tail block's hidden-state output
minus the head block's hidden-state input, the head being the first block and the tail the last
block of the DiT's transformer-block lists: Flux's ``transformer_blocks.0`` and
``single_transformer_blocks.<last>``, Z-Image's ``layers.0`` and ``layers.<last>``). Its
magnitude ratio between consecutive steps, ``mag_ratios[t] = mean_tokens(||r_t|| /
||r_{t-1}||)``, decays smoothly, is model-specific and prompt-independent, so it is calibrated
once per model (:mod:`.mag_ratios`).

Rule (per state, ``t`` = the state's call index from 0, ``N`` = the request's
``num_inference_steps``, ``ratios`` = the calibrated list resampled to ``N`` by
:func:`~.mag_ratios.nearest_interp`; ``scale = ratios[t]``, ``1.0`` past the list):

* ``t < int(retention_ratio * N + 0.5)``: compute (the retention of the first steps);
* otherwise ``acc_ratio *= scale``, ``acc_steps += 1``, ``acc_err += |1 - acc_ratio|``; skip
  when a residual is cached, ``acc_err <= threshold`` and ``acc_steps <= max_skip_steps``;
  else compute and reset ``acc_ratio = 1``, ``acc_steps = 0``, ``acc_err = 0``.

The accumulators are kept in float32, as diffusers' tensors, so the decisions are the same bit
for bit. A computed call stores ``r`` (in the stream dtype); a skipped call runs no block at all
(``Fn = Bn = 0``) and outputs ``input + r`` for the main stream and the side streams unchanged
(diffusers returns the head's ``encoder_hidden_states`` as they came).

Calibration (``calibrate``): every call computes; call ``t`` records ``mean(||r_t|| /
(||r_{t-1}|| + 1e-8))`` over the group's rows and tokens (norms over the hidden dim, fp32), ``1.0``
for the first call, as diffusers' calibration mode; the lists are reported in the request's cache
summary under ``"mag_ratios"``, keyed as the ratios file (:mod:`.mag_ratios`). Under sequence
parallelism each rank measures its own shard (calibrate without it).

The decisions read no tensor: every rank of a model replica counts the same calls of the same
states with the same ratios (and caches residuals of the same shapes), so the ranks agree by
construction and no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang.multimodal_gen.layers.block_sequence import Streams
from sglang.multimodal_gen.layers.step_cache.base import CacheRow, CacheState, Group, regions
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy

__all__ = ["MagCachePolicy", "MagCacheState", "mag_step", "state_label"]


@dataclass
class MagCacheState(CacheState):
    """Attributes:
    ratios: the state's ratios resampled to the request's steps (``None``: not yet looked up).
    acc_ratio, acc_err, acc_steps: diffusers' ``accumulated_ratio`` / ``_err`` / ``_steps``.
    residual: ``r`` of the last computed call (the group's region of the main stream).
    calibration: calibration mode: the ratios measured so far.
    """

    ratios: list[float] | None = None
    acc_ratio: np.float32 = field(default_factory=lambda: np.float32(1.0))
    acc_err: np.float32 = field(default_factory=lambda: np.float32(0.0))
    acc_steps: int = 0
    residual: torch.Tensor | None = None
    calibration: list[float] = field(default_factory=list)


def mag_step(st: MagCacheState, cached: bool, config: StepCacheConfig, steps: int) -> bool:
    """Whether call ``st.calls`` computes under MagCache's rule (module docstring), updating the
    state's accumulators; ``cached``: a residual of the right shape is cached.
    ``st.ratios`` must be set."""
    t = st.calls
    if t < int(config.retention_ratio * steps + 0.5):
        return True
    scale = np.float32(st.ratios[t]) if t < len(st.ratios) else np.float32(1.0)
    st.acc_ratio = np.float32(st.acc_ratio * scale)
    st.acc_steps += 1
    st.acc_err = np.float32(st.acc_err + abs(np.float32(1.0) - st.acc_ratio))
    small = st.acc_err <= np.float32(config.threshold)
    if cached and small and st.acc_steps <= config.max_skip_steps:
        return False
    st.acc_ratio, st.acc_err, st.acc_steps = np.float32(1.0), np.float32(0.0), 0
    return True


def state_label(g: Group) -> str:
    """The ratios-file key of a group's state: ``"<sequence>/<denoiser>/<context>"``, the
    denoiser being its order of first use among the request's states."""
    name, owner, context = g.key[0], g.key[1], g.key[2]
    owners = list(dict.fromkeys(k[1] for k in g.cache.states))
    return f"{name}/{owners.index(owner)}/{context}"


class MagCachePolicy(CachePolicy):
    """MagCache (see the module docstring)."""

    def new_state(self, config: StepCacheConfig) -> MagCacheState:
        return MagCacheState()

    def decide(
        self, groups: list[Group], rows: Sequence[CacheRow], inputs: Streams, head: Streams
    ) -> None:
        for g in groups:
            st, cfg = g.state, g.cache.config
            if cfg.calibrate:
                g.compute = True
                continue
            ratios = g.cache.calibration
            if ratios is None:
                raise ValueError(
                    "--cache-method magcache needs the model's calibrated ratios "
                    "(--cache-mag-ratios FILE, or sglang calibrate-cache)"
                )
            steps = g.cache.num_steps or ratios.num_inference_steps
            if st.ratios is None:
                st.ratios = ratios.for_state(state_label(g), steps)
            h = regions(head[:1], g)[0]
            cached = st.residual is not None and st.residual.shape == h.shape
            g.compute = mag_step(st, cached, cfg, steps)

    def approximate(self, g: Group, head: Streams) -> Streams:
        return (head[0] + g.state.residual, *head[1:])

    def record(self, g: Group, inputs: Streams, head: Streams, mid: Streams) -> None:
        st = g.state
        residual = mid[0] - head[0]
        if g.cache.config.calibrate:
            if st.residual is None or st.residual.shape != residual.shape:
                ratio = 1.0
            else:
                cur = torch.linalg.norm(residual.float(), dim=-1)
                prev = torch.linalg.norm(st.residual.float(), dim=-1)
                ratio = (cur / (prev + 1e-8)).mean().item()
            st.calibration.append(ratio)
            g.cache.report.setdefault("mag_ratios", {})[state_label(g)] = list(st.calibration)
        st.residual = residual
