"""Quantized checkpoints through ``load_denoiser``: good ones load, bad ones are refused with a
``ModelLoadError`` naming the checkpoint key.

A tiny random Flux transformer (diffusers' own class, ``save_pretrained``) is exported once per
format by ``models.quantized_export.export_quantized``; each case copies the export and edits its
safetensors (a scale reshaped, retyped or deleted, a weight stored unquantized, the ``ignore``
list changed, the file split into shards). Edited module: ``transformer_blocks.0.attn.to_k``, the
``k`` source of our fused ``to_qkv`` (so the error must map back from our fused layer to the
source key).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang.multimodal_gen.models.families.tiny.flux import TINY_TRANSFORMER
from sglang.multimodal_gen.models.loader import load_denoiser
from sglang.multimodal_gen.models.model_dir import ModelLoadError
from sglang.multimodal_gen.models.quantized_export import dequantized_state_dict, export_quantized
from sglang.multimodal_gen.models.registry import DenoiserSpec

_PKG = "sglang.multimodal_gen"
SPEC = DenoiserSpec(
    component="transformer",
    diffusers_classes=("FluxTransformer2DModel",),
    config_class=f"{_PKG}.configs.flux:FluxArchConfig",
    model_class=f"{_PKG}.models.dits.flux:FluxTransformer",
    name_map=f"{_PKG}.models.dits.flux_names:FLUX_NAME_MAP",
)
K = "transformer_blocks.0.attn.to_k"  # a source of the fused to_qkv
FF = "transformer_blocks.0.ff.net.2"  # a layer of its own
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``{"src": float folder, "modelopt-fp8": folder, "modelopt-nvfp4": folder, "comfyui-fp8":
    file}`` of one seeded tiny Flux transformer."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("quant")
    torch.manual_seed(0)
    src = str(root / "transformer")
    FluxTransformer2DModel(**TINY_TRANSFORMER).save_pretrained(src)
    out = {"src": src}
    for fmt in ("modelopt-fp8", "modelopt-nvfp4"):
        out[fmt] = str(root / fmt)
        export_quantized(src, out[fmt], fmt)
    out["comfyui-fp8"] = str(root / "comfy.safetensors")
    export_quantized(src, out["comfyui-fp8"], "comfyui-fp8")
    return out


def _edited(exports, fmt, tmp_path, edit=None, config=None) -> str:
    """A copy of export ``fmt`` with ``edit(state)`` applied to its tensors and ``config(qc)`` to
    its ``quantization_config``; the folder (ModelOpt) or the file (ComfyUI)."""
    if fmt == "comfyui-fp8":
        state = load_file(exports[fmt])
        edit(state)
        path = str(tmp_path / "edited.safetensors")
        save_file(state, path)
        return path
    dst = str(tmp_path / fmt)
    shutil.copytree(exports[fmt], dst)
    if edit is not None:
        state = load_file(os.path.join(dst, WEIGHTS))
        edit(state)
        save_file(state, os.path.join(dst, WEIGHTS))
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg["quantization_config"])
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


def _refused(path, key, weights_path=None):
    with pytest.raises(ModelLoadError) as info:
        load_denoiser(path, SPEC, weights_path=weights_path, tp_rank=0, tp_size=1)
    msg = str(info.value)
    assert re.search(rf"'{re.escape(key)}'", msg), f"{key!r} not named in: {msg}"
    return msg


def _unquantize(state, module):
    """Store ``module`` as ModelOpt stores an ignored module: a float weight, no scales."""
    ref = dequantized_state_dict_of(state, module)
    for leaf in ("weight_scale", "weight_scale_2", "input_scale"):
        state.pop(f"{module}.{leaf}", None)
    state[f"{module}.weight"] = ref


def dequantized_state_dict_of(state, module):
    w = state[f"{module}.weight"]
    return w.float() * state[f"{module}.weight_scale"].float()


# ------------------------------------------------------------------ good files


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-nvfp4"])
def test_export_loads_with_the_dequantized_weights(exports, fmt):
    model = load_denoiser(exports[fmt], SPEC, tp_rank=0, tp_size=1)
    ref = dequantized_state_dict(exports[fmt])
    qkv = model.transformer_blocks[0].attn.to_qkv
    assert qkv.quant_method.name == fmt.split("-")[1]
    full = torch.cat([ref[f"transformer_blocks.0.attn.to_{s}.weight"] for s in "qkv"])
    torch.testing.assert_close(qkv.quant_method.dequantize(qkv, torch.float32), full)
    assert model.proj_out.quant_method.name == "unquantized"  # the default ignore list
    # a nested proj_out is not the top-level one: quantized
    assert model.single_transformer_blocks[0].proj_out.quant_method.name != "unquantized"


def test_sharded_checkpoint_with_scales_in_another_shard_loads(exports, tmp_path):
    """An index file whose ``to_k.weight`` lives in shard 1 and its scales in shard 2."""
    dst = str(tmp_path / "sharded")
    shutil.copytree(exports["modelopt-nvfp4"], dst)
    state = load_file(os.path.join(dst, WEIGHTS))
    os.remove(os.path.join(dst, WEIGHTS))
    names = (
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    )
    parts: tuple[dict, dict] = ({}, {})
    for k, t in state.items():
        scale = k.rsplit(".", 1)[1] in ("weight_scale", "weight_scale_2", "input_scale")
        parts[1 if scale else 0][k] = t
    weight_map = {}
    for name, part in zip(names, parts):
        save_file(part, os.path.join(dst, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(dst, WEIGHTS + ".index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    assert f"{K}.weight" in parts[0] and f"{K}.weight_scale_2" in parts[1]
    got = load_denoiser(dst, SPEC, tp_rank=0, tp_size=1).state_dict()
    want = load_denoiser(exports["modelopt-nvfp4"], SPEC, tp_rank=0, tp_size=1).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(
            got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
            want[k].view(torch.uint8) if want[k].dtype == torch.float8_e4m3fn else want[k],
        ), k


def test_weights_path_with_the_config_in_one_shards_metadata(exports, tmp_path):
    """``--transformer-weights-path DIR`` of two files: the first with diffusers' usual
    ``{"format": "pt"}`` metadata, the second carrying ``quantization_config``."""
    state = load_file(os.path.join(exports["modelopt-nvfp4"], WEIGHTS))
    with open(os.path.join(exports["modelopt-nvfp4"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    keys = sorted(state)
    half = len(keys) // 2
    dst = tmp_path / "weights"
    dst.mkdir()
    save_file({k: state[k] for k in keys[:half]}, str(dst / "a.safetensors"), {"format": "pt"})
    meta = {"format": "pt", "quantization_config": json.dumps(qc)}
    save_file({k: state[k] for k in keys[half:]}, str(dst / "b.safetensors"), meta)
    model = load_denoiser(exports["src"], SPEC, weights_path=str(dst), tp_rank=0, tp_size=1)
    assert model.transformer_blocks[0].attn.to_qkv.quant_method.name == "nvfp4"
    # the same config in both (other JSON spacing): fine; a different one: refused
    save_file(
        {k: state[k] for k in keys[:half]},
        str(dst / "a.safetensors"),
        {"quantization_config": json.dumps(qc, indent=1)},
    )
    load_denoiser(exports["src"], SPEC, weights_path=str(dst), tp_rank=0, tp_size=1)
    other = json.dumps(dict(qc, quant_algo="FP8"))
    save_file(
        {k: state[k] for k in keys[:half]},
        str(dst / "a.safetensors"),
        {"quantization_config": other},
    )
    with pytest.raises(
        ModelLoadError,
        match=r"b\.safetensors has a safetensors metadata "
        "'quantization_config' that differs",
    ):
        load_denoiser(exports["src"], SPEC, weights_path=str(dst), tp_rank=0, tp_size=1)


# ------------------------------------------------------------------ bad scales


@pytest.mark.parametrize(
    "fmt, leaf, bad",
    [
        ("modelopt-nvfp4", "weight_scale", lambda t: t[:, :-1].contiguous()),  # one block short
        ("modelopt-nvfp4", "weight_scale_2", lambda t: torch.ones(3)),
        ("modelopt-nvfp4", "input_scale", lambda t: torch.ones(2)),
        ("modelopt-fp8", "weight_scale", lambda t: torch.ones(3)),
        ("modelopt-fp8", "input_scale", lambda t: torch.ones(1, 2)),
    ],
    ids=["nvfp4-block", "nvfp4-global", "nvfp4-input", "fp8-weight", "fp8-input"],
)
def test_scale_of_the_wrong_shape_is_named(exports, tmp_path, fmt, leaf, bad):
    def edit(state):
        state[f"{K}.{leaf}"] = bad(state[f"{K}.{leaf}"])

    _refused(_edited(exports, fmt, tmp_path, edit), f"{K}.{leaf}")


@pytest.mark.parametrize(
    "fmt, leaf, dtype",
    [
        ("modelopt-nvfp4", "weight_scale", torch.float16),  # block scales must be e4m3
        ("modelopt-nvfp4", "weight_scale_2", torch.int32),
        ("modelopt-nvfp4", "weight", torch.int8),  # packed codes must be uint8
        ("modelopt-fp8", "weight_scale", torch.float8_e4m3fn),
        ("modelopt-fp8", "input_scale", torch.int64),
    ],
    ids=["nvfp4-block", "nvfp4-global", "nvfp4-packed", "fp8-weight", "fp8-input"],
)
def test_scale_of_the_wrong_dtype_is_named(exports, tmp_path, fmt, leaf, dtype):
    def edit(state):
        t = state[f"{K}.{leaf}"]
        state[f"{K}.{leaf}"] = (
            t.view(dtype) if t.element_size() == 1 == dtype.itemsize else (t.float().to(dtype))
        )

    _refused(_edited(exports, fmt, tmp_path, edit), f"{K}.{leaf}")


@pytest.mark.parametrize(
    "fmt, leaf",
    [
        ("modelopt-nvfp4", "weight_scale_2"),
        ("modelopt-nvfp4", "weight_scale"),
        ("modelopt-nvfp4", "input_scale"),
        ("modelopt-fp8", "weight_scale"),
        ("modelopt-fp8", "input_scale"),
    ],
)
@pytest.mark.parametrize("module", [K, FF])
def test_missing_scale_is_named_by_its_checkpoint_key(exports, tmp_path, fmt, leaf, module):
    def edit(state):
        del state[f"{module}.{leaf}"]

    _refused(_edited(exports, fmt, tmp_path, edit), f"{module}.{leaf}")


# ------------------------------------------------------------------ declaration vs. dtypes


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-nvfp4"])
def test_unquantized_layer_the_config_does_not_ignore(exports, tmp_path, fmt):
    def edit(state):
        for leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            state.pop(f"{FF}.{leaf}", None)
        state[f"{FF}.weight"] = torch.randn(state[f"{FF}.weight"].shape[0], 128)

    _refused(_edited(exports, fmt, tmp_path, edit), f"{FF}.weight")


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-nvfp4"])
def test_quantized_layer_the_config_ignores(exports, tmp_path, fmt):
    path = _edited(exports, fmt, tmp_path, config=lambda qc: qc["ignore"].append(FF))
    _refused(path, f"{FF}.weight")


def test_fused_layer_mixing_quantized_and_unquantized_sources(exports, tmp_path):
    path = _edited(
        exports,
        "modelopt-fp8",
        tmp_path,
        edit=lambda state: _unquantize(state, K),
        config=lambda qc: qc["ignore"].append(K),
    )
    msg = _refused(path, f"{K}.weight")
    assert "transformer_blocks.0.attn.to_q.weight" in msg


def test_comfyui_fp8_weight_without_scale_weight(exports, tmp_path):
    def edit(state):
        del state[f"{K}.scale_weight"]

    path = _edited(exports, "comfyui-fp8", tmp_path, edit)
    _refused(exports["src"], f"{K}.scale_weight", weights_path=path)


def test_comfyui_export_loads(exports):
    model = load_denoiser(
        exports["src"], SPEC, weights_path=exports["comfyui-fp8"], tp_size=1, tp_rank=0
    )
    qkv = model.transformer_blocks[0].attn.to_qkv
    assert qkv.quant_method.name == "fp8" and not qkv.quant_method.static_input_scale


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-nvfp4"])
def test_weights_path_folder_brings_its_quantization_config(exports, fmt):
    """``--transformer-weights-path DIR`` at a ModelOpt folder: the folder's own config.json
    carries the quantization_config (the base's config.json describes the model)."""
    model = load_denoiser(exports["src"], SPEC, weights_path=exports[fmt], tp_rank=0, tp_size=1)
    assert model.quantization == f"modelopt {fmt.split('-')[1]}"
    ref = load_denoiser(exports[fmt], SPEC, tp_rank=0, tp_size=1)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("config_groups", [{"weights": {"group_size": 16}}], "config_groups"),
        ("config_groups", {"g0": "NVFP4"}, "config_groups.g0"),
        ("config_groups", {"g0": {"weights": [16]}}, "config_groups.g0"),
        ("group_size", "abc", "group_size"),
        ("group_size", 16.5, "group_size"),
    ],
)
def test_malformed_config_fields_are_named(exports, tmp_path, field, value, named):
    def config(qc):
        qc[field] = value

    # FP8: the group size is not used, yet a malformed one is still named (NVFP4 refuses any
    # group size but 16 anyway)
    path = _edited(exports, "modelopt-fp8", tmp_path, config=config)
    with pytest.raises(ModelLoadError, match=rf"quantization_config\.{re.escape(named)}"):
        load_denoiser(path, SPEC, tp_rank=0, tp_size=1)
