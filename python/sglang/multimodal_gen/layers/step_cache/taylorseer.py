"""TaylorSeer: on a fixed schedule, replace the middle blocks by a Taylor expansion of what they
gave at the last computed steps.

Follows diffusers 0.42.1 ``hooks/taylorseer_cache.py`` (``TaylorSeerCacheConfig``; Liu et al.,
"From Reusing to Forecasting: Accelerating Diffusion Models with TaylorSeers", 2025), with the
cached quantity mapped onto the block sequence:

* **Schedule** (per state, ``t`` = the state's call index from 0): the middle blocks run when
  ``t < warmup`` (``disable_cache_before_step``), or ``(t - warmup - 1) % interval == 0``
  (``cache_interval``), or ``t >= stop`` (``disable_cache_after_step``); otherwise they are
  predicted. As in diffusers the first call after the warmup (``t = warmup``) is predicted, the
  next one computed, then one in every ``interval``. A state whose factors are missing or do not
  fit the current shapes computes too.
* **Factors** (per stream ``k``; updated on every computed call, warmup and ``stop`` calls
  included): ``F_0 = v`` (the value just computed) and, with ``d`` = calls since the previous
  update, ``F_{j+1} = (F_j - F_j^prev) / d`` for ``j < order``, as far as the previous factors go
  (divided backward differences: after ``n`` updates the expansion has order ``min(order,
  n - 1)``).
* **Prediction** ``s`` calls after the last update: ``sum_j F_j * s**j / j!``.

What is expanded (``target``), per stream of the middle blocks ``Fn .. L - Bn - 1``:

* ``"residual"`` (default): ``v = middle output - head output``; a predicted call outputs the
  current head output (the sequence input when ``Fn = 0``) + the expansion, as DBCache adds its
  residual. cache-dit's TaylorSeer calibrator expands residuals this way.
* ``"output"``: ``v = middle output``, as diffusers does for the output of each hooked module.

Where it differs from diffusers:

* diffusers hooks modules by name (by default every attention module of every block, so the
  feed-forward parts still run on predicted steps; ``use_lite_mode`` predicts ``proj_out`` and
  returns zeros from every block). Here the unit is the middle span of the block sequence: a
  predicted call runs no middle block at all, the head and tail blocks run. With ``Fn = Bn = 0``
  and ``target="output"`` this is diffusers with ``cache_identifiers`` naming every transformer
  block (the last block's expansion is what the sequence outputs).
* The factors are kept and combined in fp32 (diffusers: ``taylor_factors_dtype``, bfloat16 by
  default, differences taken in the module's dtype); the prediction is cast to the stream dtype.
* For ``order >= 2`` the expansion of divided backward differences is not exact on polynomials
  of that degree (``F_1`` is the slope of the last interval, not the derivative at the last
  update); it is exact for ``order = 1`` on a linear trajectory and for ``order = 0`` on a
  constant one, at any spacing. This is the rule of diffusers and the paper, kept as is.

No statistic is measured: every rank of a model replica counts the same calls of the same
states (with the same shapes), so the ranks take the same decisions by construction and no
collective runs. States are per request, branch context, denoiser and LoRA composition as for
every policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sglang.multimodal_gen.layers.block_sequence import Streams
from sglang.multimodal_gen.layers.step_cache.base import CacheRow, CacheState, Group, regions
from sglang.multimodal_gen.layers.step_cache.config import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.policy import CachePolicy

__all__ = ["TaylorSeerPolicy", "TaylorSeerState", "taylor_computes"]


def taylor_computes(t: int, config: StepCacheConfig) -> bool:
    """Whether call ``t`` (from 0) of a state runs the middle blocks under ``config``'s schedule
    (diffusers' ``TaylorSeerCacheHook._measure_should_compute``)."""
    if t < config.warmup:
        return True
    if config.stop is not None and t >= config.stop:
        return True
    return (t - config.warmup - 1) % config.interval == 0


@dataclass
class TaylorSeerState(CacheState):
    """Attributes:
    factors: per stream, ``[F_0, F_1, ...]`` (fp32, the group's regions' shapes).
    last: the call index of the last update (``None``: none yet).
    """

    factors: list[list[torch.Tensor]] = field(default_factory=list)
    last: int | None = None


class TaylorSeerPolicy(CachePolicy):
    """TaylorSeer (see the module docstring)."""

    def new_state(self, config: StepCacheConfig) -> TaylorSeerState:
        return TaylorSeerState()

    def decide(
        self, groups: list[Group], rows: Sequence[CacheRow], inputs: Streams, head: Streams
    ) -> None:
        for g in groups:
            st = g.state
            fits = (
                st.last is not None
                and len(st.factors) == len(head)
                and all(f[0].shape == x.shape for f, x in zip(st.factors, regions(head, g)))
            )
            g.compute = not fits or taylor_computes(st.calls, g.cache.config)

    def approximate(self, g: Group, head: Streams) -> Streams:
        st = g.state
        s = st.calls - st.last
        out = []
        for factors, h in zip(st.factors, head):
            pred = factors[0]
            for j in range(1, len(factors)):
                pred = pred + factors[j] * (s**j / math.factorial(j))
            if g.cache.config.target == "residual":
                out.append(h + pred.to(h.dtype))
            else:
                out.append(pred.to(h.dtype))
        return tuple(out)

    def record(self, g: Group, inputs: Streams, head: Streams, mid: Streams) -> None:
        st = g.state
        cfg = g.cache.config
        values = [
            (m.float() - h.float()) if cfg.target == "residual" else m.float()
            for m, h in zip(mid, head)
        ]
        old = st.factors if st.last is not None else []
        d = None if st.last is None else st.calls - st.last
        new = []
        for k, v in enumerate(values):
            factors = [v]
            prev = old[k] if k < len(old) else []
            for j in range(cfg.order):
                if j >= len(prev) or prev[j].shape != factors[j].shape:
                    break  # restart the expansion (diffusers: a shape change)
                factors.append((factors[j] - prev[j]) / d)
            new.append(factors)
        st.factors = new
        st.last = st.calls
