"""Quantized-weight options on a two-expert model (Wan2.2 A14B): ``--quantization fp8`` quantizes
both experts; ``--transformer-path`` replaces the primary ``transformer`` only, the second
expert keeps its own files."""

from __future__ import annotations

import os

import pytest
from sglang.multimodal_gen.models.families.tiny.wan import build_wan_dir
from sglang.multimodal_gen.models.loader import WeightOptions
from sglang.multimodal_gen.models.quantized_export import export_quantized
from sglang.multimodal_gen.models.registry import get_family


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return build_wan_dir(str(tmp_path_factory.mktemp("wan") / "wan"), layout="a14b")


def _load(model_dir, weights):
    family = get_family("wan")
    pipe = family.pipeline_class().from_pretrained(
        model_dir, family, load_vae=False, load_text=False, weights=weights
    )
    return pipe.denoisers


def test_online_fp8_quantizes_both_experts(wan_dir):
    denoisers = _load(wan_dir, WeightOptions(quantization="fp8"))
    assert set(denoisers) == {"transformer", "transformer_2"}
    for name, model in denoisers.items():
        assert model.quantization == "online fp8", name


def test_transformer_path_replaces_the_primary_expert_only(wan_dir, tmp_path):
    q = str(tmp_path / "q")
    export_quantized(os.path.join(wan_dir, "transformer"), q, "modelopt-fp8")
    denoisers = _load(wan_dir, WeightOptions(transformer_path=q))
    assert denoisers["transformer"].quantization == "modelopt fp8"
    assert denoisers["transformer_2"].quantization is None
