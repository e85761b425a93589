"""Single-request latency through ``sglang serve`` against diffusers' ``ZImagePipeline`` in process.

The Z-Image CPU config of ``bench_e2e.py`` (DiT dim 768 x 8 layers, a small Qwen3 text encoder, a
reduced Flux-style VAE, random weights) is saved as a diffusers directory; ``sglang serve`` loads
it, and this process keeps diffusers' pipeline of the same weights. Requests are interleaved
(server, diffusers, diffusers, server, ...) after one warm-up each, one at a time, so the two
never compute together. The server's time is the client's: HTTP, queueing, prompt encoding,
denoising, decoding, PNG encoding and base64, as a user sees it. Reported: medians and minima,
their ratio, and the PSNR between the two images (the same weights, prompt and seed).

Where the server's time goes: the server's request log (one ``key=value`` line per request at
``info``: ``total_s`` from the first byte in to the last byte out, ``queued_s`` in the scheduler's
queue, ``compute_s`` in the engine) splits each timed request into the engine, the queue, the
rest of the server (body parsing, thread hand-offs, PNG encoding, base64, the JSON answer) and the
client side (connection, transfer, the client's JSON parse); medians are printed under the table.
Inside the engine, ``bench_e2e.py`` times the DiT per step on the same config.

Usage:
    python benchmarks/bench_server_latency.py [--repeats 7] [--steps 8] [--size 256]
        [--serve-args "--float32-matmul-precision medium"]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--serve-args", default="", help="extra `sglang serve` flags")
    args = ap.parse_args(argv)

    import httpx
    from bench_e2e import CPU_CFG, build
    from bench_serving import free_port, wait_healthy
    from PIL import Image

    _, ref = build(dict(CPU_CFG))
    tmp = tempfile.mkdtemp(prefix="bench_server_latency_")
    ref.save_pretrained(tmp)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["sglang", "serve", "--model-path", tmp, "--port", str(port), "--device", "cpu"]
    log_path = os.path.join(tmp, "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd + shlex.split(args.serve_args), stdout=log, stderr=subprocess.STDOUT
    )
    prompt, seed = "a benchmark prompt", 0
    kw = dict(height=args.size, width=args.size, num_inference_steps=args.steps)
    body = dict(
        prompt=prompt, size=f"{args.size}x{args.size}", num_inference_steps=args.steps,
        guidance_scale=0.0, seed=seed, response_format="b64_json",
    )  # fmt: skip

    request_ids: list[str] = []

    def server() -> np.ndarray:
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
        r.raise_for_status()
        request_ids.append(r.headers.get("x-request-id", ""))
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))

    def diffusers() -> np.ndarray:
        g = torch.Generator("cpu").manual_seed(seed)
        with torch.inference_mode():
            out = ref(prompt, generator=g, output_type="np", guidance_scale=0.0, **kw)
        return (np.asarray(out.images)[0] * 255).round().astype("uint8")

    runs = {"server": server, "diffusers": diffusers}
    times: dict[str, list[float]] = {k: [] for k in runs}
    images: dict[str, np.ndarray] = {}
    try:
        wait_healthy(url, proc, timeout_s=600)
        for fn in runs.values():  # warm-up
            fn()
        for i in range(args.repeats):
            for name in ("server", "diffusers") if i % 2 == 0 else ("diffusers", "server"):
                t0 = time.perf_counter()
                images[name] = runs[name]()
                times[name].append(time.perf_counter() - t0)
                print(f"  run {i} {name}: {times[name][-1]:.3f}s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    timed_ids = request_ids[1:]  # the first was the warm-up

    a, b = images["server"].astype(np.float64), images["diffusers"].astype(np.float64)
    mse = float(np.mean((a - b) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)
    t = CPU_CFG["transformer"]
    print(
        f"\nzimage CPU dim {t['dim']} x {t['n_layers']} layers, {args.size}x{args.size}, "
        f"{args.steps} steps, fp32; `sglang serve {args.serve_args}`; {args.repeats} interleaved "
        f"runs; image PSNR {psnr:.1f} dB"
    )
    print("| metric | server (HTTP) | diffusers (in process) | server/diffusers |")
    print("|---|---|---|---|")
    for label, agg in (("median (s)", statistics.median), ("min (s)", min)):
        s, d = agg(times["server"]), agg(times["diffusers"])
        print(f"| {label} | {s:.3f} | {d:.3f} | {s / d:.3f} |")
    split = server_split(open(log_path).read(), timed_ids, times["server"])
    if split:
        print(
            "\nserver time, medians (ms): "
            + ", ".join(f"{k} {v * 1000:.1f}" for k, v in split.items())
        )
    return 0


def server_split(log_text: str, request_ids: list[str], client_s: list[float]) -> dict:
    """Median seconds per part of a served request: ``engine`` (``compute_s`` of the request
    log), ``queue`` (``queued_s``), ``server other`` (``total_s`` minus both: parsing, hand-offs,
    PNG, base64, JSON), ``client side`` (the client's time minus ``total_s``). ``request_ids``
    (the ``X-Request-Id`` answers) and ``client_s`` are in the same order; ``{}`` when the log
    has none of the lines (e.g. ``--log-level warning``)."""
    fields = {}
    for line in log_text.splitlines():
        m = re.search(r"request_id=(\S+) .*total_s=(\S+)", line)
        if m and "compute_s=" in line:
            kv = dict(re.findall(r"(\w+)=(\S+)", line))
            fields[m.group(1)] = {k: float(kv[k]) for k in ("total_s", "queued_s", "compute_s")}
    rows = [(fields[i], c) for i, c in zip(request_ids, client_s) if i in fields]
    if not rows:
        return {}
    med = statistics.median
    return {
        "client": med(c for _, c in rows),
        "engine": med(f["compute_s"] for f, _ in rows),
        "queue": med(f["queued_s"] for f, _ in rows),
        "server other": med(f["total_s"] - f["queued_s"] - f["compute_s"] for f, _ in rows),
        "client side": med(c - f["total_s"] for f, c in rows),
    }


if __name__ == "__main__":
    sys.exit(main())
