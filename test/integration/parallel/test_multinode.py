"""Multi-node launch end to end: two "nodes" on localhost (one ``sglang`` process each, TP across
them) and ``torchrun``, against one in-process engine (TP 1) on the same tiny Z-Image.

Images must be equal to the single process (bit-equal here; >= 45 dB PSNR is the bar), with and
without LoRA changes sent over HTTP in between; node 1 exits 0 when node 0 is done; a node that
is missing or started with other flags is one clear line on every node.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from fixtures.server import free_port
from fixtures.tiny_models import psnr
from PIL import Image
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

PROMPT, SEED, STEPS, SIZE = "a red kite over dunes", 5, 2, 32
MIN_PSNR = 45.0


def _sglang(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.cli.main", *args]


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
        "-m", "sglang.cli.main", *args,
    ]  # fmt: skip


def _nodes(sub: str, args: list[str], port: int, timeout_s: float = 120) -> list[list[str]]:
    """The command of node 0 and node 1 of a TP 2 job over 127.0.0.1:port."""
    common = [
        "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}",
        "--dist-timeout", str(timeout_s), "--device", "cpu",
    ]  # fmt: skip
    return [_sglang(sub, *args, *common, "--node-rank", str(n)) for n in (0, 1)]


def _generate_args(model: str, out: str) -> list[str]:
    return [
        "--model-path", model, "--prompt", PROMPT, "--seed", str(SEED),
        "--num-inference-steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE),
        "--output-path", out, "--no-progress",
    ]  # fmt: skip


def _request(**kw) -> SamplingParams:
    return SamplingParams(
        prompt=PROMPT, seed=SEED, num_inference_steps=STEPS, height=SIZE, width=SIZE, **kw
    )


def _run_all(cmds: list[list[str]], timeout: float = 400) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds
    ]
    out = []
    for c, p in zip(cmds, procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(c, p.returncode, so, se))
    return out


@pytest.fixture(scope="module")
def reference(tiny_zimage_dir, tiny_zimage_loras):
    """One process, TP 1: base, LoRA a, a + b at 0.6/1.2, base again."""
    a, b = tiny_zimage_loras
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as engine:
        out = [np.asarray(engine.generate(_request())[0])]
        engine.set_lora("a", a)
        out.append(np.asarray(engine.generate(_request())[0]))
        engine.set_lora(["a", "b"], [None, b], strength=[0.6, 1.2])
        out.append(np.asarray(engine.generate(_request())[0]))
        engine.unset_lora()
        out.append(np.asarray(engine.generate(_request())[0]))
    assert psnr(out[1], out[0]) < 35 and psnr(out[2], out[1]) < 35  # the LoRAs change it
    return out


@pytest.mark.parametrize("launch", ["nodes", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_generate_across_processes_equals_one_process(launch, tiny_zimage_dir, reference, tmp_path):
    if launch == "nodes":
        outs = [str(tmp_path / "node0.png"), str(tmp_path / "node1.png")]
        cmds = _nodes("generate", [], free_port())
        cmds = [c + _generate_args(tiny_zimage_dir, o) for c, o in zip(cmds, outs)]
    else:
        outs = [str(tmp_path / "rank0.png")]
        cmds = [_torchrun(2, "generate", *_generate_args(tiny_zimage_dir, outs[0]))]
    results = _run_all(cmds)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if launch == "nodes":  # node 0 wrote the image; node 1 only ran its rank
        assert not os.path.exists(outs[1]) and results[1].stdout.strip() == ""
    got = np.asarray(Image.open(outs[0]).convert("RGB"))
    assert got.shape == (SIZE, SIZE, 3)
    assert psnr(got, reference[0]) >= MIN_PSNR


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a node exited early ({p.returncode}): {p.stdout.read()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become ready")


def _image(url: str) -> np.ndarray:
    body = {
        "prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "seed": SEED, "num_inference_steps": STEPS,
        "response_format": "b64_json",
    }  # fmt: skip
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def _post(url: str, path: str, body: dict) -> None:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["nodes"])  # torchrun: the generate test
def test_serve_across_processes_with_lora_changes(
    launch, tiny_zimage_dir, tiny_zimage_loras, reference
):
    a, b = tiny_zimage_loras
    port = free_port()
    args = ["--model-path", tiny_zimage_dir, "--port", str(port), "--lora-dir", os.path.dirname(a)]
    args += ["--log-level", "warning"]
    cmds = (
        _nodes("serve", args, free_port()) if launch == "nodes" else [_torchrun(2, "serve", *args)]
    )
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, procs)
        assert httpx.head(f"{url}/health").status_code == 200
        assert httpx.head(f"{url}/ready").status_code == 200
        got = [_image(url)]
        _post(url, "/v1/set_lora", {"lora_nickname": "a", "lora_path": a})
        got.append(_image(url))
        _post(url, "/v1/set_lora", {"lora_nickname": ["a", "b"], "lora_path": [None, b],
                                    "strength": [0.6, 1.2]})  # fmt: skip
        got.append(_image(url))
        _post(url, "/v1/unset_lora", {})
        got.append(_image(url))
    finally:
        procs[0].send_signal(signal.SIGTERM)  # node 0 (or torchrun, which signals every rank)
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
    for i, (g, ref) in enumerate(zip(got, reference)):
        assert psnr(g, ref) >= MIN_PSNR, f"image {i}"
    if launch == "nodes":
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
            assert "Traceback" not in out, out[-3000:]
    else:  # torchrun itself exits 1 with its own traceback when signalled; its ranks do not fail
        assert "sglang serve: error" not in outs[0], outs[0][-3000:]


@pytest.mark.slow
def test_cli_nodes_refuse_other_flags_and_report_a_missing_node(tiny_zimage_dir, tmp_path):
    out = str(tmp_path / "x.png")
    # a generous --dist-timeout: both nodes must start (torch imports, worker spawn) before it
    node0, node1 = _nodes("generate", _generate_args(tiny_zimage_dir, out), free_port(), 180)
    results = _run_all([node0, node1 + ["--dtype", "bfloat16"]])
    for r in results:
        assert r.returncode == 2, r.stderr[-3000:]
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("sglang generate: error:")]
        assert len(lines) == 1, r.stderr[-3000:]
        assert "node 1 was started with other settings than node 0: dtype" in lines[0]
        assert "Traceback" not in r.stderr
    t0 = time.monotonic()
    (alone,) = _run_all(
        [_nodes("generate", _generate_args(tiny_zimage_dir, out), free_port(), 4)[0]]
    )
    took = time.monotonic() - t0
    assert alone.returncode == 1, alone.stderr[-3000:]
    assert "node(s) 1 (rank(s) 1 of 2) did not join the rendezvous" in alone.stderr
    # the 4 s timeout, plus start-up on a loaded 2-core machine (~10 s unloaded); far below
    # the 300 s default, so the flag was honoured
    assert took < 4 + 120
    assert not os.path.exists(out)
