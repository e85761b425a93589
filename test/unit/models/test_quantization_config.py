"""Which quantization a checkpoint declares (``models/quantization_config.py``): ModelOpt's
``quantization_config`` accepted and refused field by field, the ``ignore`` globs on whole module
names, and the order of the three sources (config.json, safetensors metadata, ComfyUI markers)."""

from __future__ import annotations

import json

import pytest
import torch
from sglang.multimodal_gen.models.model_dir import ModelLoadError
from sglang.multimodal_gen.models.quantization_config import (
    CheckpointHeader,
    QuantizationConfig,
    resolve_quantization,
)


def _qc(**kw):
    return {"quant_method": "modelopt", "quant_algo": "FP8", **kw}


@pytest.mark.parametrize(
    "qc, algo, group",
    [
        (_qc(), "fp8", 16),
        (_qc(quant_algo="NVFP4", group_size=16), "nvfp4", 16),
        (_qc(quant_algo="FP4"), "nvfp4", 16),
        (
            _qc(quant_algo="nvfp4", config_groups={"g0": {"weights": {"group_size": 16}}}),
            "nvfp4",
            16,
        ),
    ],
    ids=["fp8", "nvfp4", "fp4", "nvfp4-config-groups"],
)
def test_from_modelopt_accepts(qc, algo, group):
    cfg = QuantizationConfig.from_modelopt(qc, "here")
    assert (cfg.algo, cfg.source, cfg.group_size, cfg.static_input_scale) == (
        algo,
        "modelopt",
        group,
        True,
    )


@pytest.mark.parametrize(
    "qc, field",
    [
        ([], "quantization_config must be an object"),
        ({"quant_method": "awq", "quant_algo": "FP8"}, "quant_method 'awq'"),
        (_qc(quant_algo="NVFP4_AWQ"), "quant_algo 'NVFP4_AWQ'"),
        (_qc(quant_algo="W4A16_AWQ"), "quant_algo 'W4A16_AWQ'"),
        (_qc(quant_algo="MIXED_PRECISION"), "quant_algo 'MIXED_PRECISION'"),
        (_qc(quant_algo="NVFP4", group_size=32), "group_size 32"),
        (
            _qc(quant_algo="NVFP4", config_groups={"g": {"weights": {"group_size": 32}}}),
            "group_size 32",
        ),
        (_qc(quant_algo="NVFP4", swizzled=True), "quantization_config.swizzled"),
        (_qc(weight_scale_swizzled=True), "quantization_config.weight_scale_swizzled"),
        (_qc(ignore="proj_out"), "quantization_config.ignore must be a list"),
        (_qc(ignore=["proj_out", 3]), "quantization_config.ignore must be a list"),
    ],
    ids=[
        "not-object",
        "method",
        "nvfp4-awq",
        "w4a16-awq",
        "mixed",
        "group32",
        "group32-cg",
        "swizzled",
        "scale-swizzled",
        "ignore-str",
        "ignore-int",
    ],
)
def test_from_modelopt_refuses_naming_the_field(qc, field):
    with pytest.raises(ModelLoadError, match=r"^here: .*" + field.replace(".", r"\.")):
        QuantizationConfig.from_modelopt(qc, "here")


def test_ignore_globs_match_whole_module_names():
    cfg = QuantizationConfig.from_modelopt(
        _qc(ignore=["proj_out", "*embed*", "blocks.1.*", "norm_out*"]), "here"
    )
    assert cfg.ignores("proj_out") and not cfg.ignores("blocks.0.proj_out")
    assert not cfg.ignores("proj_out_2") and not cfg.ignores("xproj_out")
    assert cfg.ignores("time_text_embed.linear_1") and cfg.ignores("x_embedder")
    assert cfg.ignores("blocks.1.attn.to_q") and not cfg.ignores("blocks.11.attn.to_q")
    assert cfg.ignores("norm_out.linear") and not cfg.ignores("blocks.0.norm_out.linear")
    assert cfg.ignore == ("proj_out", "*embed*", "blocks.1.*", "norm_out*")
    # exclude_modules is ModelOpt's other name for the same list
    assert QuantizationConfig.from_modelopt(_qc(exclude_modules=["a"]), "h").ignores("a")


def _header(metadata=None, dtypes=None):
    return CheckpointHeader(dtypes=dict(dtypes or {}), metadata=dict(metadata or {}), where="w")


FP8_META = {"quantization_config": json.dumps(_qc())}
NVFP4_META = {"quantization_config": json.dumps(_qc(quant_algo="NVFP4"))}
COMFY = {"scaled_fp8": torch.float8_e4m3fn, "a.weight": torch.float8_e4m3fn}


def test_resolve_order_config_then_metadata_then_comfyui_markers():
    cfg = {"quantization_config": _qc(quant_algo="NVFP4")}
    assert resolve_quantization(cfg, _header(FP8_META, COMFY), None, "d").algo == "nvfp4"
    assert resolve_quantization({}, _header(NVFP4_META, COMFY), None, "d").algo == "nvfp4"
    got = resolve_quantization({}, _header(None, COMFY), None, "d")
    assert (got.source, got.algo, got.static_input_scale) == ("comfyui", "fp8", False)
    with_input = dict(COMFY, **{"a.scale_input": torch.float32})
    assert resolve_quantization({}, _header(None, with_input), None, "d").static_input_scale
    comfy_quant = {"a.comfy_quant": torch.uint8, "a.weight": torch.float8_e4m3fn}
    assert resolve_quantization({}, _header(None, comfy_quant), None, "d").source == "comfyui"
    assert resolve_quantization({}, _header(None, {"a.weight": torch.bfloat16}), None, "d") is None


def test_resolve_online_and_its_refusals():
    plain = _header(None, {"a.weight": torch.bfloat16})
    got = resolve_quantization({}, plain, "fp8", "d")
    assert (got.source, got.algo, got.static_input_scale) == ("online", "fp8", False)
    for cfg, header in [
        ({"quantization_config": _qc()}, plain),
        ({}, _header(FP8_META)),
        ({}, _header(None, COMFY)),
    ]:
        with pytest.raises(
            ModelLoadError, match="--quantization fp8 asks to quantize a checkpoint"
        ):
            resolve_quantization(cfg, header, "fp8", "d")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        resolve_quantization({}, plain, "int4", "d")


def test_resolve_refuses_bad_metadata_and_e5m2_markers():
    with pytest.raises(ModelLoadError, match="metadata 'quantization_config' is not JSON"):
        resolve_quantization({}, _header({"quantization_config": "{nope"}), None, "d")
    with pytest.raises(ModelLoadError, match=r"w \(safetensors metadata\): .*quant_algo 'INT8'"):
        resolve_quantization(
            {}, _header({"quantization_config": json.dumps(_qc(quant_algo="INT8"))}), None, "d"
        )
    with pytest.raises(ModelLoadError, match="'scaled_fp8' is float8_e5m2"):
        resolve_quantization({}, _header(None, {"scaled_fp8": torch.float8_e5m2}), None, "d")


def test_comfyui_leaf_names_map_to_ours():
    cfg = QuantizationConfig.comfyui(_header(None, COMFY))
    assert cfg.tensor_name("m.x.scale_weight") == "m.x.weight_scale"
    assert cfg.tensor_name("m.x.scale_input") == "m.x.input_scale"
    assert cfg.tensor_name("m.scale_weight.bias") == "m.scale_weight.bias"
    assert cfg.skips("scaled_fp8") and cfg.skips("m.comfy_quant") and not cfg.skips("m.weight")
