"""``sglang generate`` with Hub ids, against a local stand-in of the Hub's HTTP API.

The stand-in (``fixtures/hub_server.py``) serves the tiny Z-Image model as ``owner/tiny-zimage``
(``main``; tag ``v2``: the same model with other weights) and a LoRA as ``owner/tiny-lora``, each
with decoys a real repo has and the engine never reads (pickle and GGUF weights, a root-level
single-file checkpoint, a weight variant, another folder, a README). The CLI runs in a child
process with ``HF_ENDPOINT`` pointed at it and a fresh ``HF_HOME``, so ``huggingface_hub``'s own
``snapshot_download`` does every request.

- Downloading gives the same PNG as the local folders, fetches exactly the files the engine reads
  (no decoy, no ``.bin``), and writes them into ``HF_HOME``.
- ``HF_HUB_OFFLINE=1`` with that cache: the same PNG, and the stand-in sees no request.
- Offline with an empty cache, or with the Hub unreachable: exit 2, one line naming the repo id,
  the cache folder and ``hf download <id>``.
- ``--revision v2`` loads the other commit: another image.
- Shards with other names come from the index's ``weight_map``; offline, a cached snapshot that
  lacks a file is an error saying so.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from fixtures.hub_server import FakeHub, patched_hub_constants
from fixtures.server import free_port
from fixtures.tiny_models import build_tiny_zimage
from huggingface_hub import constants
from PIL import Image
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.hub import HubUnavailableError, download_command, model_snapshot

MODEL = "owner/tiny-zimage"
LORA = "owner/tiny-lora"
MODEL_DECOYS = {
    "transformer/diffusion_pytorch_model.bin": b"pickle",
    "transformer/diffusion_pytorch_model.fp16.safetensors": b"variant",
    "text_encoder/pytorch_model.bin": b"pickle",
    "vae/diffusion_pytorch_model.ckpt": b"pickle",
    "tiny-zimage.gguf": b"gguf",
    "tiny-zimage-single-file.safetensors": b"single file checkpoint",
    "other_pipeline/diffusion_pytorch_model.safetensors": b"not a component",
    "README.md": b"# tiny",
    ".gitattributes": b"*.safetensors filter=lfs",
}
LORA_DECOYS = {
    "pytorch_lora_weights.bin": b"pickle",
    "epochs/epoch-1.safetensors": b"an older checkpoint",
    "README.md": b"# lora",
}
STEPS = ["--num-inference-steps", "2", "--height", "32", "--width", "32", "--seed", "7"]


def _files(folder: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
        for d, _, names in os.walk(folder)
        for f in names
    }


@pytest.fixture(scope="module")
def hub(tiny_zimage_dir, tiny_zimage_loras, tmp_path_factory):
    v2 = build_tiny_zimage(str(tmp_path_factory.mktemp("tiny_zimage_v2")), seed=1)
    with FakeHub() as hub:
        hub.main = hub.add_commit(MODEL, tiny_zimage_dir, MODEL_DECOYS)
        hub.v2 = hub.add_commit(MODEL, v2, MODEL_DECOYS, refs=("v2",))
        hub.add_commit(LORA, tiny_zimage_loras[0], LORA_DECOYS)
        yield hub


def _generate(env: dict, out: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglang.cli.main", "generate", "--prompt", "a cabin in snow"]
    cmd += [*STEPS, "--output-path", out, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _pixels(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        return np.asarray(Image.open(io.BytesIO(f.read())).convert("RGB"))


@pytest.fixture(scope="module")
def downloaded(hub, tmp_path_factory):
    """One ``sglang generate`` from Hub ids into a fresh ``HF_HOME``: ``(hf_home, png,
    requests)``."""
    home = tmp_path_factory.mktemp("hf_home")
    out = str(home / "hub.png")
    hub.clear()
    done = _generate(hub.env(str(home)), out, "--model-path", MODEL, "--lora-path", LORA)
    assert done.returncode == 0, done.stderr
    assert "Fetching" in done.stderr  # huggingface_hub's progress bars
    return home, out, list(hub.requests)


def test_generate_downloads_what_the_engine_reads_and_matches_local(
    hub, downloaded, tiny_zimage_dir, tiny_zimage_loras, tmp_path
):
    home, png, requests = downloaded
    # the same command on the local folders (in this process: nothing to download)
    local = str(tmp_path / "local.png")
    args = ["generate", "--prompt", "a cabin in snow", *STEPS, "--output-path", local]
    args += ["--model-path", tiny_zimage_dir, "--lora-path", tiny_zimage_loras[0]]
    assert sglang_main(args) == 0
    np.testing.assert_array_equal(_pixels(png), _pixels(local))

    # exactly the model's files and the LoRA's weights: no decoy, no pickle
    assert hub.files_fetched(MODEL) == sorted(_files(tiny_zimage_dir))
    assert hub.files_fetched(LORA) == ["pytorch_lora_weights.safetensors"]
    paths = [p.split("?")[0] for _, p in requests]
    assert not [p for p in paths if p.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf"))]
    assert not [p for p in paths if "single-file" in p or "other_pipeline" in p]
    cache = home / "hub"
    snap = cache / "models--owner--tiny-zimage" / "snapshots" / hub.main
    assert _files(str(snap)) == _files(tiny_zimage_dir)
    assert (cache / "models--owner--tiny-zimage" / "refs" / "main").read_text() == hub.main
    lora_snaps = list((cache / "models--owner--tiny-lora" / "snapshots").iterdir())
    assert [_files(str(s)) for s in lora_snaps] == [{"pytorch_lora_weights.safetensors"}]


def test_offline_with_the_filled_cache_makes_no_request(hub, downloaded, tmp_path):
    home, png, _ = downloaded
    hub.clear()
    out = str(tmp_path / "offline.png")
    env = dict(hub.env(str(home)), HF_HUB_OFFLINE="1")
    done = _generate(env, out, "--model-path", MODEL, "--lora-path", LORA)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(_pixels(out), _pixels(png))
    assert hub.requests == []


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("sglang generate: error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_offline_with_an_empty_cache_says_what_to_run(hub, tmp_path):
    hub.clear()
    env = dict(hub.env(str(tmp_path / "hf")), HF_HUB_OFFLINE="1")
    done = _generate(env, str(tmp_path / "x.png"), "--model-path", MODEL)
    line = _one_error_line(done)
    assert repr(MODEL) in line and str(tmp_path / "hf" / "hub") in line, line
    assert f"`{download_command(MODEL)}`" in line and "HF_HUB_OFFLINE" in line, line
    assert download_command(MODEL) == f"hf download {MODEL}"  # what the installed library ships
    assert hub.requests == []


def test_an_unreachable_hub_says_what_to_run(hub, tmp_path):
    env = dict(hub.env(str(tmp_path / "hf")), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    done = _generate(env, str(tmp_path / "x.png"), "--model-path", MODEL)
    line = _one_error_line(done)
    assert repr(MODEL) in line and str(tmp_path / "hf" / "hub") in line, line
    assert "could not be reached" in line and f"`hf download {MODEL}`" in line, line


def test_revision_selects_another_commit(hub, downloaded, tmp_path):
    home, main_png, _ = downloaded
    out = str(tmp_path / "v2.png")
    args = ("--model-path", MODEL, "--lora-path", LORA, "--revision", "v2")
    done = _generate(hub.env(str(home)), out, *args)
    assert done.returncode == 0, done.stderr
    repo = home / "hub" / "models--owner--tiny-zimage"
    assert (repo / "refs" / "v2").read_text() == hub.v2
    assert sorted(p.name for p in (repo / "snapshots").iterdir()) == sorted([hub.main, hub.v2])
    assert not np.array_equal(_pixels(out), _pixels(main_png))  # same LoRA, other weights


def test_shards_named_by_the_index_and_an_incomplete_cache(
    hub, tiny_zimage_dir, monkeypatch, tmp_path
):
    """In this process (``patched_hub_constants``): shards with other than the standard names
    come from the index's ``weight_map``; offline, a cached snapshot missing a file says so."""
    folder = tmp_path / "renamed"
    shutil.copytree(tiny_zimage_dir, folder)
    index_path = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    renamed = {}
    for name in sorted(set(index["weight_map"].values())):
        renamed[name] = name.replace("diffusion_pytorch_model-", "part-")
        os.rename(folder / "transformer" / name, folder / "transformer" / renamed[name])
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    hub.add_commit("owner/renamed-shards", str(folder), {"transformer/part-x.safetensors": b"x"})
    with patched_hub_constants(hub, monkeypatch, str(tmp_path / "hf")):
        snap = model_snapshot("owner/renamed-shards")
        assert _files(snap) == _files(str(folder))  # not the unnamed part-x
        os.remove(os.path.join(snap, "transformer", sorted(renamed.values())[0]))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(HubUnavailableError, match="lacks some files and HF_HUB_OFFLINE"):
            model_snapshot("owner/renamed-shards")
