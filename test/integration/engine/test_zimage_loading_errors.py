"""Loading a diffusers directory: every failure names the file and the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from sglang.multimodal_gen.models.families.zimage import load_zimage_transformer
from sglang.multimodal_gen.models.loader import ModelLoadError
from sglang.multimodal_gen.models.model_dir import read_model_index
from sglang.multimodal_gen.models.registry import UnknownModelError, family_for_model
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture
def model_copy(tiny_zimage_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_zimage_dir, dst)
    return dst


def _index(model):
    with open(model / "transformer" / INDEX) as f:
        return json.load(f)


def _rewrite_shard_of(model, tensor, edit):
    """Apply ``edit(dict) -> dict`` to the shard holding ``tensor``; return the shard path."""
    shard = model / "transformer" / _index(model)["weight_map"][tensor]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(shard), metadata={"format": "pt"})
    return shard


def test_loads_sharded_checkpoint(model_copy):
    assert len(set(_index(model_copy)["weight_map"].values())) > 5  # really sharded
    model = load_zimage_transformer(str(model_copy / "transformer"))
    assert torch.isfinite(model.layers[0].attention.to_qkv.weight).all()


def test_unknown_pipeline_class(model_copy):
    path = model_copy / "model_index.json"
    data = json.loads(path.read_text())
    data["_class_name"] = "FluxPipeline"
    path.write_text(json.dumps(data))
    with pytest.raises(
        ModelLoadError,
        match=r"model_index\.json: pipeline _class_name 'FluxPipeline' is not a Z-Image",
    ):
        ZImagePipeline.from_pretrained(str(model_copy))
    data["_class_name"] = "StableDiffusionPipeline"
    path.write_text(json.dumps(data))
    with pytest.raises(
        UnknownModelError, match=r"'StableDiffusionPipeline' is not served.*Z-Image"
    ):
        family_for_model(str(model_copy))


def test_unknown_component_class(model_copy):
    path = model_copy / "model_index.json"
    data = json.loads(path.read_text())
    data["vae"] = ["diffusers", "AutoencoderNoSuchThing"]
    path.write_text(json.dumps(data))
    assert read_model_index(str(model_copy)).components["vae"][1] == "AutoencoderNoSuchThing"
    with pytest.raises(
        ModelLoadError, match=r"component 'vae' = \['diffusers', 'AutoencoderNoSuchThing'\]"
    ):
        ZImagePipeline.from_pretrained(str(model_copy))


def test_unknown_transformer_class(model_copy):
    path = model_copy / "transformer" / "config.json"
    data = json.loads(path.read_text())
    data["_class_name"] = "FluxTransformer2DModel"
    path.write_text(json.dumps(data))
    with pytest.raises(
        ValueError, match=r"transformer/config\.json: _class_name 'FluxTransformer2DModel'"
    ):
        load_zimage_transformer(str(model_copy / "transformer"))


def test_missing_model_index_and_config(model_copy):
    os.remove(model_copy / "transformer" / "config.json")
    with pytest.raises(FileNotFoundError, match=r"transformer/config\.json"):
        load_zimage_transformer(str(model_copy / "transformer"))
    os.remove(model_copy / "model_index.json")
    with pytest.raises(FileNotFoundError, match=r"model_index\.json"):
        ZImagePipeline.from_pretrained(str(model_copy))


def test_missing_shard_file(model_copy):
    shard = _index(model_copy)["weight_map"]["layers.1.feed_forward.w2.weight"]
    os.remove(model_copy / "transformer" / shard)
    with pytest.raises(FileNotFoundError, match=f"names shard '{shard}', which is missing"):
        load_zimage_transformer(str(model_copy / "transformer"))


def test_shape_mismatch_names_file_tensor_and_shard(model_copy):
    name = "layers.0.attention.to_k.weight"

    def edit(t):
        t[name] = t[name][:-1]
        return t

    shard = _rewrite_shard_of(model_copy, name, edit)
    with pytest.raises(ModelLoadError) as e:
        load_zimage_transformer(str(model_copy / "transformer"))
    msg = str(e.value)
    assert str(shard) in msg and f"'{name}'" in msg and "shard 'k'" in msg
    assert "[63, 64]" in msg and "[64, 64]" in msg


def test_shape_mismatch_of_replicated_param(model_copy):
    name = "x_pad_token"
    _rewrite_shard_of(model_copy, name, lambda t: {**t, name: torch.zeros(1, 65)})
    with pytest.raises(ModelLoadError, match=r"tensor 'x_pad_token'.*\[1, 65\].*\[1, 64\]"):
        load_zimage_transformer(str(model_copy / "transformer"))


def test_missing_tensor_is_named(model_copy):
    name = "layers.1.attention.to_v.weight"
    _rewrite_shard_of(model_copy, name, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(
        ModelLoadError,
        match=r"lacks tensors for: layers\.1\.attention\.to_qkv\.weight shards \['v'\]",
    ):
        load_zimage_transformer(str(model_copy / "transformer"))


def test_unexpected_tensor_is_named(model_copy):
    name = "layers.0.ffn_norm1.weight"
    _rewrite_shard_of(
        model_copy, name, lambda t: {**t, "layers.0.extra_gate.weight": torch.ones(3)}
    )
    with pytest.raises(
        ModelLoadError, match=r"tensor 'layers\.0\.extra_gate\.weight'.*matches no parameter"
    ):
        load_zimage_transformer(str(model_copy / "transformer"))


def test_pickle_weights_refused(model_copy):
    tdir = model_copy / "transformer"
    for f in os.listdir(tdir):
        if f.endswith((".safetensors", ".json")) and f != "config.json":
            os.remove(tdir / f)
    torch.save({"x": torch.zeros(1)}, tdir / "diffusion_pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only pickle weights found; safetensors are required"):
        load_zimage_transformer(str(tdir))


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_loads_its_slices(tiny_zimage_dir, rank):
    """Loaded "as rank r of 2" (no process group), each fused/sharded parameter holds exactly
    that rank's rows (columns for row-parallel) of the diffusers tensors."""
    from diffusers import ZImageTransformer2DModel

    tdir = os.path.join(tiny_zimage_dir, "transformer")
    ref = dict(ZImageTransformer2DModel.from_pretrained(tdir).state_dict())
    ours = load_zimage_transformer(tdir, tp_rank=rank, tp_size=2)
    blk = "layers.1"
    half = lambda t, dim=0: t.chunk(2, dim=dim)[rank]  # noqa: E731
    qkv = torch.cat([half(ref[f"{blk}.attention.to_{n}.weight"]) for n in "qkv"])
    w13 = torch.cat([half(ref[f"{blk}.feed_forward.w{n}.weight"]) for n in (1, 3)])
    layer = ours.layers[1]
    assert torch.equal(layer.attention.to_qkv.weight, qkv)
    assert torch.equal(layer.feed_forward.w13.weight, w13)
    assert torch.equal(
        layer.attention.to_out[0].weight, half(ref[f"{blk}.attention.to_out.0.weight"], 1)
    )
    assert torch.equal(layer.feed_forward.w2.weight, half(ref[f"{blk}.feed_forward.w2.weight"], 1))
    assert torch.equal(ours.x_pad_token, ref["x_pad_token"])  # replicated
    assert torch.equal(layer.adaLN_modulation[0].weight, ref[f"{blk}.adaLN_modulation.0.weight"])
