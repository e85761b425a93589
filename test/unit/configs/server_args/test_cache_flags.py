"""``--cache-method`` and its knobs: ``sglang serve`` (``ServerArgs``) and ``sglang generate``
accept the implemented methods, refuse the contract's others and bad values naming the flag
(``generate``: exit 2 before any model is read), and hand the configuration to the engine."""

from __future__ import annotations

import argparse

import pytest
from fixtures.cli import generate_errors
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.runtime.model_source import job_kwargs


def _parse(argv):
    return ServerArgs.from_cli_args(
        ServerArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    )


def test_serve_flags_set_the_configuration(tmp_path):
    model = ["--model-path", str(tmp_path), "--model-type", "diffusion"]
    assert _parse(model).step_cache is None  # default: off
    a = _parse([*model, "--cache-method", "fbcache", "--cache-threshold", "0.12"])
    assert a.step_cache == StepCacheConfig("fbcache", 0.12, 1, 0, 0, max_continuous_cached_steps=4)
    assert job_kwargs(a)["step_cache"] == a.step_cache  # what the engine and followers get
    b = _parse([*model, "--cache-method", "dbcache", "--cache-fn", "4", "--cache-bn", "2",
                "--cache-warmup", "3"])  # fmt: skip
    assert b.step_cache == StepCacheConfig("dbcache", 0.3, 4, 2, 3, max_continuous_cached_steps=4)
    c = _parse([*model, "--cache-method", "taylorseer", "--cache-interval", "4", "--cache-order",
                "2", "--cache-stop", "20", "--cache-taylor-target", "output"])  # fmt: skip
    assert c.step_cache == StepCacheConfig.of(
        "taylorseer", interval=4, order=2, stop=20, target="output"
    )
    assert (c.step_cache.warmup, c.step_cache.fn) == (3, 0)  # the preset's
    d = _parse([*model, "--cache-method", "magcache", "--cache-max-skip-steps", "2",
                "--cache-retention-ratio", "0.3", "--cache-mag-ratios", "r.json"])  # fmt: skip
    assert d.step_cache == StepCacheConfig.of(
        "magcache", max_skip_steps=2, retention_ratio=0.3, mag_ratios="r.json"
    )
    assert (d.step_cache.threshold, d.step_cache.fn) == (0.2, 0)  # the magcache preset


BAD = [
    (["--cache-method", "teacache", "--cache-fn", "1"], "--cache-fn does not apply to --cache-"),
    (["--cache-method", "magic"], "--cache-method 'magic' is unknown"),
    (["--cache-method", "dbcache", "--cache-fn", "0"], "--cache-fn must be >= 1, got 0"),
    (["--cache-method", "fbcache", "--cache-threshold", "-1"], "--cache-threshold must be >= 0"),
    (["--cache-method", "taylorseer", "--cache-interval", "0"], "--cache-interval must be >= 1"),
    (["--cache-method", "magcache", "--cache-max-skip-steps", "0"], "--cache-max-skip-steps must"),
    (["--cache-method", "dbcache", "--cache-mag-ratios", "r.json"], "--cache-mag-ratios does not"),
]


@pytest.mark.parametrize("flags, message", BAD)
def test_serve_refuses(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        _parse(["--model-path", str(tmp_path), "--model-type", "diffusion", *flags])


@pytest.mark.parametrize("flags, message", BAD[:3])
def test_generate_refuses_before_loading(flags, message, tmp_path, capsys, monkeypatch):
    err = generate_errors(flags, tmp_path, capsys, monkeypatch)
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize(
    "flags",
    [
        ["--cache-method", "fbcache", "--cache-threshold", "nan"],
        ["--cache-method", "teacache", "--cache-threshold", "inf"],
        ["--cache-method", "magcache", "--cache-retention-ratio", "nan"],
    ],
)
def test_generate_names_the_flag_of_a_non_finite_value(flags, tmp_path, capsys, monkeypatch):
    """``sglang generate``'s error names the ``--cache-*`` flag, not the request's
    ``cache.<knob>`` key, and comes before any model is read."""
    err = generate_errors(flags, tmp_path, capsys, monkeypatch)
    assert err == [f"sglang generate: error: {flags[2]} must be a finite number, got {flags[3]}"]
