"""LoRA on quantized bases: the tiny Flux.1-dev exported as ModelOpt FP8 and NVFP4 checkpoints
(``models.quantized_export.export_quantized``, served as one ``--model-path`` repo whose
``transformer/config.json`` carries the ``quantization_config``), with a random peft-format
LoRA on every linear layer (embedders and final layers included; non-zero ``lora_A`` and
``lora_B``).

* Reference: diffusers' ``FluxPipeline`` with the transformer's weights replaced by
  ``dequantized_state_dict`` (what the quantized checkpoint stands for) and the same LoRA file
  loaded with ``load_lora_weights`` (peft). ``merge_mode: "auto"`` merges the unquantized layers
  (embedders, ``proj_out``, ``norm_out``) and runs the quantized ones unmerged; a request's own
  ``lora`` runs every layer unmerged (per row).
* A mixed batch (rows with the global composition, none, ``a``, ``b``, ``a + b``) on a quantized
  base: each row bit-equal to the request alone.
* ``merge_mode: "merge"`` over HTTP: 400 in the OpenAI envelope, ``param`` ``merge_mode``, the
  message naming the quantized base weight; nothing changes.
* TP 2 (NVFP4: each rank holds its 16-column blocks and its rows of the per-source scales) with
  an unmerged LoRA, global and per request: the one-process pixels.

Measured (fp32, CPU, 32x32, 2 steps): against diffusers inf dB (identical pixels) for FP8 and
NVFP4, globally in auto mode and per request (83.0 dB for FP8 on another prompt); the image
without the LoRA 13.6 dB from it; mixed-batch rows bit-equal to their single runs; TP 2
bit-equal to one process.
"""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
from fixtures.server import assert_envelope, running_server
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr, random_peft_lora
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.quantized_export import (
    copy_with_transformer,
    dequantized_state_dict,
    export_quantized,
)
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

FORMATS = ("modelopt-fp8", "modelopt-nvfp4")
KW = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5)
PROMPT, SEED, STRENGTH = "a red fox in the snow", 7, 0.8
MIN_PSNR = 45.0
MAX_PSNR_VS_BASE = 30.0
COMPOSITIONS = [None, [], [("a", 0.8)], [("b", 1.2)], [("a", -0.6), ("b", 0.9)]]


@pytest.fixture(scope="module")
def quantized(tiny_flux_dev_dir, tmp_path_factory) -> dict:
    """``{fmt: (repo, transformer folder)}`` and the two LoRA files (``"loras"``)."""
    root = tmp_path_factory.mktemp("quantized_flux")
    out = {}
    for fmt in FORMATS:
        tdir = str(root / f"{fmt}_transformer")
        done = export_quantized(os.path.join(tiny_flux_dev_dir, "transformer"), tdir, fmt)
        assert len(done) == 40, done  # the blocks' linear layers; embedders and outputs kept
        out[fmt] = (copy_with_transformer(tiny_flux_dev_dir, str(root / fmt), tdir), tdir)
    out["loras"] = tuple(
        random_peft_lora(tiny_flux_dev_dir, str(root / name), seed=s)
        for name, s in (("a", 1), ("b", 2))
    )
    out["root"] = str(root)
    return out


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def engine(quantized, fmt):
    with DiffusionEngine(quantized[fmt][0], device="cpu", lora_dirs=[quantized["root"]]) as eng:
        eng.set_lora(["a", "b"], list(quantized["loras"]), strength=[STRENGTH, 0.0])
        yield eng


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"prompt": PROMPT, "seed": SEED, **KW, **kw})


def _image(engine, **kw) -> np.ndarray:
    return np.asarray(engine.generate(_params(**kw))[0])


def _quantized_layers(engine) -> dict:
    """``{module: quantization method name}`` of the transformer's LoRA layers."""
    manager = engine._executor.runner.lora_manager
    return {n: m.base_layer.quant_method.name for n, m in manager.layers("transformer").items()}


def test_auto_mode_and_per_request_match_diffusers(engine, quantized, tiny_flux_dev_dir, fmt):
    methods = _quantized_layers(engine)
    n_quantized = sum(m != "unquantized" for m in methods.values())
    assert n_quantized == 26 and set(methods.values()) == {"unquantized", fmt.split("-")[1]}
    active = engine.list_loras()["active"]["transformer"]
    # auto: the quantized layers run unmerged, the unquantized ones merge as before
    assert active["dynamic_layers"] == n_quantized
    assert active["merged_layers"] == len(methods) - n_quantized
    pipe = reference_flux(tiny_flux_dev_dir)
    pipe.transformer.load_state_dict(dequantized_state_dict(quantized[fmt][1]), strict=True)
    without = reference_flux_images(pipe, PROMPT, SEED, **KW)[0]
    pipe.load_lora_weights(quantized["loras"][0], adapter_name="a")
    pipe.set_adapters(["a"], [STRENGTH])
    expected = reference_flux_images(pipe, PROMPT, SEED, **KW)[0]
    got = _image(engine)
    assert psnr(got, expected) >= MIN_PSNR  # measured: inf (FP8 and NVFP4)
    assert psnr(got, without) < MAX_PSNR_VS_BASE  # measured: 13.6 dB
    # a request without adapters while the global one is merged into the unquantized layers:
    # those layers compute it with their pre-merge weights
    assert psnr(_image(engine, lora=[]), without) >= MIN_PSNR  # measured: inf
    engine.unset_lora()
    try:
        assert np.array_equal(_image(engine, lora=[]), _image(engine))
        assert psnr(_image(engine), without) >= MIN_PSNR  # the quantized base alone
        per_request = _image(engine, lora=[("a", STRENGTH)])  # every layer unmerged, per row
        assert psnr(per_request, expected) >= MIN_PSNR
    finally:
        engine.set_lora(["a", "b"], [None, None], strength=[STRENGTH, 0.0])


