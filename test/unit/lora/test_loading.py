"""Loading LoRA files: safetensors file / diffusers folder / peft folder / offline Hub cache.

References: the tensors written with ``safetensors.torch.save_file`` (byte-exact round trip), the
layout diffusers' ``save_lora_weights`` and peft's ``save_pretrained`` produce, and
``huggingface_hub``'s cache layout (``models--owner--name/{refs,snapshots}``).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from fixtures.hub_cache import cache_snapshot
from fixtures.lora_formats import SAMPLE, diffusers_sd, random_pairs, zimage_spec
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError
from sglang.multimodal_gen.lora import convert_to_canonical, load_lora_state_dict
from sglang.multimodal_gen.lora.loading import hf_hub_cache_dir


@pytest.fixture(scope="module")
def sd():
    return diffusers_sd(random_pairs(SAMPLE[:4], seed=200))


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_single_file_round_trip(tmp_path, sd):
    p = tmp_path / "x.safetensors"
    save_file(sd, str(p), metadata={"note": "hi"})
    loaded, md = load_lora_state_dict(str(p))
    _assert_same(loaded, sd)
    assert md["kind"] == "file" and md["path"] == os.path.realpath(p)
    assert md["safetensors_metadata"]["note"] == "hi"
    assert md["adapter_config"] is None and md["lora_adapter_metadata"] is None
    # the identity is the content: the same bytes elsewhere have the same identity
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(p.read_bytes())
    assert load_lora_state_dict(str(copy))[1]["identity"] == md["identity"]


def test_identity_changes_when_file_changes(tmp_path, sd):
    p = tmp_path / "x.safetensors"
    save_file(sd, str(p))
    id1 = load_lora_state_dict(p)[1]["identity"]
    save_file({k: v * 2 for k, v in sd.items()}, str(p), metadata={"v": "2"})
    assert load_lora_state_dict(p)[1]["identity"] != id1


def test_diffusers_folder(tmp_path, sd):
    from diffusers import ZImagePipeline

    layers = {k.removeprefix("transformer."): v for k, v in sd.items()}  # as peft returns them
    ZImagePipeline.save_lora_weights(
        str(tmp_path),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 2},
    )
    loaded, md = load_lora_state_dict(tmp_path)
    assert md["kind"] == "diffusers"
    assert md["path"].endswith("pytorch_lora_weights.safetensors")
    assert md["lora_adapter_metadata"] == {"transformer.r": 4, "transformer.lora_alpha": 2}
    _assert_same(loaded, sd)  # diffusers' pack_weights adds the component prefix
    canon = convert_to_canonical(loaded, md, zimage_spec())
    assert canon.modules["layers.0.attention.to_qkv"]["q"].scale == pytest.approx(0.5)


def test_peft_folder(tmp_path, sd):
    save_file(sd, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 12, "peft_type": "LORA"})
    )
    save_file(sd, str(tmp_path / "other.safetensors"))  # a stray file does not confuse the pick
    loaded, md = load_lora_state_dict(tmp_path)
    _assert_same(loaded, sd)
    assert md["kind"] == "peft" and md["adapter_config"]["lora_alpha"] == 12
    canon = convert_to_canonical(loaded, md, zimage_spec())
    assert canon.modules["layers.0.attention.to_qkv"]["k"].scale == pytest.approx(3.0)


def test_folder_with_one_file_and_ambiguous_folders(tmp_path, sd):
    save_file(sd, str(tmp_path / "my_lora.safetensors"))
    loaded, md = load_lora_state_dict(tmp_path)
    _assert_same(loaded, sd)
    assert md["kind"] == "file"
    save_file(sd, str(tmp_path / "second.safetensors"))
    with pytest.raises(LoRAFormatError, match="several .safetensors"):
        load_lora_state_dict(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoRAFormatError, match="no .safetensors"):
        load_lora_state_dict(empty)


def test_bad_files_refused(tmp_path, sd):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(LoRAFormatError, match="not a safetensors file"):
        load_lora_state_dict(garbage)
    good = tmp_path / "good.safetensors"
    save_file(sd, str(good))
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(LoRAFormatError, match="cannot read"):
        load_lora_state_dict(truncated)
    d = tmp_path / "peft"
    d.mkdir()
    save_file(sd, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAFormatError, match="adapter_config.json"):
        load_lora_state_dict(d)


def test_pickle_extensions_refused_before_opening(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("must not unpickle")

    monkeypatch.setattr(torch, "load", boom)
    for ext in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        p = tmp_path / f"w{ext}"
        p.write_bytes(b"\x80\x04not really")
        with pytest.raises(LoRAFormatError, match="pickle"):
            load_lora_state_dict(p)


def _fake_hub_cache(cache_dir, repo_id, sd):
    """One cached snapshot of ``repo_id`` holding ``sd`` as ``pytorch_lora_weights.safetensors``."""
    snap = pathlib.Path(cache_snapshot(cache_dir, repo_id))
    save_file(sd, str(snap / "pytorch_lora_weights.safetensors"))
    return snap


@pytest.mark.parametrize("env", ["HF_HOME", "HF_HUB_CACHE"])
def test_hub_repo_id_from_local_cache(tmp_path, monkeypatch, sd, env):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if env == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        cache = tmp_path / "hf" / "hub"
    else:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        cache = tmp_path / "cache"
    assert hf_hub_cache_dir() == str(cache)
    snap = _fake_hub_cache(cache, "someone/zimage-style-lora", sd)
    loaded, md = load_lora_state_dict("someone/zimage-style-lora")
    _assert_same(loaded, sd)
    assert md["kind"] == "diffusers" and md["path"].startswith(os.path.realpath(snap))
    # allowed roots restrict local paths, not ids resolved from the cache
    roots = [str(tmp_path / "loras")]
    os.makedirs(roots[0])
    loaded, _ = load_lora_state_dict("someone/zimage-style-lora", roots)
    _assert_same(loaded, sd)


def test_hub_repo_id_absent_says_no_download(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(InvalidRequestError) as e:
        load_lora_state_dict("nobody/not-cached-lora")
    msg = str(e.value)
    assert "could not be found locally" in msg and "downloading is not possible" in msg
    assert e.value.status_code == 400


def test_missing_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_lora_state_dict("missing.safetensors")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_lora_state_dict("./dir/../missing.safetensors")


def test_hub_repo_id_with_file(tmp_path, monkeypatch, sd):
    """`owner/name/file.safetensors` picks one file of a cached snapshot holding several."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = _fake_hub_cache(tmp_path / "hf" / "hub", "someone/many-epochs", sd)
    (snap / "epochs").mkdir()
    save_file({k: v * 3 for k, v in sd.items()}, str(snap / "epochs" / "e10.safetensors"))
    save_file({k: v * 5 for k, v in sd.items()}, str(snap / "epochs" / "e20.safetensors"))
    loaded, md = load_lora_state_dict("someone/many-epochs/epochs/e20.safetensors")
    _assert_same(loaded, {k: v * 5 for k, v in sd.items()})
    with pytest.raises(InvalidRequestError, match="not in the cached snapshot"):
        load_lora_state_dict("someone/many-epochs/epochs/e30.safetensors")
    with pytest.raises(InvalidRequestError):
        load_lora_state_dict("someone/many-epochs/../../x.safetensors")
