"""What a request caches: ``--cache-method`` and its knobs, with each method's presets.

Presets (a knob left ``None`` takes the method's value; ``C``: ``max_continuous_cached_steps``):

========== ========= ==== ==== ====== ======== ===== ==== ======== ====
method     threshold Fn   Bn   warmup interval order stop target   C
========== ========= ==== ==== ====== ======== ===== ==== ======== ====
fbcache    0.3       1    0    0      --       --    --   --       4
dbcache    0.3       L/4  0    2      --       --    --   --       4
taylorseer --        0    0    3      3        1     None residual --
teacache   family    0    0    family --       --    --   --       --
magcache   0.2       0    0    --     --       --    --   --       --
========== ========= ==== ==== ====== ======== ===== ==== ======== ====

(``L/4``: :meth:`StepCacheConfig.head_blocks`; ``family``: the DiT's declared value; magcache
also takes ``max_skip_steps`` 3 and ``retention_ratio`` 0.2.)

The fbcache, dbcache and taylorseer presets are chosen to cost little image fidelity at a
real saving (measured on the embedded demo model, 28 steps: docs/benchmarks.md) and depart from
the reference libraries' defaults, which skip too little there (diffusers'
``FirstBlockCacheConfig`` threshold 0.05: 0.94x the uncached time) or too much
(``TaylorSeerCacheConfig`` ``cache_interval=5``: one image at 28 dB):

* ``fbcache``: a skip threshold of 0.3 with at most 4 skipped calls in a row (cache-dit's
  ``max_continuous_cached_steps``), so a slowly drifting residual is refreshed at least every
  fifth call (diffusers' default: threshold 0.05, no limit);
* ``dbcache``: the same rule with ``Fn`` scaled to the DiT (:meth:`StepCacheConfig.head_blocks`,
  cache-dit's F8 on 32 blocks or more) and 2 warm-up calls (cache-dit's default: threshold
  0.08, F8B0, 8 warm-up steps, no limit);
* ``taylorseer``: one full computation every 3 calls after the warm-up (diffusers' default:
  ``cache_interval=5``, ``disable_cache_before_step=3``, ``max_order=1``,
  ``disable_cache_after_step=None``).

``teacache`` the family's declared ``rel_l1_thresh`` and
``ret_steps`` (:class:`~sglang.multimodal_gen.layers.block_sequence.ModulatedInput`; Flux: 0.6
and 1, TeaCache4FLUX's script) over the whole block span, ``magcache`` ``threshold=0.2``,
``max_skip_steps=3``, ``retention_ratio=0.2`` over the whole block span, with the model's
calibrated ratios (``--cache-mag-ratios`` or the file beside the model); diffusers'
``MagCacheConfig`` default threshold 0.06 skips 6 of 28 steps on the demo model (0.86x the
uncached time), 0.2 skips 14 (0.67x) at >= 46 dB. A knob of another method
(``--cache-threshold`` with ``taylorseer``, ``--cache-interval`` with ``dbcache``) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from math import isfinite
from numbers import Integral, Real

__all__ = ["CACHE_METHODS", "IMPLEMENTED_CACHE_METHODS", "TAYLOR_TARGETS", "StepCacheConfig"]

#: ``--cache-method`` values of the full contract (``fbcache`` is DBCache's F1B0 preset).
CACHE_METHODS = ("none", "fbcache", "dbcache", "teacache", "magcache", "taylorseer")
#: The values implemented so far.
IMPLEMENTED_CACHE_METHODS = ("none", "fbcache", "dbcache", "taylorseer", "teacache", "magcache")
#: What TaylorSeer extrapolates: the middle blocks' residual (middle output - head output) or
#: their output itself (diffusers' rule for a hooked module).
TAYLOR_TARGETS = ("residual", "output")

_THRESHOLD_METHODS = ("fbcache", "dbcache")
_SCHEDULE_METHODS = ("taylorseer",)
_TEACACHE = ("teacache",)  # the whole span (Fn = Bn = 0); threshold / warmup: the family's
_MAGCACHE = ("magcache",)  # the whole span (Fn = Bn = 0), diffusers' MagCacheConfig defaults
_PRESETS = {  # method -> knob defaults
    # the module docstring says why these depart from diffusers' / cache-dit's defaults
    "fbcache": dict(threshold=0.3, fn=1, bn=0, warmup=0, max_continuous_cached_steps=4),
    "dbcache": dict(threshold=0.3, fn=None, bn=0, warmup=2, max_continuous_cached_steps=4),
    "taylorseer": dict(fn=0, bn=0, warmup=3, interval=3, order=1, stop=None, target="residual"),
    "teacache": dict(threshold=None, fn=0, bn=0, warmup=None),
    "magcache": dict(threshold=0.2, fn=0, bn=0, max_skip_steps=3, retention_ratio=0.2),
}
#: knob -> its number kind (a float knob takes finite real numbers, an int knob integers;
#: neither takes a bool or NaN / inf)
_KINDS = dict(
    threshold=float, retention_ratio=float, fn=int, bn=int, warmup=int, interval=int, order=int,
    stop=int, max_cached_steps=int, max_continuous_cached_steps=int, max_skip_steps=int,
)  # fmt: skip
_FLAGS = {  # knob -> (flag, lowest value, methods it applies to)
    "max_cached_steps": ("--cache-max-cached-steps", -1, _THRESHOLD_METHODS),
    "max_continuous_cached_steps": ("--cache-max-continuous-cached-steps", -1, _THRESHOLD_METHODS),
    "threshold": ("--cache-threshold", 0, _THRESHOLD_METHODS + _TEACACHE + _MAGCACHE),
    "fn": ("--cache-fn", None, _THRESHOLD_METHODS + _SCHEDULE_METHODS),
    "bn": ("--cache-bn", 0, _THRESHOLD_METHODS + _SCHEDULE_METHODS),
    "warmup": ("--cache-warmup", 0, _THRESHOLD_METHODS + _SCHEDULE_METHODS + _TEACACHE),
    "interval": ("--cache-interval", 1, _SCHEDULE_METHODS),
    "order": ("--cache-order", 0, _SCHEDULE_METHODS),
    "stop": ("--cache-stop", 0, _SCHEDULE_METHODS),
    "target": ("--cache-taylor-target", None, _SCHEDULE_METHODS),
    "max_skip_steps": ("--cache-max-skip-steps", 1, _MAGCACHE),
    "retention_ratio": ("--cache-retention-ratio", 0, _MAGCACHE),
    "calibrate": ("--cache-calibrate", None, _MAGCACHE),
    "mag_ratios": ("--cache-mag-ratios", None, _MAGCACHE),
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
        max_skip_steps: magcache: at most this many skipped calls in a row (diffusers'
            ``max_skip_steps``, K in the paper; >= 1).
        retention_ratio: magcache: the first ``int(retention_ratio * num_inference_steps +
            0.5)`` calls of a state compute (in ``[0, 1]``).
        calibrate: magcache: compute every call and measure the model's magnitude ratios
            (reported in the request's cache summary under ``"mag_ratios"``).
        mag_ratios: magcache: the ratios file the server loads (``--cache-mag-ratios``;
            ``None``: ``magcache_ratios.json`` beside the model). A server setting: not a
            request's knob (``metadata["server"]``).
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
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    calibrate: bool = False
    mag_ratios: str | None = field(default=None, metadata={"server": True})

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
        max_skip_steps: int | None = None,
        retention_ratio: float | None = None,
        calibrate: bool | None = None,
        mag_ratios: str | None = None,
    ) -> StepCacheConfig:
        """The method's preset with the given knobs replaced.

        Raises:
            ValueError: an unknown or not yet implemented method (the message names ``flag``),
                a knob the method does not take, or a value out of range (``threshold < 0``,
                ``fn < 1`` for fbcache / dbcache or ``< 0`` for taylorseer, ``bn``, ``warmup``,
                ``order`` or ``stop < 0``, ``interval < 1``, a step limit ``< -1``, an unknown
                ``target``; a float knob that is not a finite number (NaN, inf, a bool), an int
                knob that is not an integer; the message names the ``--cache-*`` flag).
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
            max_skip_steps=max_skip_steps, retention_ratio=retention_ratio, calibrate=calibrate,
            mag_ratios=mag_ratios,
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
            kind = _KINDS.get(name)
            if value is not None and kind is float:  # bool is an int: neither kind takes it
                if isinstance(value, bool) or not isinstance(value, Real) or not isfinite(value):
                    raise ValueError(f"{flag_name} must be a finite number, got {value!r}")
            elif value is not None and kind is int:
                if isinstance(value, bool) or not isinstance(value, Integral):
                    raise ValueError(f"{flag_name} must be an integer, got {value!r}")
            if name == "fn":
                low = 1 if method in _THRESHOLD_METHODS else 0
            if name == "target":
                if value not in TAYLOR_TARGETS:
                    raise ValueError(
                        f"{flag_name} must be one of {', '.join(TAYLOR_TARGETS)}, got {value!r}"
                    )
            elif name in ("calibrate", "mag_ratios"):  # magcache's flag and file
                if value is not None and not isinstance(
                    value, (bool if name == "calibrate" else str)
                ):
                    raise ValueError(
                        f"{flag_name} must be a {'boolean' if name == 'calibrate' else 'path'}, got {value!r}"
                    )
            elif name == "retention_ratio" and not 0 <= value <= 1:
                raise ValueError(f"{flag_name} must be in [0, 1], got {value}")
            elif value is not None and value < low:
                raise ValueError(f"{flag_name} must be >= {low}, got {value}")
        for name in ("max_cached_steps", "max_continuous_cached_steps"):
            if knobs.get(name) == -1:  # cache-dit's "no limit"
                knobs[name] = None
        cast = {"threshold": float, "target": str, "retention_ratio": float, "calibrate": bool}
        cast["mag_ratios"] = str
        return cls(
            method, **{k: (v if v is None else cast.get(k, int)(v)) for k, v in knobs.items()}
        )

    def as_request(self) -> dict:
        """This config as a request's ``cache`` object (``/v1/models`` reports a server's
        default this way): ``method`` and the knobs the method takes (its ``--cache-*`` flags'),
        without the server's settings (``mag_ratios``), a step limit of ``None`` (no limit)
        spelled ``-1`` as a request spells it (``null`` there takes the preset);
        ``{"method": "none"}`` when off. Sent back as a request's ``cache``, it resolves to this
        config less its server settings."""
        if not self.enabled:
            return {"method": "none"}
        out: dict = {"method": self.method}
        for f in fields(self):
            if f.name == "method" or f.metadata.get("server"):
                continue
            if self.method not in _FLAGS[f.name][2]:  # another method's knob
                continue
            value = getattr(self, f.name)
            if value is None and f.name in ("max_cached_steps", "max_continuous_cached_steps"):
                value = -1  # cache-dit's "no limit"
            out[f.name] = value
        return out

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
