"""Single-request latency through ``sglang serve`` against diffusers' ``ZImagePipeline`` in process.

The Z-Image CPU config of ``bench_e2e.py`` (DiT dim 768 x 8 layers, a small Qwen3 text encoder, a
reduced Flux-style VAE, random weights) is saved as a diffusers directory; ``sglang serve`` loads
it, and this process keeps diffusers' pipeline of the same weights. Requests are interleaved
(server, diffusers, diffusers, server, ...) after one warm-up each, one at a time, so the two
never compute together. The server's time is the client's: HTTP, queueing, prompt encoding,
denoising, decoding, PNG encoding and base64, as a user sees it. Reported: medians and minima,
their ratio, and the PSNR between the two images (the same weights, prompt and seed).

Usage:
    python benchmarks/bench_server_latency.py [--repeats 7] [--steps 8] [--size 256]
        [--serve-args "--float32-matmul-precision medium"]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
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
    proc = subprocess.Popen(
        cmd + shlex.split(args.serve_args), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    prompt, seed = "a benchmark prompt", 0
    kw = dict(height=args.size, width=args.size, num_inference_steps=args.steps)
    body = dict(
        prompt=prompt, size=f"{args.size}x{args.size}", num_inference_steps=args.steps,
        guidance_scale=0.0, seed=seed, response_format="b64_json",
    )  # fmt: skip

    def server() -> np.ndarray:
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
        r.raise_for_status()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
