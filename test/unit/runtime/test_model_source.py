"""``runtime.model_source``: the transformer weight flags resolved to local paths (as given, a
Hub repo id or one file of a Hub repo from the Hugging Face cache) and to ``WeightOptions``."""

from __future__ import annotations

import os

import pytest
from fixtures.hub_cache import cache_snapshot
from sglang.multimodal_gen.models.loader import WeightOptions
from sglang.multimodal_gen.runtime.model_source import resolve_transformer_source, weight_options


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache under ``tmp_path`` (nothing is downloaded)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_local_paths_as_given_and_folder_required(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"x")
    assert resolve_transformer_source(str(folder), "--transformer-path", folder=True) == str(folder)
    assert resolve_transformer_source(str(file), "--transformer-weights-path") == str(file)
    assert resolve_transformer_source(None, "--transformer-path") is None
    with pytest.raises(FileNotFoundError, match=r"--transformer-path .* is not a folder"):
        resolve_transformer_source(str(file), "--transformer-path", folder=True)
    with pytest.raises(FileNotFoundError, match=r"--transformer-weights-path .* does not exist"):
        resolve_transformer_source(str(tmp_path / "nope"), "--transformer-weights-path")


def test_hub_ids_come_from_the_cache(hub):
    snap = cache_snapshot(
        hub, "Owner/Flux-FP8", {"config.json": "{}", "diffusion_pytorch_model.safetensors": "w"}
    )
    one = cache_snapshot(hub, "Owner/Flux-Files", {"flux_fp8.safetensors": "w"})
    got = resolve_transformer_source("Owner/Flux-FP8", "--transformer-path", folder=True)
    assert os.path.samefile(got, snap)
    got = resolve_transformer_source(
        "Owner/Flux-Files/flux_fp8.safetensors", "--transformer-weights-path"
    )
    assert os.path.samefile(got, os.path.join(one, "flux_fp8.safetensors"))
    with pytest.raises(
        FileNotFoundError, match=r"^--transformer-path: transformer 'Owner/Missing'"
    ):
        resolve_transformer_source("Owner/Missing", "--transformer-path", folder=True)


def test_weight_options(tmp_path):
    assert weight_options() is None
    assert weight_options(quantization="fp8") == WeightOptions(quantization="fp8")
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"x")
    assert weight_options(transformer_weights_path=str(file)) == WeightOptions(
        transformer_weights_path=str(file)
    )
    with pytest.raises(ValueError, match="exclusive"):
        weight_options(str(tmp_path), str(file))
