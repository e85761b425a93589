"""``StepCacheConfig.of``: each method's presets, its knobs, and the refusals naming the flag."""

from __future__ import annotations

import re

import pytest
import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.layers.step_cache import CacheRow, RequestCache, StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.config import _PRESETS, IMPLEMENTED_CACHE_METHODS


def test_presets():
    # the module docstring says why they depart from diffusers' / cache-dit's defaults
    fb = StepCacheConfig("fbcache", 0.3, 1, 0, 0, max_continuous_cached_steps=4)
    assert StepCacheConfig.of("fbcache") == fb
    db = StepCacheConfig("dbcache", 0.3, None, 0, 2, max_continuous_cached_steps=4)
    assert StepCacheConfig.of("dbcache") == db
    ts = StepCacheConfig.of("taylorseer")
    assert (ts.fn, ts.bn, ts.warmup, ts.interval, ts.order, ts.stop, ts.target) == (
        0, 0, 3, 3, 1, None, "residual"
    )  # fmt: skip
    assert StepCacheConfig.of("taylorseer", order=2, interval=3, stop=20, bn=1).order == 2
    assert not StepCacheConfig.of("none").enabled
    assert ts.scheduled and not StepCacheConfig.of("dbcache").scheduled


REFUSALS = [
    (("teacache",), dict(fn=1), "--cache-fn does not apply to --cache-method teacache"),
    (("magcache",), dict(fn=1), "--cache-fn does not apply to --cache-method magcache"),
    (("magcache",), dict(max_skip_steps=0), "--cache-max-skip-steps must be >= 1, got 0"),
    (("magcache",), dict(retention_ratio=1.5), "retention-ratio must be in .0, 1., got 1.5"),
    (("magcache",), dict(calibrate=1), "--cache-calibrate must be a boolean, got 1"),
    (("dbcache",), dict(max_skip_steps=2), "--cache-max-skip-steps does not apply to"),
    (("fastcache",), {}, "--cache-method 'fastcache' is unknown"),
    (("dbcache",), dict(fn=0), "--cache-fn must be >= 1, got 0"),
    (("fbcache",), dict(threshold=-1), "--cache-threshold must be >= 0"),
    (("taylorseer",), dict(fn=-1), "--cache-fn must be >= 0, got -1"),
    (("taylorseer",), dict(interval=0), "--cache-interval must be >= 1, got 0"),
    (("taylorseer",), dict(order=-1), "--cache-order must be >= 0, got -1"),
    (("taylorseer",), dict(target="x"), "--cache-taylor-target must be one of residual, output"),
    (("taylorseer",), dict(threshold=0.1), "--cache-threshold does not apply to --cache-method "),
    (("dbcache",), dict(interval=2), "--cache-interval does not apply to --cache-method dbcache"),
    (("fbcache",), dict(max_cached_steps=-2), "--cache-max-cached-steps must be >= -1, got -2"),
    (
        ("dbcache",),
        dict(max_continuous_cached_steps=-3),
        "--cache-max-continuous-cached-steps must be >= -1, got -3",
    ),
    (("taylorseer",), dict(max_cached_steps=2), "--cache-max-cached-steps does not apply to "),
]
NAN, INF = float("nan"), float("inf")
# by kind: every float knob refuses NaN, inf and a bool; every int knob a bool and a fraction
FLOAT_KNOBS = [("fbcache", "threshold"), ("teacache", "threshold"), ("magcache", "threshold"),
               ("magcache", "retention_ratio")]  # fmt: skip
INT_KNOBS = [("dbcache", k) for k in ("fn", "bn", "warmup", "max_cached_steps",
                                      "max_continuous_cached_steps")]  # fmt: skip
