"""The command line of ``models.quantized_export`` (``python -m ...quantized_export SRC DST
--format F``): it writes what :func:`export_quantized` writes with the same arguments, its
``--ignore`` replaces the default globs, and a missing source is one error line and exit 2.

The source is a two-layer transformer folder written here (random fp32 weights), so each case
reads and writes a few kilobytes.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from sglang.multimodal_gen.models.quantized_export import DEFAULT_IGNORE, main

WEIGHTS = "diffusion_pytorch_model.safetensors"


def _source(tmp_path) -> str:
    src = tmp_path / "transformer"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "blocks.0.ff.weight": torch.randn(48, 32, generator=g),
        "blocks.0.ff.bias": torch.randn(48, generator=g),
        "proj_out.weight": torch.randn(16, 48, generator=g),
    }
    save_file(tensors, str(src / WEIGHTS))
    (src / "config.json").write_text(json.dumps({"_class_name": "TinyTransformer"}))
    return str(src)


def test_modelopt_fp8_folder_with_default_ignore(tmp_path, capsys):
    src, dst = _source(tmp_path), str(tmp_path / "fp8")
    assert main([src, dst, "--format", "modelopt-fp8"]) == 0
    assert "1 linear layers quantized (modelopt-fp8)" in capsys.readouterr().out
    with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": list(DEFAULT_IGNORE)}
    out = load_file(os.path.join(dst, WEIGHTS))
    assert out["blocks.0.ff.weight"].dtype == torch.float8_e4m3fn
    assert out["proj_out.weight"].dtype == torch.float32  # matched by the default 'proj_out'
    w = load_file(os.path.join(src, WEIGHTS))["blocks.0.ff.weight"]
    deq = out["blocks.0.ff.weight"].float() * out["blocks.0.ff.weight_scale"]
    assert (deq - w).abs().max() <= 2**-3 * w.abs().max()  # within e4m3's step at the top


def test_ignore_replaces_the_defaults(tmp_path):
    src = _source(tmp_path)
    nothing = str(tmp_path / "all")
    assert main([src, nothing, "--format", "modelopt-nvfp4", "--ignore"]) == 0
    out = load_file(os.path.join(nothing, WEIGHTS))
    assert out["proj_out.weight"].dtype == torch.uint8  # --ignore alone: every 2-D weight
    assert out["proj_out.weight"].shape == (16, 24)
    blocks = str(tmp_path / "blocks")
    assert main([src, blocks, "--format", "modelopt-nvfp4", "--ignore", "blocks.*"]) == 0
    out = load_file(os.path.join(blocks, WEIGHTS))
    assert out["blocks.0.ff.weight"].dtype == torch.float32
    assert out["proj_out.weight"].dtype == torch.uint8


def test_comfyui_single_file_with_prefix(tmp_path):
    dst = str(tmp_path / "flux.safetensors")
    argv = [_source(tmp_path), dst, "--format", "comfyui-fp8", "--key-prefix", "model.x."]
    assert main(argv) == 0
    out = load_file(dst)
    assert out["scaled_fp8"].dtype == torch.float8_e4m3fn
    assert out["model.x.blocks.0.ff.weight"].dtype == torch.float8_e4m3fn
    assert "model.x.blocks.0.ff.scale_weight" in out


def test_missing_source_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "absent"), str(tmp_path / "dst"), "--format", "modelopt-fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quantized_export: error: ")
    assert "absent" in err[0]
    assert not os.path.exists(tmp_path / "dst")


def test_nvfp4_declares_the_layers_it_keeps_for_the_block_size(tmp_path):
    """A linear layer whose in-features are not a multiple of 16 stays in full precision and is
    written to ``ignore``: the loader refuses an undeclared unquantized layer, so an export that
    left it out could not be loaded."""
    src = tmp_path / "transformer"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file(
        {
            "blocks.0.odd.weight": torch.randn(32, 24, generator=g),
            "blocks.0.even.weight": torch.randn(32, 32, generator=g),
        },
        str(src / WEIGHTS),
    )
    (src / "config.json").write_text(json.dumps({"_class_name": "TinyTransformer"}))
    dst = str(tmp_path / "nvfp4")
    assert main([str(src), dst, "--format", "modelopt-nvfp4", "--ignore"]) == 0
    with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:
        ignore = json.load(f)["quantization_config"]["ignore"]
    assert ignore == ["blocks.0.odd"]
    out = load_file(os.path.join(dst, WEIGHTS))
    assert out["blocks.0.odd.weight"].dtype == torch.float32
    assert out["blocks.0.even.weight"].dtype == torch.uint8
