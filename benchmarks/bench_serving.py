"""Serving benchmark: throughput and latency of ``sglang serve`` under N concurrent clients.

For each concurrency level (default 1, 4, 16) the benchmark sends a fixed mix of requests
(``--lora-fraction`` of them carry a per-request ``lora``, the rest use the base model), and
reports images/s, p50/p99 latency (all, base-only, LoRA-only), the server's own mean engine time
for those requests (scraped from ``/metrics``) and the HTTP overhead = mean client latency - engine
time - queue wait. It then calls the engine directly (same requests, one at a time, on a worker
thread of this process) as the no-HTTP baseline.

Usage::

    # start a server on the tiny default model, benchmark it, stop it
    python benchmarks/bench_serving.py --launch --size 64x64 --steps 2 --num-requests 32

    # against a running server (no direct-engine comparison unless --model-path is given)
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --no-direct

With ``--launch`` and no ``--lora-path``, a random LoRA for the tiny model is written to a
temporary directory (served with ``--lora-dir``) so the mix includes per-request adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def build_requests(n: int, size: str, steps: int, lora_name: str | None, lora_fraction: float):
    """The fixed request mix: prompt/seed vary; every k-th request names the adapter."""
    every = int(round(1 / lora_fraction)) if lora_name and lora_fraction > 0 else 0
    out = []
    for i in range(n):
        body = {
            "prompt": f"benchmark prompt {i % 7}",
            "size": size,
            "seed": i,
            "num_inference_steps": steps,
            "response_format": "b64_json",
        }
        if every and i % every == every - 1:
            body["lora"] = {"name": lora_name, "scale": 0.8}
        out.append(body)
    return out


def scrape_engine_time(base_url: str, headers: dict) -> tuple[float, float, float]:
    """``(generation_seconds_sum, queue_wait_seconds_sum, count)`` from the server's /metrics."""
    import re

    import httpx

    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=60).text

    def value(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return (
        value("sglang_generation_seconds_sum"),
        value("sglang_queue_wait_seconds_sum"),
        value("sglang_generation_seconds_count"),
    )


async def run_level(base_url: str, requests: list[dict], concurrency: int, headers: dict) -> dict:
    """Send ``requests`` with ``concurrency`` workers; return the measured numbers.

    ``overhead_ms`` is the mean client latency minus the mean time the server reports for the
    same requests inside the engine and in its queue (``/metrics``): the cost of the HTTP path
    (parsing, scheduling hand-off, PNG encoding, base64, transfer, client decode), measured at
    the same moment as the latency itself, so other load on the machine affects both alike.
    """
    import httpx

    gen0, wait0, n0 = await asyncio.to_thread(scrape_engine_time, base_url, headers)

    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    latencies: list[float] = []
    lora_lat: list[float] = []
    base_lat: list[float] = []
    errors: dict[int, int] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def worker():
            while True:
                try:
                    body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                resp = await client.post(f"{base_url}/v1/images/generations", json=body)
                dt = time.perf_counter() - t0
                if resp.status_code == 200:
                    latencies.append(dt)
                    (lora_lat if "lora" in body else base_lat).append(dt)
                else:
                    errors[resp.status_code] = errors.get(resp.status_code, 0) + 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "ok": len(latencies),
        "errors": errors,
        "images_per_s": len(latencies) / wall,
        "p50_s": percentile(latencies, 50) if latencies else float("nan"),
        "p99_s": percentile(latencies, 99) if latencies else float("nan"),
        "base_p50_s": percentile(base_lat, 50) if base_lat else float("nan"),
        "lora_p50_s": percentile(lora_lat, 50) if lora_lat else float("nan"),
        "wall_s": wall,
        **_overhead(
            latencies,
            (gen0, wait0, n0),
            await asyncio.to_thread(scrape_engine_time, base_url, headers),
        ),
    }


def _overhead(latencies: list[float], before: tuple, after: tuple) -> dict:
    count = after[2] - before[2]
    if not latencies or count <= 0:
        return {"engine_mean_s": float("nan"), "overhead_ms": float("nan")}
    engine_mean = (after[0] - before[0]) / count
    wait_mean = (after[1] - before[1]) / count
    client_mean = sum(latencies) / len(latencies)
    return {
        "engine_mean_s": engine_mean,
        "overhead_ms": (client_mean - engine_mean - wait_mean) * 1000,
    }


