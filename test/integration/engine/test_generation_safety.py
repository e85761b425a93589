"""Finite is not safe: numbers that are finite in Python but overflow where the model uses them.

On the tiny Z-Image engine: a generation whose latents become NaN/Inf fails with
``NonFiniteOutputError`` (never a blank image) and the engine keeps serving; a LoRA strength whose
effective scale or merged weights are not finite is refused before anything changes; float8 LoRA
files load and give diffusers' pixels exactly.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from fixtures.server import write_zimage_lora
from fixtures.tiny_models import reference_image, reference_pipeline
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sglang.multimodal_gen.errors import InvalidRequestError, NonFiniteOutputError
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

KW = dict(prompt="a watercolor fox", height=32, width=48, num_inference_steps=2, seed=4)


@pytest.fixture(scope="module")
def engine(tiny_zimage_dir):
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as eng:
        yield eng


@pytest.fixture(scope="module")
def lora(tiny_zimage_dir, tmp_path_factory):
    return write_zimage_lora(
        str(tmp_path_factory.mktemp("safety") / "z.safetensors"), tiny_zimage_dir, seed=3
    )


def _image(engine, **fields) -> np.ndarray:
    return np.asarray(engine.generate(SamplingParams(**{**KW, **fields}))[0])


def test_non_finite_generation_fails_and_the_engine_keeps_serving(engine):
    base = _image(engine)
    with pytest.raises(NonFiniteOutputError) as e:
        _image(engine, guidance_scale=1e30)
    assert e.value.param == "guidance_scale" and e.value.status_code == 400
    assert "NaN/Inf latents" in e.value.message and e.value.code == "non_finite_output"
    assert engine.is_alive()
    np.testing.assert_array_equal(_image(engine), base)


def test_strength_overflow_refused_or_fails_clearly(engine, lora, tmp_path):
    base = _image(engine)

    def state():  # counters and high-water marks may move (the merge cache's hits and misses,
        # the process-wide workspace peak: this test alone was the first to raise it); the
        # adapters, compositions and held bytes may not
        out = {k: v for k, v in engine.list_loras().items() if k != "merge_cache"}
        out["memory"] = {k: v for k, v in out["memory"].items() if "peak" not in k}
        return out

    before = state()
    # LoRA values ~1e18: merged at strength 1000 the weights are Inf -> 400, nothing changed
    big = tmp_path / "big.safetensors"
    save_file({k: v * 1e18 for k, v in load_file(lora).items()}, str(big))
    with pytest.raises(InvalidRequestError) as e:
        engine.set_lora("big", str(big), strength=1000.0)
    assert e.value.param == "strength" and "NaN/Inf weights" in e.value.message
    assert state() == before
    # an alpha past the accepted bound (1024 x rank) is refused at load, naming the file
    peft = tmp_path / "peft"
    os.makedirs(peft)
    save_file(
        {k.replace("transformer.", "base_model.model."): v for k, v in load_file(lora).items()},
        str(peft / "adapter_model.safetensors"),
    )
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 3e38}))
    with pytest.raises(InvalidRequestError) as e:
        engine.set_lora("huge_alpha", str(peft), strength=1.0)
    assert e.value.param == "lora_path" and "alpha" in e.value.message
    assert state() == before
    # alpha/r = 1024 (the largest accepted): strength 1e36 makes the scale infinite in float32
    # -> 400 before any layer changes
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4096}))
    with pytest.raises(InvalidRequestError) as e:
        engine.set_lora("huge_alpha", str(peft), strength=1e36)
    assert e.value.param == "strength" and "not finite in float32" in e.value.message
    assert state() == before
    engine.set_lora("huge_alpha", str(peft), strength=1e-30)  # effective scale 1e-27: fine
    with pytest.raises(InvalidRequestError) as e:  # the same overflow per request: param "lora"
        _image(engine, lora=[("huge_alpha", 1e36)])
    assert e.value.param == "lora" and "not finite in float32" in e.value.message
    # finite merged weights, activations overflow: the generation fails, never a black image
    engine.set_lora("a", lora, strength=3e38)
    with pytest.raises(NonFiniteOutputError):
        _image(engine)
    engine.unset_lora()
    np.testing.assert_array_equal(_image(engine), base)


def test_float8_lora_equals_diffusers(engine, tiny_zimage_dir, tiny_zimage_loras, tmp_path):
    src = tiny_zimage_loras[0]
    name = next(f for f in os.listdir(src) if f.endswith(".safetensors"))
    with safe_open(os.path.join(src, name), "pt") as f:
        metadata = f.metadata()
    f8 = tmp_path / "lora_f8"
    f8.mkdir()
    tensors = load_file(os.path.join(src, name))
    save_file(
        {k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()},
        str(f8 / name),
        metadata=metadata,
    )
    fields = {k: v for k, v in KW.items() if k not in ("prompt", "seed")}
    pipe = reference_pipeline(tiny_zimage_dir)
    pipe.load_lora_weights(str(f8), adapter_name="f8")
    pipe.set_adapters(["f8"], [0.7])
    ref = reference_image(pipe, KW["prompt"], KW["seed"], guidance_scale=0.0, **fields)
    engine.set_lora("f8", str(f8), strength=0.7)
    try:
        np.testing.assert_array_equal(_image(engine, guidance_scale=0.0), ref)
    finally:
        engine.unset_lora()


def test_a_per_request_lora_scale_that_blows_up_is_named(engine, lora):
    """The output check names guidance values; an extreme per-request adapter scale is named
    too (``param: "lora"``) instead of no field at all."""
    engine.set_lora("a", lora, strength=1.0)
    engine.unset_lora()  # loaded, not active
    with pytest.raises(NonFiniteOutputError) as e:
        _image(engine, lora=[("a", 3e38)])
    assert e.value.param == "lora" and "'a' at scale 3e+38" in e.value.message
    with pytest.raises(NonFiniteOutputError) as e:  # a guidance value still comes first
        _image(engine, guidance_scale=1e30, lora=[("a", 3e38)])
    assert e.value.param == "guidance_scale"
    # in a batch (rows with their own compositions): the same for that request, the other one
    # is served
    bad, good = engine.generate_batch(
        [SamplingParams(**{**KW, "lora": [("a", 3e38)]}), SamplingParams(**KW)]
    )
    assert isinstance(bad, NonFiniteOutputError) and bad.param == "lora", bad
    np.testing.assert_array_equal(np.asarray(good[0]), _image(engine))
