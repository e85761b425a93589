"""Hub ids from the local Hugging Face cache: one lookup for the model loader, ``--model-type``
detection and the LoRA loader, in the cache folder ``huggingface_hub`` uses, read at call time.

Reference: ``huggingface_hub``'s cache layout (``models--owner--name/{refs/main,snapshots/<sha>}``)
and the precedence of ``huggingface_hub.constants`` (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``,
``HF_HOME``, ``XDG_CACHE_HOME``).
"""

from __future__ import annotations

import json
import os

import pytest
from fixtures.hub_cache import COMMIT, cache_snapshot
from sglang.multimodal_gen.configs.server_args import detect_model_type
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.hub import (
    LORA_FILES,
    HubUnavailableError,
    cached_snapshot,
    download_command,
    hf_hub_cache_dir,
    is_repo_id,
    model_patterns,
    model_snapshot,
)
from sglang.multimodal_gen.lora.loading import load_lora_state_dict
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


# ------------------------------------------------------------------ downloads (what, and errors)
# A listing like Tongyi-MAI/Z-Image-Turbo's, with what other repos hold beside a diffusers layout.
LISTING = [
    ".gitattributes", "README.md", "model_index.json", "assets/showcase.jpg",
    "z-image-turbo.safetensors", "z-image-turbo-Q8.gguf", "flux1-dev.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", "text_encoder/generation_config.json",
    "text_encoder/model.safetensors.index.json",
    "text_encoder/model-00001-of-00003.safetensors", "text_encoder/model-00003-of-00003.safetensors",
    "text_encoder/pytorch_model.bin", "text_encoder/pytorch_model.bin.index.json",
    "tokenizer/merges.txt", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json", "tokenizer/chat_template.jinja", "tokenizer_2/spiece.model",
    "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
    "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
    "transformer/diffusion_pytorch_model.fp16.safetensors",
    "transformer/diffusion_pytorch_model.bin", "transformer/diffusion_flax_model.msgpack",
    "transformer/fp8/diffusion_pytorch_model.safetensors",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.pt",
    "vae/diffusion_pytorch_model.ckpt", "vae/model.pth", "other_pipeline/model.safetensors",
]  # fmt: skip


def _selected(allow, ignore):
    from huggingface_hub.utils import filter_repo_objects  # the library's own selection

    return sorted(filter_repo_objects(LISTING, allow_patterns=allow, ignore_patterns=ignore))


def test_a_model_download_selects_the_files_the_engine_reads():
    comps = ["scheduler", "text_encoder", "tokenizer", "tokenizer_2", "transformer", "vae", "../x"]
    got = _selected(*model_patterns(comps))
    assert got == sorted(
        [
            "model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
            "text_encoder/generation_config.json", "text_encoder/model.safetensors.index.json",
            "text_encoder/model-00001-of-00003.safetensors",
            "text_encoder/model-00003-of-00003.safetensors",
            "tokenizer/merges.txt", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
            "tokenizer/vocab.json", "tokenizer/chat_template.jinja", "tokenizer_2/spiece.model",
            "transformer/config.json",
            "transformer/diffusion_pytorch_model.safetensors.index.json",
            "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
            "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
            "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
        ]
    )  # fmt: skip
    # only model_index.json when the index names no component
    assert _selected(*model_patterns([])) == ["model_index.json"]


def test_a_lora_download_selects_its_top_level_safetensors_and_config():
    listing = [
        "README.md",
        "lora.safetensors",
        "adapter_config.json",
        "lora.bin",
        "ep/1.safetensors",
    ]
    from huggingface_hub.utils import filter_repo_objects

    got = filter_repo_objects(listing, allow_patterns=LORA_FILES, ignore_patterns=["*/*"])
    assert sorted(got) == ["adapter_config.json", "lora.safetensors"]


def test_repo_ids_and_the_download_command(env, tmp_path):
    assert is_repo_id("Tongyi-MAI/Z-Image-Turbo") and is_repo_id("a/b.c_d")
    for bad in ("Owner", "a/b/c", "../a", "a/../b", "/abs/path", "a--b/c", "a/" + "x" * 100):
        assert not is_repo_id(bad), bad
    os.makedirs(tmp_path / "owner" / "local")
    env.chdir(tmp_path)
    assert not is_repo_id("owner/local")  # an existing local path is a path
    assert download_command("o/n") == "hf download o/n"  # huggingface_hub >= 0.34 ships `hf`
    assert download_command("o/n", "v2") == "hf download o/n --revision v2"


def test_offline_and_refused_downloads_name_the_repo_the_cache_and_the_command(env, tmp_path):
    """No Hub is contacted in the unit tests (``HF_HUB_OFFLINE=1``, ``test/conftest.py``)."""
    env.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = str(tmp_path / "hf" / "hub")
    with pytest.raises(HubUnavailableError) as e:
        model_snapshot("Owner/Some-Model", revision="v2")
    msg = str(e.value)
    assert "'Owner/Some-Model'" in msg and cache in msg and "'v2'" in msg
    assert "`hf download Owner/Some-Model --revision v2`" in msg and "HF_HUB_OFFLINE" in msg
    assert "\n" not in msg and isinstance(e.value, FileNotFoundError)
    with pytest.raises(InvalidRequestError) as e:  # a server without --enable-hub-lora
        load_lora_state_dict("Owner/Some-LoRA", download=False)
    msg = str(e.value)
    assert "could not be found locally" in msg and "downloading is not possible here" in msg
    assert cache in msg and "--enable-hub-lora" in msg and "`hf download Owner/Some-LoRA`" in msg
    with pytest.raises(InvalidRequestError) as e:  # allowed, but offline
        load_lora_state_dict("Owner/Some-LoRA", download=True)
    assert "HF_HUB_OFFLINE" in str(e.value) and e.value.param == "lora_path"


def test_the_flags_and_their_defaults():
    import argparse

    from sglang.cli.generate import add_generate_args
    from sglang.multimodal_gen.configs.server_args import ServerArgs

    serve = ServerArgs.add_cli_args(argparse.ArgumentParser())
    args = ServerArgs.from_cli_args(serve.parse_args([]))
    assert args.enable_hub_lora is False and args.revision is None
    args = ServerArgs.from_cli_args(serve.parse_args(["--enable-hub-lora", "--revision", "v2"]))
    assert args.enable_hub_lora is True and args.revision == "v2"
    gen = add_generate_args(argparse.ArgumentParser())
    assert gen.parse_args(["--prompt", "x"]).enable_hub_lora is True
    assert gen.parse_args(["--prompt", "x", "--no-enable-hub-lora"]).enable_hub_lora is False