def run_direct(
    model_path: str | None,
    requests: list[dict],
    lora: tuple[str, str] | None,
    lora_dir: str | None,
    device: str | None = None,
):
    """The same requests straight into ``DiffusionEngine.generate``, one at a time, on one thread."""
    from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

    engine = DiffusionEngine(
        model_path=model_path, device=device, lora_dirs=[lora_dir] if lora_dir else ()
    )
    try:
        if lora:
            engine.set_lora(lora[0], lora[1])
            engine.unset_lora()
        w, h = (int(x) for x in requests[0]["size"].split("x"))
        engine.generate(SamplingParams(prompt="warmup", width=w, height=h, num_inference_steps=1))
        lat: list[float] = []
        kinds: list[bool] = []  # True: the request had a per-request LoRA
        wall = 0.0

        def loop() -> None:
            nonlocal wall
            t_start = time.perf_counter()
            for body in requests:
                comp = None
                if "lora" in body:
                    comp = [(body["lora"]["name"], body["lora"]["scale"])]
                req = SamplingParams(
                    prompt=body["prompt"], width=w, height=h, seed=body["seed"],
                    num_inference_steps=body["num_inference_steps"], lora=comp,
                )  # fmt: skip
                t0 = time.perf_counter()
                engine.generate(req)
                lat.append(time.perf_counter() - t0)
                kinds.append(comp is not None)
            wall = time.perf_counter() - t_start

        # Run on a worker thread, as the server's scheduler does: on a busy CPU, torch's
        # intra-op thread pool behaves differently when driven from the main thread.
        worker = threading.Thread(target=loop)
        worker.start()
        worker.join()
    finally:
        engine.shutdown()
    base = [t for t, k in zip(lat, kinds) if not k]
    with_lora = [t for t, k in zip(lat, kinds) if k]
    return {
        "images_per_s": len(lat) / wall,
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "mean_s": statistics.fmean(lat),
        "base_p50_s": percentile(base, 50) if base else float("nan"),
        "lora_p50_s": percentile(with_lora, 50) if with_lora else float("nan"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Return once ``GET /health`` answers 200; ``SystemExit`` if ``proc`` (the server) exits
    first or ``timeout_s`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit("server exited during startup")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("server did not start")
        time.sleep(0.2)


def _write_tiny_lora(model_path: str, folder: str) -> str:
    """A random rank-4 LoRA on the attention q/v projections of the model at ``model_path``."""
    import torch
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(model_path, "transformer", "config.json")))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(cfg["n_layers"]):
        for m in ("to_q", "to_v"):
            key = f"transformer.layers.{i}.attention.{m}"
            sd[f"{key}.lora_A.weight"] = torch.randn(4, cfg["dim"], generator=g) * 0.2
            sd[f"{key}.lora_B.weight"] = torch.randn(cfg["dim"], 4, generator=g) * 0.2
    path = os.path.join(folder, "bench_lora.safetensors")
    save_file(sd, path)
    return path


def _lora_runtime_available() -> bool:
    try:
        import sglang.multimodal_gen.lora.manager  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default=None, help="a running server (else use --launch)")
    p.add_argument("--launch", action="store_true", help="start `sglang serve` for the run")
    p.add_argument("--model-path", default=None, help="model for --launch and the direct run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--device", default=None, help="engine device for --launch and direct runs")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-requests", type=int, default=32, help="requests per level")
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lora-path", default=None, help="adapter for the per-request LoRA mix")
    p.add_argument("--lora-fraction", type=float, default=0.5)
    p.add_argument("--no-direct", action="store_true", help="skip the direct-engine baseline")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--max-batch-size", type=int, default=None, help="--launch: the server's batch bound"
    )
    p.add_argument("--batch-wait-ms", type=float, default=None, help="--launch: batch window")
    args = p.parse_args(argv)
    if not args.base_url and not args.launch:
        p.error("give --base-url or --launch")

    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tmp = tempfile.mkdtemp(prefix="bench-serving-")
    proc = None
    model_path = args.model_path
    if model_path is None:
        from sglang.multimodal_gen.models.default_model import default_model_path

        model_path = default_model_path()
    lora_path = args.lora_path
    use_lora = _lora_runtime_available() or args.base_url is not None
    if lora_path is None and args.launch and use_lora:
        lora_path = _write_tiny_lora(model_path, tmp)
    lora_dir = os.path.dirname(os.path.abspath(lora_path)) if lora_path else None
    try:
        base_url = args.base_url
        if args.launch:
            port = free_port()
            cmd = [sys.executable, "-m", "sglang.cli.main", "serve", "--model-path", model_path]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
            cmd += ["--max-queue-size", str(max(64, max(args.concurrency) * 2))]
            if lora_dir:
                cmd += ["--lora-dir", lora_dir]
            if args.api_key:
                cmd += ["--api-key", args.api_key]
            if args.device:
                cmd += ["--device", args.device]
            if args.max_batch_size is not None:
                cmd += ["--max-batch-size", str(args.max_batch_size)]
            if args.batch_wait_ms is not None:
                cmd += ["--batch-wait-ms", str(args.batch_wait_ms)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, proc)
        lora_name = None
        if lora_path:
            lora_name = "bench"
            r = httpx.post(
                f"{base_url}/v1/set_lora", headers=headers, timeout=300,
                json={"lora_nickname": lora_name, "lora_path": lora_path},
            )  # fmt: skip
            if r.status_code != 200:
                print(f"set_lora failed ({r.status_code}): {r.text}; benchmarking without LoRA")
                lora_name = None
            else:
                httpx.post(f"{base_url}/v1/unset_lora", headers=headers, timeout=300)
        requests = build_requests(
            args.num_requests, args.size, args.steps, lora_name, args.lora_fraction
        )
        # warm-up (one of each kind)
        asyncio.run(run_level(base_url, requests[: 2 if lora_name else 1], 1, headers))
        results = [asyncio.run(run_level(base_url, requests, c, headers)) for c in args.concurrency]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    direct = None
    if not args.no_direct:
        direct = run_direct(
            model_path, requests, ("bench", lora_path) if lora_name else None, lora_dir, args.device
        )
    shutil.rmtree(tmp, ignore_errors=True)

    mix = f"{args.lora_fraction:.0%} per-request LoRA" if lora_name else "no LoRA (runtime absent)"
    print(f"\nmodel {os.path.basename(model_path)}, {args.size}, {args.steps} steps, "
          f"{args.num_requests} requests per level, mix: {mix}\n")  # fmt: skip
    print(
        "| path | clients | images/s | p50 (s) | p99 (s) | base p50 (s) | LoRA p50 (s) "
        "| engine mean (s) | HTTP overhead (ms) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| HTTP | {r['concurrency']} | {r['images_per_s']:.2f} | {r['p50_s']:.3f} | "
            f"{r['p99_s']:.3f} | {r['base_p50_s']:.3f} | {r['lora_p50_s']:.3f} | "
            f"{r['engine_mean_s']:.3f} | {r['overhead_ms']:.1f} | {sum(r['errors'].values())} |"
        )
    if direct:
        print(f"| direct engine | 1 | {direct['images_per_s']:.2f} | {direct['p50_s']:.3f} | "
              f"{direct['p99_s']:.3f} | {direct['base_p50_s']:.3f} | "
              f"{direct['lora_p50_s']:.3f} | {direct['mean_s']:.3f} | - | 0 |")  # fmt: skip
        c1 = next((r for r in results if r["concurrency"] == 1), None)
        if c1:
            over = c1["p50_s"] - direct["p50_s"]
            print(f"\nserver p50 at 1 client minus direct p50 (separate runs): {over * 1000:+.1f} ms "
                  f"({over / direct['p50_s']:+.1%}); HTTP overhead measured against the server's "
                  f"own engine time: {c1['overhead_ms']:.1f} ms per request")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"http": results, "direct": direct}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
