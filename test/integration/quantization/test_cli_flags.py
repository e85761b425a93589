"""``sglang generate`` with a quantized transformer, end to end on the tiny Flux.1 model: the
three flags (``--transformer-path``, ``--transformer-weights-path``, ``--quantization fp8``), the
model-info report of the quantization, and a bad checkpoint's one-line exit 2.

The quantized checkpoints are written by ``models.quantized_export.export_quantized`` from the
tiny model's own transformer (ModelOpt FP8: e4m3 weights, one fp32 scale per output row).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.models.quantized_export import copy_with_transformer, export_quantized
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

REQUEST = dict(prompt="a red kite over a beach", seed=5, steps=2, height=32, width=32, guidance=3.5)
# measured: --quantization fp8 against the unquantized image of REQUEST: 44.3 dB (CPU)
FP8_MIN_PSNR_DB = 38.0


def _generate(tmp_path, name: str, *flags: str) -> tuple[int, str]:
    out = tmp_path / f"{name}.png"
    argv = ["generate", *flags]
    argv += [
        "--prompt", REQUEST["prompt"], "--seed", str(REQUEST["seed"]),
        "--num-inference-steps", str(REQUEST["steps"]), "--height", str(REQUEST["height"]),
        "--width", str(REQUEST["width"]), "--guidance-scale", str(REQUEST["guidance"]),
        "--output-path", str(out), "--no-progress", "--device", "cpu",
    ]  # fmt: skip
    return sglang_main(argv), str(out)


def _pixels(path: str) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def checkpoints(tiny_flux_dev_dir, tmp_path_factory) -> dict:
    """The tiny Flux base, its ModelOpt FP8 transformer folder, the same as one repo, as one
    safetensors file with the config in its header metadata, and a corrupted copy."""
    root = tmp_path_factory.mktemp("quant_cli")
    fp8_dir = str(root / "transformer_fp8")
    done = export_quantized(os.path.join(tiny_flux_dev_dir, "transformer"), fp8_dir, "modelopt-fp8")
    assert len(done) > 10
    repo = copy_with_transformer(tiny_flux_dev_dir, str(root / "repo_fp8"), fp8_dir)
    with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as f:
        qconfig = json.load(f)["quantization_config"]
    tensors = load_file(os.path.join(fp8_dir, "diffusion_pytorch_model.safetensors"))
    single = str(root / "flux_fp8.safetensors")
    save_file(tensors, single, metadata={"quantization_config": json.dumps(qconfig)})
    # a weight_scale of the wrong shape (2-D, where a per-tensor or per-row scale goes): the
    # loader must refuse it, naming the key
    bad_key = next(k for k in sorted(tensors) if k.endswith(".weight_scale"))
    tensors[bad_key] = torch.ones(3, 2)
    bad_dir = str(root / "transformer_bad")
    os.makedirs(bad_dir)
    save_file(tensors, os.path.join(bad_dir, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(bad_dir, "config.json"), "w", encoding="utf-8") as f:
        with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as src:
            f.write(src.read())
    return dict(
        base=tiny_flux_dev_dir, fp8_dir=fp8_dir, repo=repo, single=single, bad=bad_dir,
        bad_key=bad_key,
    )  # fmt: skip


@pytest.fixture(scope="module")
def images(checkpoints, tmp_path_factory) -> dict:
    """``sglang generate`` once per way of naming the checkpoint (the paths of the PNGs)."""
    tmp = tmp_path_factory.mktemp("quant_cli_out")
    base = checkpoints["base"]
    runs = {
        "base": (),
        "transformer_path": ("--transformer-path", checkpoints["fp8_dir"]),
        "weights_file": ("--transformer-weights-path", checkpoints["single"]),
        "online": ("--quantization", "fp8"),
    }
    out = {}
    for name, flags in runs.items():
        code, path = _generate(tmp, name, "--model-path", base, *flags)
        assert code == 0, name
        out[name] = _pixels(path)
    return out


def test_transformer_path_equals_the_quantized_repo(checkpoints, images, tmp_path):
    """(a) ``--transformer-path`` of a ModelOpt FP8 folder gives the image of the engine on the
    repo whose ``transformer/`` is that folder, bit for bit; not the unquantized image. The engine
    reports the quantization (``/v1/models``' ``quantization`` field)."""
    req = SamplingParams(
        prompt=REQUEST["prompt"], seed=REQUEST["seed"], num_inference_steps=REQUEST["steps"],
        height=REQUEST["height"], width=REQUEST["width"], guidance_scale=REQUEST["guidance"],
    )  # fmt: skip
    with DiffusionEngine(checkpoints["repo"], device="cpu") as engine:
        assert engine.model_info["quantization"] == "modelopt fp8"
        card = _model_card(engine, checkpoints["repo"])
        engine.generate(req)[0].save(tmp_path / "repo.png")
    assert card["quantization"] == "modelopt fp8"
    repo = _pixels(str(tmp_path / "repo.png"))
    assert np.array_equal(images["transformer_path"], repo)
    assert not np.array_equal(images["transformer_path"], images["base"])


def _model_card(engine, model_path: str) -> dict:
    from fastapi.testclient import TestClient
    from sglang.multimodal_gen.configs.server_args import ServerArgs
    from sglang.multimodal_gen.entrypoints.http_server import create_app

    with TestClient(create_app(engine, ServerArgs(model_path=model_path))) as client:
        resp = client.get("/v1/models")
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]


