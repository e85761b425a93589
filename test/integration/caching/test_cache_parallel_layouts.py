"""Every step-cache method under every parallel layout: the ranks agree on every decision, so a
request gets the single-process skip counts and image.

One parallel engine per layout serves one request per method (the request's own ``cache``), and
each is compared with the same request on one process (the ``step_cache`` counts of the image,
the pixels):

* TP 2 on the tiny Flux.1 [dev]: the ranks hold the same activations; the compute flags are
  agreed (max over the TP group), TaylorSeer's and MagCache's schedules read no tensor.
* Ulysses 2 on the tiny Flux.1 [dev]: each rank measures its shard of the tokens; FBCache's,
  DBCache's and TeaCache's sums are all-reduced over the sequence-parallel group before the
  decision (a toy case whose shards decide differently alone:
  ``test/unit/layers/step_cache/test_base.py::
  test_sequence_parallel_shards_add_their_sums_before_deciding``).
* CFG parallelism on the tiny Z-Image: the cond and uncond rows of a request (one cache state, as
  in diffusers' one batched forward) sit on different ranks; their sums are all-reduced over the
  CFG group.

MagCache's ratios are calibrated here (a calibration request on one process, the ratios file
written beside a copy of the model, where both engines find it). Thresholds (fp32, CPU, 32x32,
6 steps) sit inside ranges of thresholds that all give the same decisions, so a rounding
difference of the parallel sums cannot move one: Flux FBCache / DBCache 0.6 (0.5 and 0.7 skip the
same 4 steps, 0.38 skips 1), TeaCache 0.25 (0.2 and 0.3: 2 skipped), MagCache 0.18 (0.12 and
0.25: 4 skipped); Z-Image DBCache 0.8 (0.75 to 0.85: 3), TeaCache 0.6 (0.4 to 0.8: 4),
MagCache 0.16 (0.14 and 0.18: 4; its decisions read no tensor anyway). Z-Image FBCache 0.799
guards the CFG-group sum: at step 3 the request's ratio is 0.8013 (computed) while the uncond
branch's alone is 0.7956 (skipped) and the cond branch's 0.8071; its other ratios are at least
0.05 from the threshold (3 steps skipped). TaylorSeer runs its preset (warmup 3, interval 3:
steps 4 and 5 predicted). Every method skips steps (asserted: the one-process cached image misses
the uncached one by the bar, 70 dB). Measured: identical counts and pixels (inf dB) in every case.

Dropping the CFG-group sum fails the Z-Image case (the branches' ranks part ways at step 3).
Tiers: a parallel engine costs about 28 s to
start and stop on 2 cores, so the three layouts are extended (``test/conftest.py``); the default
tier runs every method but MagCache through the session's shared TP 2 engine on the tiny Z-Image
(:func:`test_tp2_shared_engine_equals_one_process`, about 2 s).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.layers.step_cache.mag_ratios import RATIOS_FILE, MagRatios
from sglang.multimodal_gen.outputs import STEP_CACHE_INFO
from sglang.multimodal_gen.runtime import DiffusionEngine

MIN_PSNR = 70.0
STEPS = 6
FIELDS = dict(prompt="a small red fox", seed=42, height=32, width=32, num_inference_steps=STEPS)
MODELS = {  # model fixture, request fields
    "flux": ("tiny_flux_dev_dir", dict(FIELDS, guidance_scale=3.5)),
    "zimage": (
        "tiny_zimage_dir",
        dict(FIELDS, guidance_scale=3.5, negative_prompt="blurry, low quality"),
    ),
}
THRESHOLDS = {  # method -> threshold per model (module docstring)
    "fbcache": {"flux": 0.6, "zimage": 0.799},
    "dbcache": {"flux": 0.6, "zimage": 0.8},
    "teacache": {"flux": 0.25, "zimage": 0.6},
    "magcache": {"flux": 0.18, "zimage": 0.16},
}
METHODS = ("fbcache", "dbcache", "teacache", "magcache", "taylorseer")
LAYOUTS = {  # model, engine layout
    "flux-tp2": ("flux", dict(tp_size=2)),
    "flux-ulysses2": ("flux", dict(ulysses_degree=2)),
    "zimage-cfg2": ("zimage", dict(cfg_degree=2)),
}


def _cache(method: str, model: str) -> dict:
    cache = {"method": method}
    if method in THRESHOLDS:
        cache["threshold"] = THRESHOLDS[method][model]
    return cache


def _generate(engine, fields, cache) -> tuple[np.ndarray, dict | None]:
    """``(pixels, step-cache counts or None)`` of one request."""
    image = engine.generate(**fields, cache=cache)[0]
    return np.asarray(image.convert("RGB")), image.info.get(STEP_CACHE_INFO)


@pytest.fixture(scope="module")
def one_process(request, tmp_path_factory):
    """``one_process(model) -> (model dir, {method: (pixels, counts)}, uncached pixels)``: a copy
    of the model with its MagCache ratios calibrated beside it, and every method's request on
    one process (computed once per model)."""
    done: dict[str, tuple] = {}

    def get(model: str):
        if model not in done:
            fixture, fields = MODELS[model]
            path = str(tmp_path_factory.mktemp(f"{model}_with_ratios") / "model")
            shutil.copytree(request.getfixturevalue(fixture), path)
            with DiffusionEngine(path, device="cpu") as e:
                _, counts = _generate(e, fields, {"method": "magcache", "calibrate": True})
            ratios = {k: tuple(v) for k, v in counts["mag_ratios"].items()}
            MagRatios(STEPS, ratios).save(os.path.join(path, RATIOS_FILE))
            with DiffusionEngine(path, device="cpu") as e:
                uncached, _ = _generate(e, fields, "none")
                runs = {m: _generate(e, fields, _cache(m, model)) for m in METHODS}
            done[model] = (path, runs, uncached)
        return done[model]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layout_equals_one_process(name, one_process):
    model, layout = LAYOUTS[name]
    path, runs, uncached = one_process(model)
    fields = MODELS[model][1]
    failures = []
    with DiffusionEngine(path, device="cpu", **layout) as e:
        for method in METHODS:
            one, counts = runs[method]
            assert counts["steps_skipped"] > 0, (method, counts)
            assert psnr(one, uncached) < MIN_PSNR, method  # the skipped steps changed the image
            got, got_counts = _generate(e, fields, _cache(method, model))
            if got_counts != counts or psnr(got, one) < MIN_PSNR:
                failures.append(f"{method}: {got_counts} {psnr(got, one):.1f} dB vs {counts}")
    assert not failures, f"{name}: " + "; ".join(failures)


def test_tp2_shared_engine_equals_one_process(zimage_tp2_engine, one_process):
    """The default tier's case: the session's TP 2 engine on the tiny Z-Image (no ratios file
    beside it, so MagCache, whose decisions read no tensor, is left to the layouts above)."""
    _, runs, _ = one_process("zimage")
    fields = MODELS["zimage"][1]
    for method in METHODS:
        if method == "magcache":
            continue
        one, counts = runs[method]
        assert counts["steps_skipped"] > 0, (method, counts)
        got, got_counts = _generate(zimage_tp2_engine, fields, _cache(method, "zimage"))
        assert got_counts == counts, f"{method}: {got_counts} at TP 2, {counts} on one process"
        assert psnr(got, one) >= MIN_PSNR, f"{method}: {psnr(got, one):.1f} dB"
