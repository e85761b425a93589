"""Hub LoRA ids on a server and on the Python API, against a local stand-in of the Hub.

The engine and the HTTP server run in this process (``running_server``), with this process's
``huggingface_hub`` pointed at the stand-in (``patched_hub_constants``) and a fresh ``HF_HOME``.

- Without ``--enable-hub-lora`` a ``/v1/set_lora`` Hub id that is not cached is a 400 naming
  ``lora_path`` and the flag, and nothing is requested from the Hub; the operator's startup
  ``--lora-path`` Hub id downloads all the same.
- With the flag the server downloads the adapter (in the HTTP handler, before the engine runs the
  command, so generations go on meanwhile) and loads it; its image equals the same adapter's from the local folder. A repo the
  Hub does not have is a 400 naming ``lora_path``.
- ``DiffusionEngine(model_path="owner/name")`` downloads the model (a revision the Hub lacks is
  one ``FileNotFoundError``); its ``set_lora`` downloads a Hub LoRA by default
  (``allow_hub_lora=True``), and refuses it with ``allow_hub_lora=False``.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from fixtures.hub_server import FakeHub, patched_hub_constants
from fixtures.server import assert_envelope, running_server
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.http_server import load_startup_loras
from sglang.multimodal_gen.runtime import DiffusionEngine

MODEL = "owner/tiny-zimage"
LORA = "owner/tiny-lora"
START = "owner/start-lora"
GEN = dict(prompt="a lantern", height=32, width=32, seed=3, num_inference_steps=2)


@pytest.fixture
def hub(tiny_zimage_dir, tiny_zimage_loras, monkeypatch, tmp_path):
    with FakeHub() as hub:
        hub.add_commit(MODEL, tiny_zimage_dir)
        hub.add_commit(LORA, tiny_zimage_loras[0])
        hub.add_commit(START, tiny_zimage_loras[1])
        with patched_hub_constants(hub, monkeypatch, str(tmp_path / "hf")):
            yield hub


def _set_lora(url: str, nickname: str, path: str) -> httpx.Response:
    body = {"lora_nickname": nickname, "lora_path": path}
    return httpx.post(f"{url}/v1/set_lora", json=body, timeout=120)


def _loaded(url: str) -> dict[str, str]:
    listed = httpx.get(f"{url}/v1/list_loras", timeout=30).json()
    return {a["nickname"]: a["path"] for a in listed["loaded"]}


def test_server_refuses_uncached_hub_loras_without_the_flag(hub, tiny_zimage_dir):
    args = ServerArgs(model_path=tiny_zimage_dir, device="cpu", lora_paths=[START])
    assert args.enable_hub_lora is False
    engine = DiffusionEngine.from_args(args)
    try:
        load_startup_loras(engine, args)  # the operator's own: downloaded without the flag
        assert hub.files_fetched(START) == ["pytorch_lora_weights.safetensors"]
        hub.clear()
        with running_server(engine, args) as (url, _, _):
            r = _set_lora(url, "hub", LORA)
            err = assert_envelope(r, 400, "lora_path")
            assert repr(LORA) in err["message"] and "--enable-hub-lora" in err["message"], err
            assert "could not be found locally" in err["message"], err
            assert hub.requests == []  # the cache is looked at, the Hub is not asked
            assert _loaded(url) == {"start-lora": START}
            # the startup adapter is cached now: a set_lora may name it without the flag
            assert _set_lora(url, "again", START).status_code == 200
        # the flag's download runs in the HTTP handler, before the command reaches the engine
        # (which, built without it, reads the adapter from the cache)
        with running_server(engine, args.replace(enable_hub_lora=True)) as (url, _, _):
            assert _set_lora(url, "hub", LORA).status_code == 200
            assert hub.files_fetched(LORA) == ["pytorch_lora_weights.safetensors"]
    finally:
        engine.shutdown()


def test_server_with_the_flag_downloads_and_loads(hub, tiny_zimage_dir, tiny_zimage_loras):
    args = ServerArgs(model_path=tiny_zimage_dir, device="cpu", enable_hub_lora=True)
    engine = DiffusionEngine.from_args(args)
    try:
        with running_server(engine, args) as (url, _, _):
            r = _set_lora(url, "hub", LORA)
            assert r.status_code == 200, r.text
            assert hub.files_fetched(LORA) == ["pytorch_lora_weights.safetensors"]
            assert _loaded(url) == {"hub": LORA}
            r = _set_lora(url, "missing", "owner/no-such-lora")
            err = assert_envelope(r, 400, "lora_path")
            assert "'owner/no-such-lora'" in err["message"] and "no such repo" in err["message"]
        got = np.asarray(engine.generate(**GEN)[0])
        engine.set_lora("local", tiny_zimage_loras[0], trusted=True)  # no --lora-dir
        want = np.asarray(engine.generate(**GEN)[0])
        np.testing.assert_array_equal(got, want)
    finally:
        engine.shutdown()


def test_python_api_downloads_the_model_and_a_lora(hub, tiny_zimage_dir, tiny_zimage_loras):
    with pytest.raises(FileNotFoundError, match=r"has no revision 'nope'.*`hf download"):
        DiffusionEngine(model_path=MODEL, revision="nope", device="cpu")
    engine = DiffusionEngine(model_path=MODEL, device="cpu")
    try:
        commit = hub.repos[MODEL]["refs"]["main"]
        assert engine.model_path.endswith(f"models--owner--tiny-zimage/snapshots/{commit}")
        base = np.asarray(engine.generate(**GEN)[0])
        engine.set_lora("hub", LORA)  # allow_hub_lora defaults to True
        got = np.asarray(engine.generate(**GEN)[0])
    finally:
        engine.shutdown()
    local = DiffusionEngine(model_path=tiny_zimage_dir, device="cpu", allow_hub_lora=False)
    try:
        np.testing.assert_array_equal(base, np.asarray(local.generate(**GEN)[0]))
        local.set_lora("local", tiny_zimage_loras[0])
        np.testing.assert_array_equal(got, np.asarray(local.generate(**GEN)[0]))
        with pytest.raises(Exception, match="downloading is not possible here"):
            local.set_lora("hub", "owner/other-lora")
    finally:
        local.shutdown()
