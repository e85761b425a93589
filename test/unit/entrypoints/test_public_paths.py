"""What clients see of the server's file system (``entrypoints/public_paths.py``): adapter paths
relative to their ``--lora-dir`` root, no model, root or cache directory in any text."""

from __future__ import annotations

import os

from sglang.multimodal_gen.entrypoints.public_paths import PublicPaths


def _paths(tmp_path):
    roots = tmp_path / "loras"
    (roots / "sub").mkdir(parents=True)
    model = tmp_path / "models" / "Z-Image"
    model.mkdir(parents=True)
    cache = tmp_path / "hf"
    cache.mkdir()
    return roots, model, cache, PublicPaths([str(roots)], str(model), {"hf-cache": str(cache)})


def test_adapter_paths_relative_to_their_root(tmp_path):
    roots, _, _, pub = _paths(tmp_path)
    assert pub.lora_path(str(roots / "sub" / "a.safetensors")) == "sub/a.safetensors"
    assert pub.lora_path(str(roots)) == "."
    assert pub.lora_path("sub/a.safetensors") == "sub/a.safetensors"  # the client's words
    assert pub.lora_path("owner/repo") == "owner/repo"  # a Hub id
    # an operator's startup adapter from elsewhere: its last component only
    assert pub.lora_path("/opt/secret/place/style.safetensors") == "style.safetensors"
    # through a symlink to the root
    link = tmp_path / "link"
    os.symlink(roots, link)
    assert pub.lora_path(str(link / "sub" / "b")) == "sub/b"


def test_no_server_directory_in_any_text(tmp_path):
    roots, model, cache, pub = _paths(tmp_path)
    message = (
        f"LoRA folder '{roots}/sub' holds several files; cannot open {model}/transformer/x; "
        f"not in the Hugging Face cache at {cache}; see {roots}"
    )
    out = pub.scrub(message)
    assert str(tmp_path) not in out, out
    assert "'sub'" in out and "<model>/transformer/x" in out and "cache at <hf-cache>;" in out
    # a sibling whose name starts with a root's is not that root
    assert pub.scrub(f"{roots}2/x") == f"{roots}2/x"


def test_reports_relativise_paths_and_scrub_the_rest(tmp_path):
    roots, model, _, pub = _paths(tmp_path)
    report = {
        "loaded": [
            {"nickname": "a", "path": str(roots / "a.safetensors"), "bytes": 10},
            {"nickname": "s", "path": "/elsewhere/s.safetensors"},
        ],
        "message": f"merged from {model}",
        "by_name": {"a": {"path": str(roots / "sub")}},
    }
    out = pub.report(report)
    assert out["loaded"][0] == {"nickname": "a", "path": "a.safetensors", "bytes": 10}
    assert out["loaded"][1]["path"] == "s.safetensors"
    assert out["by_name"]["a"]["path"] == "sub" and out["message"] == "merged from <model>"
    assert str(tmp_path) not in str(out)
