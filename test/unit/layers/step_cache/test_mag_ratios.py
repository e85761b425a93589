"""MagCache's ratios file: resampling equals diffusers' ``nearest_interp`` (0.42.1), a state finds
its own list or the documented fallback, calibration runs average per call, and a bad file is
refused naming its path."""

from __future__ import annotations

import json

import pytest
import torch
from sglang.multimodal_gen.layers.step_cache.mag_ratios import MagRatios, nearest_interp

RATIOS = [1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 0.98047, 0.93359, 0.89062]


@pytest.mark.parametrize("length", [1, 2, 5, 9, 13, 28, 50])
def test_nearest_interp_is_diffusers(length):
    from diffusers.hooks.mag_cache import nearest_interp as reference

    expected = reference(torch.tensor(RATIOS, dtype=torch.float64), length).tolist()
    assert nearest_interp(RATIOS, length) == expected


def test_a_state_takes_its_list_resampled_to_the_request_steps():
    r = MagRatios(
        9,
        {
            "blocks/0/cond": tuple(RATIOS),
            "blocks/0/uncond": tuple(x + 0.5 for x in RATIOS),
            "blocks/1/cond": (1.0, 0.5, 0.25),  # a second expert's 3 calls of the 9 steps
        },
    )
    assert r.for_state("blocks/0/uncond", 9) == [x + 0.5 for x in RATIOS]
    assert r.for_state("blocks/0/cond", 5) == nearest_interp(RATIOS, 5)
    assert r.for_state("blocks/0/joint", 9) == RATIOS  # another context of the same denoiser
    assert r.for_state("blocks/1/cond", 18) == nearest_interp([1.0, 0.5, 0.25], 6)
    assert r.for_state("other/3/cond", 9) == RATIOS  # nothing closer: the first list


def test_average_and_round_trip(tmp_path):
    runs = [{"blocks/0/cond": [1.0, 0.8, 0.6]}, {"blocks/0/cond": [1.0, 1.0, 1.0]}]
    r = MagRatios.average(runs, 3)
    assert r.ratios == {"blocks/0/cond": (1.0, 0.9, 0.8)}
    path = str(tmp_path / "r.json")
    r.save(path)
    assert MagRatios.load(path).ratios == r.ratios
    assert MagRatios.find(None, path).num_inference_steps == 3
    assert MagRatios.find(str(tmp_path)) is None  # no magcache_ratios.json there


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a MagCache ratios file"),
        ({"ratios": {"a": [1.0]}}, "missing field 'num_inference_steps'"),
        ({"num_inference_steps": 2, "ratios": {"a": [1.0, -1.0]}}, "not a finite ratio > 0"),
        ({"num_inference_steps": 2, "ratios": {"a": [1.0, "x"]}}, "not a number"),
        ({"num_inference_steps": 2, "ratios": {}}, "ratios must be a non-empty object"),
        # each field by kind, named
        ([1.0, 2.0], "the file holds a JSON list, not an object"),
        ("3", "the file holds a JSON number, not an object"),
        (
            {"num_inference_steps": True, "ratios": {"a": [1.0]}},
            "num_inference_steps must be an integer >= 1, got true",
        ),  # fmt: skip
        ({"num_inference_steps": 2.0, "ratios": {"a": [1.0]}}, "num_inference_steps must be"),
        ({"num_inference_steps": "2", "ratios": {"a": [1.0]}}, "num_inference_steps must be"),
        ({"num_inference_steps": 0, "ratios": {"a": [1.0]}}, "num_inference_steps must be"),
        ({"num_inference_steps": 2}, "missing field 'ratios'"),
        (
            {"num_inference_steps": 2, "ratios": [[1.0]]},
            "ratios must be a non-empty object of lists, got list",
        ),  # fmt: skip
        (
            {"num_inference_steps": 2, "ratios": {"a": 1.0}},
            "ratios\\['a'\\] must be a non-empty list, got number",
        ),  # fmt: skip
        ({"num_inference_steps": 2, "ratios": {"a": [True]}}, "holds true, not a number"),
        (
            {"method": "teacache", "num_inference_steps": 2, "ratios": {"a": [1.0]}},
            'method must be "magcache"',
        ),  # fmt: skip
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message) as e:
        MagRatios.load(str(path))
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match="--cache-mag-ratios .*: no such file"):
        MagRatios.find(None, str(tmp_path / "missing.json"))
