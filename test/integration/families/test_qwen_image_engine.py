"""Qwen-Image through the engine: LoRA vs diffusers, TP 2 and 4 = TP 1, the CLI, the server card.

LoRA files: a diffusers/PEFT file (with ``attn.to_out.0`` and ``img_mod.1``, alpha != r in the
metadata) compared with diffusers' ``load_lora_weights`` + ``set_adapters``; a kohya/musubi and a
Lightning-style (``lora_down``/``lora_up`` + ``.alpha``) spelling of the SAME numbers must give the
same image as the diffusers file.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from fixtures.server import running_server
from fixtures.tiny_models import psnr
from fixtures.tiny_qwen_image import reference_qwen_image, reference_qwen_images
from PIL import Image
from safetensors.torch import save_file
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.runtime import DiffusionEngine

REQ = dict(prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=5,
           negative_prompt="blurry", true_cfg_scale=3.0)  # fmt: skip
KW = {k: v for k, v in REQ.items() if k not in ("prompt", "seed")}
D, R, ALPHA = 64, 4, 2.0
MODULES = {"attn.to_q": (D, D), "attn.to_out.0": (D, D), "img_mod.1": (6 * D, D),
           "txt_mlp.net.2": (D, 4 * D)}  # fmt: skip


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        (b, m): (torch.randn(R, i, generator=g), torch.randn(o, R, generator=g))
        for b in range(2)
        for m, (o, i) in MODULES.items()
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_loras")
    pairs = _pairs()
    peft, kohya, lightning = {}, {}, {}
    for (b, m), (a, bb) in pairs.items():
        name = f"transformer_blocks.{b}.{m}"
        peft[f"transformer.{name}.lora_A.weight"] = a
        peft[f"transformer.{name}.lora_B.weight"] = bb
        flat = "lora_unet_" + name.replace(".", "_")
        kohya[f"{flat}.lora_down.weight"], kohya[f"{flat}.lora_up.weight"] = a, bb
        kohya[f"{flat}.alpha"] = torch.tensor(ALPHA)
        lightning[f"{name}.lora_down.weight"], lightning[f"{name}.lora_up.weight"] = a, bb
        lightning[f"{name}.alpha"] = torch.tensor(ALPHA)
    from diffusers import QwenImagePipeline
    from peft import LoraConfig

    targets = ["to_q", "to_out.0", "img_mod.1", "net.2"]
    meta = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets).to_dict()
    QwenImagePipeline.save_lora_weights(
        str(root / "peft"), weight_name="peft.safetensors",
        transformer_lora_layers={k.removeprefix("transformer."): v for k, v in peft.items()},
        transformer_lora_adapter_metadata=meta,
    )  # fmt: skip
    out = {"peft": str(root / "peft" / "peft.safetensors")}
    for key, sd in (("kohya", kohya), ("lightning", lightning)):
        out[key] = str(root / f"{key}.safetensors")
        save_file(sd, out[key])
    return out


@pytest.fixture(scope="module")
def tp1(tiny_qwen_image_dir, files):
    with DiffusionEngine(tiny_qwen_image_dir, device="cpu") as engine:
        base = np.asarray(engine.generate(**REQ)[0])
        engine.set_lora("style", files["peft"], strength=0.8, merge_mode="merge")
        with_lora = np.asarray(engine.generate(**REQ)[0])
        yield engine, base, with_lora


def test_engine_and_lora_equal_diffusers(tiny_qwen_image_dir, files, tp1):
    engine, base, with_lora = tp1
    assert engine.family == "qwen-image" and engine.model_info["tp_sizes"] == [1, 2, 4]
    ref = reference_qwen_image(tiny_qwen_image_dir)
    assert psnr(base, reference_qwen_images(ref, REQ["prompt"], 5, **KW)[0]) >= 70.0  # inf
    ref.load_lora_weights(files["peft"], adapter_name="style")
    ref.set_adapters(["style"], [0.8])
    expected = reference_qwen_images(ref, REQ["prompt"], 5, **KW)[0]
    assert psnr(with_lora, expected) >= 70.0
    assert psnr(with_lora, base) < 45.0


@pytest.mark.parametrize("fmt", ["kohya", "lightning"])
def test_other_spellings_of_the_same_numbers(files, tp1, fmt):
    engine, _, with_lora = tp1
    engine.set_lora(fmt, files[fmt], strength=0.8, merge_mode="dynamic")
    assert psnr(np.asarray(engine.generate(**REQ)[0]), with_lora) >= 70.0
    engine.set_lora("style", None, strength=0.8, merge_mode="merge")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2])  # TP 4: the transformer parity test
def test_tp_equals_tp1(tiny_qwen_image_dir, files, tp1, tp):
    _, base, with_lora = tp1
    with DiffusionEngine(tiny_qwen_image_dir, tp_size=tp, device="cpu") as engine:
        assert psnr(np.asarray(engine.generate(**REQ)[0]), base) >= 60.0
        for mode in ("merge", "dynamic"):
            engine.set_lora("style", files["peft"], strength=0.8, merge_mode=mode)
            got = np.asarray(engine.generate(**REQ)[0])
            assert psnr(got, with_lora) >= 60.0, mode


def test_cli_and_server(tiny_qwen_image_dir, tp1, tmp_path):
    engine, base, _ = tp1
    out = tmp_path / "q.png"
    args = ["generate", "--model-path", tiny_qwen_image_dir, "--prompt", REQ["prompt"], "--seed",
            "5", "--height", "32", "--width", "32", "--num-inference-steps", "2",
            "--negative-prompt", "blurry", "--true-cfg-scale", "3", "--output-path", str(out),
            "--no-progress"]  # fmt: skip
    assert sglang_main(args) == 0
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), base)
    with running_server(engine, ServerArgs(model_path=tiny_qwen_image_dir)) as (url, _, _):
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["family"] == "qwen-image" and card["pipeline_class"] == "QwenImagePipeline"


@pytest.mark.slow
def test_cfg_and_ulysses_parallel_equal_one_process(tiny_qwen_image_dir, files, tp1):
    """CFG 2 x Ulysses 2 (4 processes): the true-CFG branches (padded text with a mask) on two
    rank pairs, each sequence-sharded; with the LoRA merged and dynamic."""
    _, base, with_lora = tp1
    with DiffusionEngine(tiny_qwen_image_dir, cfg_degree=2, sp_degree=2, device="cpu") as engine:
        got = np.asarray(engine.generate(**REQ)[0])
        assert psnr(got, base) >= 60.0
        for mode in ("merge", "dynamic"):
            engine.set_lora("style", files["peft"], strength=0.8, merge_mode=mode)
            got = np.asarray(engine.generate(**REQ)[0])
            assert psnr(got, with_lora) >= 60.0, mode
