"""What a request caches: ``--cache-method`` and its knobs, with each method's presets.

Presets (a knob left ``None`` takes the method's value):

========== ========= ==== ==== ====== ======== ===== ==== ========
method     threshold Fn   Bn   warmup interval order stop target
========== ========= ==== ==== ====== ======== ===== ==== ========
fbcache    0.05      1    0    0      --       --    --   --
dbcache    0.08      8    0    8      --       --    --   --
taylorseer --        0    0    3      5        1     None residual
teacache   family    0    0    family --       --    --   --
========== ========= ==== ==== ====== ======== ===== ==== ========

``fbcache`` is diffusers' ``FirstBlockCacheConfig`` default, ``dbcache`` cache-dit's DBCache
default (F8B0), ``taylorseer`` diffusers' ``TaylorSeerCacheConfig`` default
(``cache_interval=5``, ``disable_cache_before_step=3``, ``max_order=1``,
``disable_cache_after_step=None``), ``teacache`` the family's declared ``rel_l1_thresh`` and
``ret_steps`` (:class:`~sglang.multimodal_gen.layers.block_sequence.ModulatedInput`; Flux: 0.6
and 1, TeaCache4FLUX's script) over the whole block span. A knob of another method
(``--cache-threshold`` with ``taylorseer``, ``--cache-interval`` with ``dbcache``) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CACHE_METHODS", "IMPLEMENTED_CACHE_METHODS", "TAYLOR_TARGETS", "StepCacheConfig"]

#: ``--cache-method`` values of the full contract (``fbcache`` is DBCache's F1B0 preset).
CACHE_METHODS = ("none", "fbcache", "dbcache", "teacache", "magcache", "taylorseer")
#: The values implemented so far.
IMPLEMENTED_CACHE_METHODS = ("none", "fbcache", "dbcache", "taylorseer", "teacache")
#: What TaylorSeer extrapolates: the middle blocks' residual (middle output - head output) or
#: their output itself (diffusers' rule for a hooked module).
TAYLOR_TARGETS = ("residual", "output")

_THRESHOLD_METHODS = ("fbcache", "dbcache")
_SCHEDULE_METHODS = ("taylorseer",)
_TEACACHE = ("teacache",)  # the whole span (Fn = Bn = 0); threshold / warmup: the family's
_PRESETS = {  # method -> knob defaults
    "fbcache": dict(threshold=0.05, fn=1, bn=0, warmup=0),  # diffusers' FirstBlockCacheConfig
    "dbcache": dict(threshold=0.08, fn=None, bn=0, warmup=8),  # cache-dit's DBCache (F8B0)
    "taylorseer": dict(fn=0, bn=0, warmup=3, interval=5, order=1, stop=None, target="residual"),
    "teacache": dict(threshold=None, fn=0, bn=0, warmup=None),
}
_FLAGS = {  # knob -> (flag, lowest value, methods it applies to)
    "max_cached_steps": ("--cache-max-cached-steps", -1, _THRESHOLD_METHODS),
    "max_continuous_cached_steps": ("--cache-max-continuous-cached-steps", -1, _THRESHOLD_METHODS),
    "threshold": ("--cache-threshold", 0, _THRESHOLD_METHODS + _TEACACHE),
    "fn": ("--cache-fn", None, _THRESHOLD_METHODS + _SCHEDULE_METHODS),
    "bn": ("--cache-bn", 0, _THRESHOLD_METHODS + _SCHEDULE_METHODS),
    "warmup": ("--cache-warmup", 0, _THRESHOLD_METHODS + _SCHEDULE_METHODS + _TEACACHE),
    "interval": ("--cache-interval", 1, _SCHEDULE_METHODS),
    "order": ("--cache-order", 0, _SCHEDULE_METHODS),
    "stop": ("--cache-stop", 0, _SCHEDULE_METHODS),
    "target": ("--cache-taylor-target", None, _SCHEDULE_METHODS),
}


@dataclass(frozen=True)
class StepCacheConfig:
    """What to cache (``--cache-method`` and its knobs).

    Attributes:
        method: one of :data:`IMPLEMENTED_CACHE_METHODS`.
        threshold: fbcache / dbcache: skip when the relative L1 change of the head residual is
            ``<=`` this. teacache: ``rel_l1_thresh``, skip while the accumulated rescaled
            change stays below it; ``None``: the family's declared value.
        fn: blocks that always run first (``Fn``; >= 1 for fbcache / dbcache, whose head
            decides; >= 0 for taylorseer); ``None``: scaled to the sequence's block count
            (:meth:`head_blocks`, the dbcache preset).
        bn: blocks that always run last (``Bn``, >= 0).
        warmup: the first calls of each state that always compute (taylorseer: diffusers'
            ``disable_cache_before_step``; teacache: ``ret_steps``, ``None``: the family's).
        interval: taylorseer: a full computation every ``interval`` calls after the warmup
            (diffusers' ``cache_interval``, >= 1).
        order: taylorseer: the highest order of the Taylor expansion (``max_order``, >= 0).
        stop: taylorseer: calls from this index on always compute
            (``disable_cache_after_step``); ``None``: never.
        target: taylorseer: ``"residual"`` (middle output - head output, added to the current
            head output) or ``"output"`` (the middle output itself), per stream.
        max_cached_steps: fbcache / dbcache: at most this many skipped calls per state, later
            calls compute (cache-dit's ``max_cached_steps``); ``None`` (``-1`` given): no limit.
        max_continuous_cached_steps: fbcache / dbcache: at most this many skipped calls in a row
            per state, the next one computes (cache-dit's ``max_continuous_cached_steps``);
            ``None`` (``-1`` given): no limit.
    """

    method: str = "none"
    threshold: float = 0.05
    fn: int | None = 1
    bn: int = 0
    warmup: int = 0
    interval: int = 1
    order: int = 0
    stop: int | None = None
    target: str = "residual"
    max_cached_steps: int | None = None
    max_continuous_cached_steps: int | None = None

    @classmethod
    def of(
        cls,
        method: str,
        threshold: float | None = None,
        fn: int | None = None,
        bn: int | None = None,
        warmup: int | None = None,
        flag: str = "--cache-method",
        *,
        interval: int | None = None,
        order: int | None = None,
        stop: int | None = None,
        target: str | None = None,
        max_cached_steps: int | None = None,
        max_continuous_cached_steps: int | None = None,
    ) -> StepCacheConfig:
        """The method's preset with the given knobs replaced.

        Raises:
            ValueError: an unknown or not yet implemented method (the message names ``flag``),
                a knob the method does not take, or a value out of range (``threshold < 0``,
                ``fn < 1`` for fbcache / dbcache or ``< 0`` for taylorseer, ``bn``, ``warmup``,
                ``order`` or ``stop < 0``, ``interval < 1``, a step limit ``< -1``, an unknown
                ``target``; the message names the ``--cache-*`` flag).
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
        given = dict(
            threshold=threshold, fn=fn, bn=bn, warmup=warmup, interval=interval, order=order,
            stop=stop, target=target, max_cached_steps=max_cached_steps,
            max_continuous_cached_steps=max_continuous_cached_steps,
        )  # fmt: skip
        if method == "none":
            return cls()
        knobs = dict(_PRESETS[method])
        for name, value in given.items():
            if value is None:
                continue
            flag_name, _, methods = _FLAGS[name]
            if method not in methods:
                raise ValueError(f"{flag_name} does not apply to --cache-method {method}")
            knobs[name] = value
        for name, value in knobs.items():
            flag_name, low, _ = _FLAGS[name]
            if name == "fn":
                low = 1 if method in _THRESHOLD_METHODS else 0
            if name == "target":
                if value not in TAYLOR_TARGETS:
                    raise ValueError(
                        f"{flag_name} must be one of {', '.join(TAYLOR_TARGETS)}, got {value!r}"
                    )
            elif value is not None and value < low:
                raise ValueError(f"{flag_name} must be >= {low}, got {value}")
        for name in ("max_cached_steps", "max_continuous_cached_steps"):
            if knobs.get(name) == -1:  # cache-dit's "no limit"
                knobs[name] = None
        cast = {"threshold": float, "target": str}
        return cls(
            method, **{k: (v if v is None else cast.get(k, int)(v)) for k, v in knobs.items()}
        )

    def head_blocks(self, num_blocks: int) -> int:
        """``Fn`` on a block sequence of ``num_blocks`` blocks: :attr:`fn`, or when it is
        ``None`` (the dbcache preset) ``max(1, min(8, num_blocks // 4))``: cache-dit's F8 on a
        DiT of 32 blocks or more (Flux.1 57, Qwen-Image 60, Wan2.2 40), a quarter of the blocks
        on smaller ones (Z-Image's 30 layers: 7; the demo model's 3: 1), so the preset leaves
        blocks to cache on every model."""
        if self.fn is not None:
            return self.fn
        return max(1, min(8, num_blocks // 4))

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def scheduled(self) -> bool:
        """The method computes on a fixed schedule (every rank of a replica takes the same
        decisions by construction, no statistic is measured)."""
        return self.method in _SCHEDULE_METHODS
