"""Hub ids from the local Hugging Face cache: one lookup for the model loader, ``--model-type``
detection and the LoRA loader, in the cache folder ``huggingface_hub`` uses, read at call time.

Reference: ``huggingface_hub``'s cache layout (``models--owner--name/{refs/main,snapshots/<sha>}``)
and the precedence of ``huggingface_hub.constants`` (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``,
``HF_HOME``, ``XDG_CACHE_HOME``).
"""

from __future__ import annotations

import json

import pytest
from fixtures.hub_cache import COMMIT, cache_snapshot
from sglang.multimodal_gen.configs.server_args import detect_model_type
from sglang.multimodal_gen.hub import cached_snapshot, hf_hub_cache_dir
from sglang.multimodal_gen.runtime.model_source import resolve_model_path


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_cache_folder_follows_the_library_precedence(env, tmp_path):
    assert hf_hub_cache_dir() == str(tmp_path / "home" / ".cache" / "huggingface" / "hub")
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")
    env.setenv("HF_HOME", "~/hf")
    assert hf_hub_cache_dir() == str(tmp_path / "home" / "hf" / "hub")
    env.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hf_hub_cache_dir() == str(tmp_path / "legacy")
    env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hf_hub_cache_dir() == str(tmp_path / "cache")


def test_a_cached_repo_resolves_and_a_missing_one_names_the_cache(env, tmp_path):
    env.setenv("HF_HOME", str(tmp_path / "hf"))  # after huggingface_hub was imported: still read
    cache = tmp_path / "hf" / "hub"
    snap = cache_snapshot(cache, "Owner/Some-Model", {"model_index.json": "{}"})
    assert cached_snapshot("Owner/Some-Model") == snap
    with pytest.raises(FileNotFoundError) as e:
        cached_snapshot("Owner/Not-Cached")
    assert "'Owner/Not-Cached'" in str(e.value) and str(cache) in str(e.value)
    with pytest.raises(FileNotFoundError):
        cached_snapshot("not a repo id")


def test_the_model_loader_and_model_type_detection_use_it(env, tmp_path):
    env.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = str(tmp_path / "hf" / "hub")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_path("Owner/Some-Model")
    with pytest.raises(ValueError, match="no model_index.json"):
        detect_model_type("Owner/Some-Model")
    index = json.dumps({"_class_name": "ZImagePipeline"})
    snap = cache_snapshot(cache, "Owner/Some-Model", {"model_index.json": index})
    assert resolve_model_path("Owner/Some-Model") == (snap, COMMIT)
    assert detect_model_type("Owner/Some-Model") == "diffusion"
    cache_snapshot(cache, "Owner/Some-Model", {"model_index.json": '{"_class_name": "Llama"}'})
    with pytest.raises(ValueError, match="not a diffusers pipeline"):
        detect_model_type("Owner/Some-Model")
