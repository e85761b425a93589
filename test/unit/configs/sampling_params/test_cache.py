"""The ``cache`` field (kind ``cache``): a request's step caching, resolved once.

Its value forms (a method name, an object of knobs, a ``StepCacheConfig``) resolve to the
``StepCacheConfig`` ``StepCacheConfig.of`` builds for the same knobs; the model's blocks bound
``fn + bn``; a server may refuse the field; only ``fn`` / ``bn`` (and on / off) split batches.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from sglang.multimodal_gen.configs.sampling_params import (
    RequestLimits,
    RequestSpec,
    cache_json,
    step_cache_value,
)
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig

OFF = StepCacheConfig()
SPEC = RequestSpec(
    "zimage",
    "Z-Image",
    ZImageSamplingParams,
    ZImageSamplingParams(height=64, width=64, num_inference_steps=4, cache=OFF),
    RequestLimits(max_image_size=1024),
    spatial_factor=16,
    cache_blocks=10,
)


def _resolve(spec=SPEC, **fields):
    return spec.resolve(spec.params(prompt="p", **fields))


@pytest.mark.parametrize(
    "value,expected",
    [
        ("fbcache", StepCacheConfig.of("fbcache")),
        ({"method": "dbcache"}, StepCacheConfig.of("dbcache")),
        # 0.05 is the class default, not dbcache's 0.3: still this request's
        ({"method": "dbcache", "threshold": 0.05, "fn": 2}, StepCacheConfig.of("dbcache", 0.05, 2)),
        (
            StepCacheConfig.of("dbcache", 0.05, 3, 1, 0),
            StepCacheConfig.of("dbcache", 0.05, 3, 1, 0),
        ),
        (
            {"method": "fbcache", "threshold": 0.2, "warmup": None},
            StepCacheConfig.of("fbcache", 0.2),
        ),
        ("none", OFF),
    ],
)
def test_each_form_resolves_to_the_config_of_its_knobs(value, expected):
    assert step_cache_value(value) == expected
    assert _resolve(cache=value).cache == expected


@pytest.mark.parametrize("method", ["fbcache", "dbcache"])
def test_a_config_without_step_limits_keeps_none_when_resolved(method):
    """``--cache-max-continuous-cached-steps -1`` (no limit, ``None`` in the config) passes
    through resolution as ``None``, not as the preset's limit of 4 (``sglang generate`` and a
    server's default cache are ``StepCacheConfig`` values resolved again per request)."""
    unlimited = StepCacheConfig.of(
        method, threshold=0.2, max_cached_steps=-1, max_continuous_cached_steps=-1
    )
    assert unlimited.max_continuous_cached_steps is None
    assert step_cache_value(unlimited) == unlimited
    spec = dataclasses.replace(SPEC, defaults=SPEC.defaults.replace(cache=unlimited))
    assert _resolve(spec).cache == unlimited
    assert _resolve(cache=unlimited).cache == unlimited


def test_without_the_field_the_model_default_applies():
    assert _resolve().cache == OFF
    on = StepCacheConfig.of("fbcache", 0.3)
    spec = dataclasses.replace(SPEC, defaults=SPEC.defaults.replace(cache=on))
    assert _resolve(spec).cache == on
    assert _resolve(spec, cache="none").cache == OFF  # a request may turn it off
    assert cache_json(on) == {
        "method": "fbcache", "threshold": 0.3, "fn": 1, "bn": 0, "warmup": 0,
        "max_cached_steps": -1, "max_continuous_cached_steps": 4,
    }  # fmt: skip
    assert {p["name"]: p["default"] for p in spec.parameters()}["cache"]["threshold"] == 0.3
    assert cache_json(OFF) == {"method": "none"}


SERVER_CACHES = [  # a server's --cache-* settings, knobs away from the presets
    StepCacheConfig.of("fbcache", 0.2, max_cached_steps=-1, max_continuous_cached_steps=-1),
    StepCacheConfig.of("dbcache", 0.1, 2, 1, 3, max_cached_steps=9),
    StepCacheConfig.of("taylorseer", warmup=2, interval=4, order=2, stop=7, target="output"),
    StepCacheConfig.of("teacache", 0.4, warmup=2),
    StepCacheConfig.of("magcache", 0.1, max_skip_steps=2, retention_ratio=0.3, mag_ratios="r.json"),
]


@pytest.mark.parametrize("server", SERVER_CACHES, ids=lambda c: c.method)
def test_the_models_reported_cache_is_accepted_back_as_a_request_cache(server):
    """``/v1/models``' ``cache`` default (:meth:`RequestSpec.parameters`) sent back as a
    request's ``cache`` (through JSON) is accepted and resolves to the server's config, less
    its server setting (``mag_ratios``): no server-only key, no knob of another method, ``-1``
    for no step limit (``null`` would take the preset's)."""
    spec = dataclasses.replace(SPEC, defaults=SPEC.defaults.replace(cache=server))
    reported = {p["name"]: p["default"] for p in spec.parameters()}["cache"]
    sent = json.loads(json.dumps(reported))
    assert "mag_ratios" not in sent
    assert _resolve(cache=sent).cache == dataclasses.replace(server, mag_ratios=None)
    assert spec.as_dict()["cache"] == reported


def test_the_models_blocks_bound_fn_plus_bn():
    assert _resolve(cache={"method": "dbcache", "fn": 8, "bn": 1}).cache.fn == 8
    with pytest.raises(InvalidRequestError, match="fn 8 \\+ bn 2 leave none of this model's 10"):
        _resolve(cache={"method": "dbcache", "fn": 8, "bn": 2})
    unsupported = dataclasses.replace(SPEC, cache_blocks=0)
    with pytest.raises(InvalidRequestError, match="Z-Image models do not support step caching"):
        _resolve(unsupported, cache="fbcache")
    assert _resolve(unsupported, cache="none").cache == OFF


def test_a_server_that_denies_the_field_refuses_any_value():
    deny = dataclasses.replace(SPEC, request_cache=False)
    for value in ("fbcache", "none", OFF):
        with pytest.raises(InvalidRequestError, match="--cache-request-policy deny") as e:
            _resolve(deny, cache=value)
        assert e.value.param == "cache"
    assert _resolve(deny).cache == OFF  # the model's default still applies


def test_only_fn_bn_and_on_off_split_a_batch():
    def key(value):
        return _resolve(cache=value).batch_key()

    fb = key({"method": "fbcache", "threshold": 0.1})
    assert fb == key({"method": "fbcache", "threshold": 0.9, "warmup": 2})
    assert fb == key({"method": "dbcache", "fn": 1})  # another method, the same Fn / Bn
    assert fb != key({"method": "fbcache", "fn": 2})
    assert fb != key({"method": "fbcache", "bn": 1})
    assert fb != key("none")
    assert key("none") == _resolve().batch_key()