def test_weights_file_with_metadata_config_equals_transformer_path(images):
    """(b) one safetensors file whose header metadata carries ``quantization_config``, given as
    ``--transformer-weights-path``, loads the same FP8 model as the folder."""
    assert np.array_equal(images["weights_file"], images["transformer_path"])


def test_online_fp8_is_close_to_the_base_image(images):
    """(c) ``--quantization fp8`` quantizes the base while loading: not the base's pixels, but
    close to them."""
    assert not np.array_equal(images["online"], images["base"])
    psnr = _psnr(images["online"], images["base"])
    assert psnr > FP8_MIN_PSNR_DB, psnr


def test_bad_checkpoint_exits_2_with_one_line_naming_the_key(checkpoints, tmp_path, capsys):
    """(d) a ``weight_scale`` of the wrong shape: exit 2, one error line naming that key, no
    traceback."""
    code, _ = _generate(
        tmp_path, "bad", "--model-path", checkpoints["base"], "--transformer-path",
        checkpoints["bad"],
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("sglang generate: error:")]
    assert len(lines) == 1, err
    assert checkpoints["bad_key"] in lines[0], lines[0]
    assert "Traceback" not in err, err


def test_serve_bad_checkpoint_exits_2_before_listening(checkpoints, capsys):
    """``sglang serve`` loads the model before it listens: the same one line and exit 2."""
    code = sglang_main(
        ["serve", "--model-path", checkpoints["base"], "--transformer-path", checkpoints["bad"],
         "--device", "cpu", "--port", "0"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("sglang serve: error:")]
    assert len(lines) == 1 and checkpoints["bad_key"] in lines[0], err
    assert "Traceback" not in err, err


def test_tp2_workers_load_the_transformer_path(checkpoints, images, tmp_path):
    """Worker processes (TP 2) get the weight options: the image is the TP 1 one (measured
    bit-equal on the CPU; 70 dB allows the row-parallel reductions' rounding elsewhere), not the
    unquantized base's (60.1 dB from it)."""
    code, path = _generate(
        tmp_path, "tp2", "--model-path", checkpoints["base"], "--transformer-path",
        checkpoints["fp8_dir"], "--tp-size", "2",
    )  # fmt: skip
    assert code == 0
    tp2 = _pixels(path)
    assert _psnr(tp2, images["transformer_path"]) > 70.0
    assert not np.array_equal(tp2, images["base"])