INT_KNOBS += [("taylorseer", k) for k in ("interval", "order", "stop")]
INT_KNOBS += [("magcache", "max_skip_steps")]
REFUSALS += [
    ((m,), {k: v}, f"--cache-{k.replace('_', '-')} must be a finite number, got {v!r}")
    for m, k in FLOAT_KNOBS
    for v in (NAN, INF, -INF, True)
]
REFUSALS += [
    ((m,), {k: v}, f"--cache-{k.replace('_', '-')} must be an integer, got {v!r}")
    for m, k in INT_KNOBS
    for v in (True, 2.5)
]


@pytest.mark.parametrize("args, knobs, message", REFUSALS)
def test_refusals(args, knobs, message):
    with pytest.raises(ValueError, match=message):
        StepCacheConfig.of(*args, **knobs)


def test_fn_and_bn_must_leave_a_middle_block():
    cfg = StepCacheConfig.of("dbcache", fn=3, bn=1)
    with pytest.raises(
        ValueError, match="Fn=3 \\+ Bn=1 leaves no block to cache in a sequence of 4"
    ):
        toy.ours(toy.model(), toy.steps(1, 1, 0.1, n=1), torch.ones(1, toy.D),
                 [CacheRow(RequestCache(cfg))])  # fmt: skip


def test_step_limits_and_scaled_fn():
    """cache-dit's step limits: ``-1`` is no limit (``None``); the dbcache preset's ``Fn``
    scales with the block count, a given ``--cache-fn`` is kept."""
    cfg = StepCacheConfig.of("fbcache", max_cached_steps=-1, max_continuous_cached_steps=0)
    assert (cfg.max_cached_steps, cfg.max_continuous_cached_steps) == (None, 0)
    db = StepCacheConfig.of("dbcache")
    assert [db.head_blocks(n) for n in (2, 3, 8, 30, 57)] == [1, 1, 2, 7, 8]
    assert StepCacheConfig.of("dbcache", fn=3).head_blocks(57) == 3
    assert StepCacheConfig.of("fbcache").head_blocks(57) == 1


def _docstring_table() -> list[dict[str, str]]:
    """The preset table of the module docstring, read as an rst simple table: the ``=`` borders
    give the columns, and a cell's text must stay inside its column (else docutils calls the
    table malformed)."""
    import sglang.multimodal_gen.layers.step_cache.config as config

    lines = config.__doc__.splitlines()
    borders = [i for i, ln in enumerate(lines) if ln.startswith("=") and set(ln) <= {"=", " "}]
    assert len(borders) == 3, "the table has a top, a header and a bottom border"
    top = lines[borders[0]]
    assert lines[borders[1]] == top == lines[borders[2]]
    spans = [(m.start(), m.end()) for m in re.finditer("=+", top)]
    rows = []
    for ln in [lines[borders[0] + 1]] + lines[borders[1] + 1 : borders[2]]:
        gaps = [ln[e:s] for (_, e), (s, _) in zip(spans, spans[1:])] + [ln[spans[-1][1] :]]
        assert all(not g.strip() for g in gaps), f"a cell leaves its column: {ln!r}"
        rows.append([ln[s:e].strip() for s, e in spans])
    head = rows[0]
    return [dict(zip(head, r)) for r in rows[1:]]


def test_the_docstring_preset_table_is_well_formed_and_true():
    """Every implemented method has a row; each cell is the preset's value (``--``: the method
    takes no such knob; ``L/4`` / ``family`` / ``None``: the preset leaves it ``None``)."""
    rows = {r["method"]: r for r in _docstring_table()}
    assert set(rows) == {m for m in IMPLEMENTED_CACHE_METHODS if m != "none"}
    columns = dict(
        threshold="threshold", Fn="fn", Bn="bn", warmup="warmup", interval="interval",
        order="order", stop="stop", target="target", C="max_continuous_cached_steps",
    )  # fmt: skip
    for method, row in rows.items():
        preset = _PRESETS[method]
        for col, knob in columns.items():
            cell = row[col]
            if cell == "--":
                assert knob not in preset, (method, col)
                continue
            value = preset[knob]
            if cell in ("L/4", "family", "None"):
                assert value is None, (method, col)
            else:
                assert value == type(value)(cell), (method, col, cell)
