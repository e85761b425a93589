"""Non-DiT components load as diffusers resolves them: every class name diffusers accepts.

A directory re-saved by diffusers with the installed transformers (which may write
``TokenizersBackend`` or another tokenizer class than the one it was built with) must load and
give the same image; so must the other spellings users' directories carry.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures.tiny_models import psnr, reference_image, reference_pipeline
from sglang.multimodal_gen.models.model_dir import read_model_index
from sglang.multimodal_gen.models.registry import family_for_model
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

KW = dict(height=32, width=32, num_inference_steps=2, guidance_scale=0.0)


def _image(pipe):
    g = torch.Generator().manual_seed(3)
    return pipe("a red fox", generator=g, output_type="np", **KW)[0]


@pytest.fixture(scope="module")
def resaved(tiny_zimage_dir, tmp_path_factory):
    """The tiny directory loaded by diffusers and saved again with the installed libraries."""
    from diffusers import DiffusionPipeline

    out = str(tmp_path_factory.mktemp("resaved"))
    DiffusionPipeline.from_pretrained(tiny_zimage_dir).save_pretrained(out)
    return out


def test_resaved_directory_loads_and_matches(resaved, tiny_zimage_dir):
    expected = reference_image(reference_pipeline(tiny_zimage_dir), "a red fox", seed=3, **KW)
    got = _image(ZImagePipeline.from_pretrained(resaved))
    assert psnr(got, expected) == float("inf")  # measured: identical pixels


@pytest.mark.parametrize(
    "tokenizer_class",
    ["TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2TokenizerFast", "AutoTokenizer"],
)
def test_tokenizer_class_spellings(tiny_zimage_dir, tmp_path, tokenizer_class):
    model = tmp_path / "model"
    shutil.copytree(tiny_zimage_dir, model)
    index = json.loads((model / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", tokenizer_class]
    (model / "model_index.json").write_text(json.dumps(index))
    assert family_for_model(str(model)).name == "zimage"
    pipe = ZImagePipeline.from_pretrained(str(model))
    expected = reference_image(reference_pipeline(tiny_zimage_dir), "a red fox", seed=3, **KW)
    assert psnr(_image(pipe), expected) == float("inf")


def test_optional_components_left_out(tiny_flux_dev_dir):
    """``[null, null]`` entries (FluxPipeline's image encoder) are optional components."""
    index = read_model_index(tiny_flux_dev_dir)
    assert "image_encoder" not in index.components
    assert index.components["tokenizer_2"][0] == "transformers"
    assert family_for_model(tiny_flux_dev_dir).name == "flux"