def test_mixed_batch_rows_equal_each_request_alone(engine):
    reqs = [
        _params(prompt=("a red fox", "a lighthouse at dusk")[i % 2], seed=10 + i, lora=comp)
        for i, comp in enumerate(COMPOSITIONS)
    ]
    single = [np.asarray(engine.generate(r)[0]) for r in reqs]
    out = engine.generate_batch(reqs)
    for i, (alone, (image,)) in enumerate(zip(single, out)):
        assert np.array_equal(alone, np.asarray(image)), f"row {i} ({COMPOSITIONS[i]})"
    # the compositions matter: the same request under two of them is far apart
    other = np.asarray(engine.generate(reqs[2].replace(lora=COMPOSITIONS[3]))[0])
    assert psnr(other, single[2]) < MAX_PSNR_VS_BASE


def test_merge_mode_merge_is_refused_over_http(engine, fmt):
    manager = engine._executor.runner.lora_manager
    weights = {n: m.base_layer.weight.clone() for n, m in manager.layers("transformer").items()}
    before = engine.list_loras()["active"]
    image = _image(engine)
    with running_server(engine) as (url, _app, _server):
        for body in (
            {"lora_nickname": "a", "merge_mode": "merge"},
            {"lora_nickname": ["a", "b"], "strength": [1.0, 0.5], "merge_mode": "merge"},
        ):
            r = httpx.post(f"{url}/v1/set_lora", json=body, timeout=60)
            err = assert_envelope(r, 400, param="merge_mode")
            assert f"its base weight is quantized ({fmt.split('-')[1]})" in err["message"], err
            assert "'auto' or 'dynamic'" in err["message"], err
        r = httpx.post(f"{url}/v1/merge_lora_weights", json={}, timeout=60)
        err = assert_envelope(r, 400, param="merge_mode")
        assert err["message"].startswith("merge_lora_weights: ") and "quantized" in err["message"]
        r = httpx.post(f"{url}/v1/set_lora", json={"lora_nickname": "a", "merge_mode": "dynamic"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    assert engine.list_loras()["active"]["transformer"]["merged_layers"] == 0
    with pytest.raises(InvalidRequestError, match=r"^commit_as_base: .*base weight is quantized"):
        manager.commit_as_base()
    engine.set_lora(["a", "b"], [None, None], strength=[STRENGTH, 0.0])  # back to auto
    assert engine.list_loras()["active"] == before
    for n, layer in manager.layers("transformer").items():
        if layer.base_layer.quant_method.name != "unquantized":
            assert layer.base_layer.weight.equal(weights[n]), n
    assert np.array_equal(_image(engine), image)


def _tp_images(engine, reqs) -> list[np.ndarray]:
    """The first request alone, the others as one batch (rows with their own compositions)."""
    images = [np.asarray(engine.generate(reqs[0])[0])]
    return images + [np.asarray(img) for (img,) in engine.generate_batch(reqs[1:])]


@pytest.mark.slow
def test_tp2_unmerged_lora_equals_one_process(engine, quantized, fmt):
    reqs = [_params(), _params(lora=[("b", 1.2)], seed=3), _params(lora=[], seed=4)]
    engine.set_lora(["a", "b"], [None, None], strength=[STRENGTH, 0.0], merge_mode="dynamic")
    try:
        one = _tp_images(engine, reqs)
    finally:
        engine.set_lora(["a", "b"], [None, None], strength=[STRENGTH, 0.0])  # back to auto
    root = quantized["root"]
    with DiffusionEngine(quantized[fmt][0], device="cpu", tp_size=2, lora_dirs=[root]) as e2:
        e2.set_lora(["a", "b"], list(quantized["loras"]), strength=[STRENGTH, 0.0],
                    merge_mode="dynamic")  # fmt: skip
        two = _tp_images(e2, reqs)
    for i, (a, b) in enumerate(zip(one, two)):
        assert np.array_equal(a, b), (i, psnr(a, b))
    assert psnr(one[0], one[2]) < MAX_PSNR_VS_BASE  # the LoRA matters
