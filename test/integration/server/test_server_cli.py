"""``sglang serve`` as a user starts it (the seed's command line), and a TP 2 server vs TP 1.

The CLI test runs the console script in a child process on the tiny model, generates with the
official ``openai`` client and compares the PNG with ``sglang generate`` (same arguments). The TP
test serves a TP 2 engine (two gloo
worker processes): its images equal the TP 2 engine's direct output exactly and the TP 1 engine's
up to summation order (max 2 levels of 255, PSNR >= 45 dB).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
from fixtures.hub_cache import cache_snapshot
from fixtures.server import free_port, running_server, write_zimage_lora
from fixtures.tiny_models import psnr
from PIL import Image
from sglang.multimodal_gen import runtime
from sglang.multimodal_gen.configs.server_args import ServerArgs


def _sglang_cmd() -> list[str]:
    exe = shutil.which("sglang")
    return [exe] if exe else [sys.executable, "-m", "sglang.cli.main"]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.communicate()[0]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _fake_hub_cache(hf_home, repo_id: str, model_dir: str) -> None:
    """Lay ``model_dir`` out as a cached snapshot of ``repo_id`` under ``hf_home/hub``."""
    shutil.copytree(model_dir, cache_snapshot(hf_home / "hub", repo_id), dirs_exist_ok=True)


def test_seed_command_line_serves_and_matches_generate(tmp_path, tiny_zimage_dir):
    """The seed's command line, verbatim, with ``M`` a Hub id present only in the local cache
    (``HF_HOME`` points at a fresh cache; a local directory takes the same path once resolved)."""
    model = tiny_zimage_dir
    repo_id = "Tiny-Owner/Tiny-ZImage"
    _fake_hub_cache(tmp_path / "hf", repo_id, model)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    port = free_port()
    cmd = (
        _sglang_cmd()
        + (
            f"serve --model-path {repo_id} --model-type diffusion --dit-cpu-offload false "
            f"--num-gpus 1 --port {port} --host localhost"
        ).split()
    )
    # a startup adapter, named relative to the allowed root
    write_zimage_lora(str(tmp_path / "start.safetensors"), model, seed=31)
    cmd += ["--lora-path", "start.safetensors", "--lora-nickname", "start"]
    cmd += ["--lora-dir", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = f"http://localhost:{port}"
    try:
        _wait_healthy(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        # the base model, whatever is active globally
        extra = {"seed": 42, "num_inference_steps": 2, "lora": []}
        text = httpx.get(f"{url}/v1/list_loras").text
        assert '"start"' in text, text
        assert [m.id for m in client.models.list().data] == [repo_id]
        resp = client.images.generate(
            model=repo_id,
            prompt="a small cabin in snow",
            size="64x64",
            response_format="b64_json",
            extra_body=extra,
        )
        got = _pixels(base64.b64decode(resp.data[0].b64_json))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out

    png = tmp_path / "ref.png"
    gen = (
        _sglang_cmd()
        + (
            f"generate --model-path {model} --prompt PROMPT --seed 42 --num-inference-steps 2 "
            f"--height 64 --width 64 --guidance-scale 0 --output-path {png}"
        ).split()
    )
    gen[gen.index("PROMPT")] = "a small cabin in snow"
    done = subprocess.run(gen, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ref = _pixels(png.read_bytes())
    # "lora": [] on a server whose startup adapter is merged runs the merged weights minus that
    # adapter's delta as a low-rank overlay (nothing is unmerged for one request), so the base
    # image comes back up to rounding: measured one value off by one level of 12288
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.001, (int(diff.max()), (diff > 0).mean())


def test_tp2_server_equals_tp1(tiny_zimage_dir, zimage_tp2_engine):
    model = tiny_zimage_dir
    fields = dict(prompt="two lanterns", height=32, width=32, seed=5, num_inference_steps=2)
    tp1 = runtime.DiffusionEngine(model_path=model, device="cpu")
    try:
        refs = [
            np.asarray(tp1.generate(runtime.SamplingParams(**fields, num_outputs_per_prompt=2))[i])
            for i in (0, 1)
        ]
    finally:
        tp1.shutdown()
    tp2 = zimage_tp2_engine  # the session's shared TP 2 engine
    args = ServerArgs(model_path=model, tp_size=2)
    with running_server(tp2, args) as (url, _, _):
        body = {
            "prompt": "two lanterns",
            "size": "32x32",
            "seed": 5,
            "num_inference_steps": 2,
            "n": 2,
        }
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/health").status_code == 200
        got = [_pixels(base64.b64decode(item["b64_json"])) for item in r.json()["data"]]
        # exactly what the TP 2 engine returns when called directly ...
        tp2_direct = tp2.generate(runtime.SamplingParams(**fields, num_outputs_per_prompt=2))
        for g, d in zip(got, tp2_direct):
            np.testing.assert_array_equal(g, np.asarray(d))
        # ... and TP 1's images up to the all-reduce's summation order (a level of 255)
        for g, ref in zip(got, refs):
            assert np.abs(g.astype(int) - ref.astype(int)).max() <= 2
            assert psnr(g, ref) >= 45
        # a dead TP worker: /health fails and requests get 503 instead of hanging
        procs = getattr(tp2, "_procs", None)
        if not procs:
            return
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(timeout=10)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=60)
        assert r.status_code == 503 and "error" in r.json()
        assert time.monotonic() - t0 < 30
