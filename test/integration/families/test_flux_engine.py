"""Flux.1 through the engine, the CLI and the HTTP server; TP 2 and 4 equal TP 1.

References: diffusers' ``FluxPipeline`` for the base image (same directory and seed), and the TP 1
engine for TP > 1 (``test_flux_pipeline_parity.py`` ties TP 1 to diffusers). The kohya file
(original BFL names, fused ``qkv`` / ``linear1``, the two-sided ``linear2``) is built here with
random non-zero weights; that it converts to the right deltas is tested in the LoRA format tests,
here it must give the same image at every TP size, merged and unmerged.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from fixtures.server import running_server
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr
from PIL import Image
from safetensors.torch import save_file
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.configs.flux import FluxSamplingParams
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.runtime import DiffusionEngine

REQ = dict(prompt="a lighthouse at dusk", height=32, width=48, num_inference_steps=2, seed=5)
# TP > 1 changes only the summation order of the row-parallel GEMMs: measured 78-inf dB here.
TP_MIN_PSNR = 60.0


def _kohya_file(path, d=64, mlp=256, r=4, alpha=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)

    def pair(name, out_f, in_f):
        return {
            f"lora_unet_{name}.lora_down.weight": torch.randn(r, in_f, generator=g) * 0.5,
            f"lora_unet_{name}.lora_up.weight": torch.randn(out_f, r, generator=g) * 0.5,
            f"lora_unet_{name}.alpha": torch.tensor(alpha),
        }

    sd = {}
    sd |= pair("double_blocks_0_img_attn_qkv", 3 * d, d)
    sd |= pair("double_blocks_1_txt_mlp_0", 4 * d, d)
    sd |= pair("single_blocks_0_linear1", 3 * d + mlp, d)
    sd |= pair("single_blocks_1_linear2", d, d + mlp)
    save_file(sd, str(path))
    return str(path)


@pytest.fixture(scope="module")
def kohya(tmp_path_factory):
    return _kohya_file(tmp_path_factory.mktemp("flux_lora") / "style.safetensors")


@pytest.fixture(scope="module")
def tp1(tiny_flux_dev_dir, kohya):
    with DiffusionEngine(tiny_flux_dev_dir, device="cpu") as engine:
        base = np.asarray(engine.generate(**REQ)[0])
        engine.set_lora("style", kohya, strength=0.8, merge_mode="merge")
        merged = np.asarray(engine.generate(**REQ)[0])
        yield engine, base, merged


def test_engine_equals_diffusers_and_reports_family(tiny_flux_dev_dir, tp1):
    engine, base, merged = tp1
    assert engine.family == "flux"
    assert engine.defaults["num_inference_steps"] == 28
    assert (
        engine.spec.params_class is FluxSamplingParams
        and engine.spec.defaults.true_cfg_scale == 1.0
    )
    assert engine.model_info["tp_sizes"] == [1, 2, 4]
    kw = {k: REQ[k] for k in ("height", "width", "num_inference_steps")}
    expected = reference_flux_images(reference_flux(tiny_flux_dev_dir), REQ["prompt"], 5, **kw)[0]
    assert psnr(base, expected) >= 70.0  # measured: identical pixels
    assert psnr(merged, base) < 40.0  # the adapter changes the image


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2])  # TP 4: the transformer parity test
def test_tp_equals_tp1_base_and_kohya_lora(tiny_flux_dev_dir, kohya, tp1, tp):
    _, base, merged = tp1
    with DiffusionEngine(tiny_flux_dev_dir, tp_size=tp, device="cpu") as engine:
        got = np.asarray(engine.generate(**REQ)[0])
        assert psnr(got, base) >= TP_MIN_PSNR
        for mode in ("merge", "dynamic"):
            engine.set_lora("style", kohya, strength=0.8, merge_mode=mode)
            got = np.asarray(engine.generate(**REQ)[0])
            assert psnr(got, merged) >= TP_MIN_PSNR, mode
            assert psnr(got, base) < TP_MIN_PSNR


def test_tp3_refused_naming_the_heads(tiny_flux_dev_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        DiffusionEngine(tiny_flux_dev_dir, tp_size=3, device="cpu")


def test_cli_generate_flux(tiny_flux_dev_dir, tp1, tmp_path):
    _, base, _ = tp1
    out = tmp_path / "flux.png"
    args = ["generate", "--model-path", tiny_flux_dev_dir, "--prompt", REQ["prompt"],
            "--seed", "5", "--num-inference-steps", "2", "--height", "32", "--width", "48",
            "--output-path", str(out), "--no-progress"]  # fmt: skip
    assert sglang_main(args) == 0
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), base)
    guided = tmp_path / "guided.webp"
    assert sglang_main(args[:-3] + ["--guidance-scale", "7", "--output-path", str(guided)]) == 0
    assert Image.open(guided).format == "WEBP"


def test_server_serves_flux(tiny_flux_dev_dir, tp1, kohya):
    engine, base, merged = tp1
    engine.unset_lora()
    with running_server(engine, ServerArgs(model_path=tiny_flux_dev_dir)) as (url, _, _):
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["family"] == "flux" and card["pipeline_class"] == "FluxPipeline"
        body = dict(prompt=REQ["prompt"], size="48x32", num_inference_steps=2, seed=5)
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        img = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
        assert np.array_equal(np.asarray(img.convert("RGB")), base)
        r = httpx.post(f"{url}/v1/images/generations", json=dict(body, lora={"name": "style",
                       "scale": 0.8}), timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        img = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
        assert psnr(np.asarray(img.convert("RGB")), merged) >= 70.0


@pytest.mark.slow
def test_sequence_and_cfg_parallel_equal_one_process(tiny_flux_dev_dir, kohya, tp1):
    """CFG 2 x Ulysses 2 (4 processes): true CFG with a negative prompt splits its two branches
    over the CFG group, each sharded over its SP pair; with the kohya LoRA merged and dynamic."""
    one, base, merged = tp1
    cfg_req = FluxSamplingParams(**REQ, negative_prompt="blurry", true_cfg_scale=2.5)
    one.unset_lora()
    expected = np.asarray(one.generate(cfg_req)[0])
    assert psnr(expected, base) < 40.0  # true CFG really changes the image
    with DiffusionEngine(tiny_flux_dev_dir, cfg_degree=2, sp_degree=2, device="cpu") as engine:
        assert engine.model_info["parallel"] == dict(
            tp_size=1, ulysses_degree=2, ring_degree=1, cfg_degree=2
        )
        assert psnr(np.asarray(engine.generate(cfg_req)[0]), expected) >= TP_MIN_PSNR
        assert psnr(np.asarray(engine.generate(**REQ)[0]), base) >= TP_MIN_PSNR
        for mode in ("merge", "dynamic"):
            engine.set_lora("style", kohya, strength=0.8, merge_mode=mode)
            got = np.asarray(engine.generate(**REQ)[0])
            assert psnr(got, merged) >= TP_MIN_PSNR, mode
