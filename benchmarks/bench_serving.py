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

**Against a plain diffusers server** (``--diffusers``, with ``--launch``): the same model directory
is also served by ``benchmarks/diffusers_server.py`` (diffusers' pipeline behind a FastAPI route
under a lock, uvicorn on 127.0.0.1), and every level runs on both servers in the same run,
alternating which goes first, base requests only (the baseline has no per-request LoRA) with the
guidance written into every request (the model's default unless ``--guidance-scale``)::

    python benchmarks/bench_serving.py --launch --diffusers --no-direct --size 64x64 --steps 4 \
        --num-requests 64 --arrival closed poisson --rate 8 --rounds 3 --markdown

``--arrival closed``: each of N clients sends its next request when the last one returns.
``--arrival poisson --rate R``: requests arrive at exponential gaps of mean 1/R s (seeded by
``--arrival-seed``, the same schedule for both servers) whatever the answers, at most N in flight
(N = the concurrency level; one that finds all N busy waits in the client, and that wait counts in
its latency, which is measured from its scheduled arrival). ``--markdown`` prints the comparison
as a table ready for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start, increasing, the first > 0) of ``n`` requests of a
    Poisson process of ``rate`` requests per second: cumulative sums of exponential gaps of mean
    ``1 / rate``, drawn from ``random.Random(seed)`` (the same schedule for the same seed).

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def build_requests(
    n: int,
    size: str,
    steps: int,
    lora_name: str | None,
    lora_fraction: float,
    guidance_scale: float | None = None,
):
    """The fixed request mix: prompt/seed vary; every k-th request names the adapter; with
    ``guidance_scale``, every request carries it (else the server's default applies)."""
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
        if guidance_scale is not None:
            body["guidance_scale"] = guidance_scale
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


async def run_level(
    base_url: str,
    requests: list[dict],
    concurrency: int,
    headers: dict,
    arrivals: list[float] | None = None,
    metrics: bool = True,
) -> dict:
    """Send ``requests`` with ``concurrency`` workers (closed loop), or, with ``arrivals``
    (seconds from the start, one per request, see :func:`poisson_schedule`), each at its time
    with at most ``concurrency`` in flight (open loop; latency counted from the arrival time);
    return the measured numbers.

    ``overhead_ms`` is the mean client latency minus the mean time the server reports for the
    same requests inside the engine and in its queue (``/metrics``): the cost of the HTTP path
    (parsing, scheduling hand-off, PNG encoding, base64, transfer, client decode), measured at
    the same moment as the latency itself, so other load on the machine affects both alike.
    With ``metrics=False`` (a server without ``/metrics``) it is NaN.
    """
    import httpx

    if arrivals is not None:
        return await _run_open_loop(base_url, requests, concurrency, headers, arrivals)
    if metrics:
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
        **_level_result(concurrency, requests, latencies, errors, wall),
        "base_p50_s": _p(base_lat, 50),
        "lora_p50_s": _p(lora_lat, 50),
        **(
            _overhead(
                latencies,
                (gen0, wait0, n0),
                await asyncio.to_thread(scrape_engine_time, base_url, headers),
            )
            if metrics
            else _overhead([], (), ())
        ),
    }


def _p(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN when there are none)."""
    return percentile(values, q) if values else float("nan")


def _level_result(
    concurrency: int, requests: list, latencies: list[float], errors: dict, wall: float
) -> dict:
    """The fields every level reports (closed loop and scheduled arrivals alike)."""
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "ok": len(latencies),
        "errors": errors,
        "images_per_s": len(latencies) / wall,
        "p50_s": _p(latencies, 50),
        "p99_s": _p(latencies, 99),
        "wall_s": wall,
    }


async def _run_open_loop(
    base_url: str, requests: list[dict], concurrency: int, headers: dict, arrivals: list[float]
) -> dict:
    """:func:`run_level` for scheduled arrivals: request ``i`` leaves at ``arrivals[i]`` s after
    the start, or when one of the ``concurrency`` slots frees up if all are busy then."""
    import httpx

    latencies: list[float] = []
    errors: dict[int, int] = {}
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        t_start = time.perf_counter()

        async def one(body: dict, at: float) -> None:
            await asyncio.sleep(max(0.0, t_start + at - time.perf_counter()))
            async with slots:
                resp = await client.post(f"{base_url}/v1/images/generations", json=body)
            if resp.status_code == 200:
                latencies.append(time.perf_counter() - (t_start + at))
            else:
                errors[resp.status_code] = errors.get(resp.status_code, 0) + 1

        await asyncio.gather(*(one(b, a) for b, a in zip(requests, arrivals)))
        wall = time.perf_counter() - t_start
    return {
        **_level_result(concurrency, requests, latencies, errors, wall),
        "base_p50_s": float("nan"),
        "lora_p50_s": float("nan"),
        **_overhead([], (), ()),
    }


def _overhead(latencies: list[float], before: tuple, after: tuple) -> dict:
    count = after[2] - before[2] if latencies else 0
    if count <= 0:
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


def model_guidance(model_path: str) -> float | None:
    """The guidance scale ``sglang serve`` uses by default for the model at ``model_path``
    (``_sglang_defaults.guidance_scale`` in its ``transformer/config.json``), or ``None``."""
    try:
        with open(os.path.join(model_path, "transformer", "config.json")) as f:
            return json.load(f).get("_sglang_defaults", {}).get("guidance_scale")
    except OSError:
        return None


def launch_diffusers(model_path: str, device: str | None) -> tuple[subprocess.Popen, str]:
    """Start ``diffusers_server.py`` (next to this file) on a free 127.0.0.1 port; return the
    process and its URL once ``/health`` answers."""
    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "diffusers_server.py"), "--model-path", model_path]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", device or "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def _median_row(runs: list[dict]) -> dict:
    """One row from the rounds of one (server, arrival, clients) cell: the median of each
    number, errors summed."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = statistics.median(r[key] for r in runs)
    row["errors"] = sum(sum(r["errors"].values()) for r in runs)
    row["rounds"] = len(runs)
    return row


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


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
    p.add_argument("--guidance-scale", type=float, default=None,
                   help="sent with every request (default: the server's; with --diffusers the "
                        "model's sglang default, so both servers run the same)")  # fmt: skip
    p.add_argument("--lora-path", default=None, help="adapter for the per-request LoRA mix")
    p.add_argument("--lora-fraction", type=float, default=0.5)
    p.add_argument("--no-direct", action="store_true", help="skip the direct-engine baseline")
    p.add_argument("--diffusers", action="store_true",
                   help="--launch: also serve the model with diffusers_server.py and measure it "
                        "in the same run (base requests only)")  # fmt: skip
    p.add_argument("--arrival", nargs="+", choices=["closed", "poisson"], default=["closed"])
    p.add_argument("--rate", type=float, default=None, help="poisson: requests per second")
    p.add_argument("--arrival-seed", type=int, default=0, help="poisson: the schedule's seed")
    p.add_argument("--rounds", type=int, default=1, help="repeat every cell; report medians")
    p.add_argument("--markdown", action="store_true", help="print only the docs-ready table")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--max-batch-size", type=int, default=None, help="--launch: the server's batch bound"
    )
    p.add_argument("--batch-wait-ms", type=float, default=None, help="--launch: batch window")
    p.add_argument("--serve-args", default="", help="--launch: extra `sglang serve` flags")
    args = p.parse_args(argv)
    if not args.base_url and not args.launch:
        p.error("give --base-url or --launch")
    if args.diffusers and not args.launch:
        p.error("--diffusers needs --launch (both servers must load the same directory)")
    if "poisson" in args.arrival and not (args.rate and args.rate > 0):
        p.error("--arrival poisson needs --rate R (requests per second, > 0)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")

    import shlex

    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tmp = tempfile.mkdtemp(prefix="bench-serving-")
    procs: list[subprocess.Popen] = []
    model_path = args.model_path
    if model_path is None:
        from sglang.multimodal_gen.models.default_model import default_model_path

        model_path = default_model_path()
    lora_path = args.lora_path
    use_lora = (_lora_runtime_available() or args.base_url is not None) and not args.diffusers
    if lora_path is None and args.launch and use_lora:
        lora_path = _write_tiny_lora(model_path, tmp)
    if args.diffusers:
        lora_path = None  # the diffusers baseline serves the base model only
    lora_dir = os.path.dirname(os.path.abspath(lora_path)) if lora_path else None
    guidance = args.guidance_scale
    if guidance is None and args.diffusers:
        guidance = model_guidance(model_path)
    say = (lambda *a, **k: None) if args.markdown else print
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
            cmd += shlex.split(args.serve_args)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, procs[-1])
        servers = {"sglang": (base_url, headers, True)}
        if args.diffusers:
            proc, url = launch_diffusers(model_path, args.device)
            procs.append(proc)
            servers["diffusers"] = (url, {}, False)
        lora_name = None
        if lora_path:
            lora_name = "bench"
            r = httpx.post(
                f"{base_url}/v1/set_lora", headers=headers, timeout=300,
                json={"lora_nickname": lora_name, "lora_path": lora_path},
            )  # fmt: skip
            if r.status_code != 200:
                say(f"set_lora failed ({r.status_code}): {r.text}; benchmarking without LoRA")
                lora_name = None
            else:
                httpx.post(f"{base_url}/v1/unset_lora", headers=headers, timeout=300)
        requests = build_requests(
            args.num_requests, args.size, args.steps, lora_name, args.lora_fraction, guidance
        )
        schedule = None
        if "poisson" in args.arrival:
            schedule = poisson_schedule(len(requests), args.rate, args.arrival_seed)
        for url, hdrs, metrics in servers.values():  # warm-up (one of each kind)
            asyncio.run(run_level(url, requests[: 2 if lora_name else 1], 1, hdrs, None, metrics))
        cells: dict[tuple[str, str, int], list[dict]] = {}
        turn = 0
        for _ in range(args.rounds):
            for arrival in args.arrival:
                for c in args.concurrency:
                    names = list(servers)
                    if turn % 2:  # alternate which server goes first
                        names.reverse()
                    turn += 1
                    for name in names:
                        url, hdrs, metrics = servers[name]
                        arr = schedule if arrival == "poisson" else None
                        r = asyncio.run(run_level(url, requests, c, hdrs, arr, metrics))
                        print(
                            f"  {name} {arrival} {c} clients: {r['images_per_s']:.2f} images/s, "
                            f"p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s",
                            file=sys.stderr, flush=True,
                        )  # fmt: skip
                        cells.setdefault((name, arrival, c), []).append(r)
    finally:
        for proc in procs:
            _stop(proc)
    rows = {key: _median_row(runs) for key, runs in cells.items()}
    direct = None
    if not args.no_direct:
        direct = run_direct(
            model_path, requests, ("bench", lora_path) if lora_name else None, lora_dir, args.device
        )
    shutil.rmtree(tmp, ignore_errors=True)

    mix = f"{args.lora_fraction:.0%} per-request LoRA" if lora_name else "base requests only"
    rate = f", Poisson rate {args.rate}/s seed {args.arrival_seed}" if schedule else ""
    caption = (
        f"model {os.path.basename(os.path.normpath(model_path))}, {args.size}, {args.steps} steps, "
        f"guidance {guidance if guidance is not None else 'server default'}, "
        f"{args.num_requests} requests per level, {mix}{rate}, "
        f"median of {args.rounds} round(s)"
    )
    if args.markdown and args.diffusers:
        print(caption + "\n")
        print(_comparison_table(rows, args.arrival, args.concurrency))
        return _write_json(args.json, rows, direct)
    print(f"\n{caption}\n")
    print(
        "| server | arrival | clients | images/s | p50 (s) | p99 (s) | base p50 (s) "
        "| LoRA p50 (s) | engine mean (s) | HTTP overhead (ms) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, arrival, c), r in rows.items():
        print(
            f"| {name} | {arrival} | {c} | {r['images_per_s']:.2f} | {r['p50_s']:.3f} | "
            f"{r['p99_s']:.3f} | {r['base_p50_s']:.3f} | {r['lora_p50_s']:.3f} | "
            f"{r['engine_mean_s']:.3f} | {r['overhead_ms']:.1f} | {r['errors']} |"
        )
    if direct:
        print(f"| direct engine | closed | 1 | {direct['images_per_s']:.2f} | "
              f"{direct['p50_s']:.3f} | {direct['p99_s']:.3f} | {direct['base_p50_s']:.3f} | "
              f"{direct['lora_p50_s']:.3f} | {direct['mean_s']:.3f} | - | 0 |")  # fmt: skip
        c1 = rows.get(("sglang", "closed", 1))
        if c1:
            over = c1["p50_s"] - direct["p50_s"]
            print(f"\nserver p50 at 1 client minus direct p50 (separate runs): {over * 1000:+.1f} ms "
                  f"({over / direct['p50_s']:+.1%}); HTTP overhead measured against the server's "
                  f"own engine time: {c1['overhead_ms']:.1f} ms per request")  # fmt: skip
    if args.diffusers:
        print("\nours vs the diffusers server (same run):\n")
        print(_comparison_table(rows, args.arrival, args.concurrency))
    return _write_json(args.json, rows, direct)


def _comparison_table(rows: dict, arrivals: list[str], levels: list[int]) -> str:
    """Markdown: per (arrival, clients), images/s and p50/p99 of both servers and the ratio of
    images/s (ours / diffusers)."""
    lines = [
        "| arrival | clients | images/s: ours | images/s: diffusers | ours / diffusers "
        "| p50 (s): ours / diffusers | p99 (s): ours / diffusers | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arrival in arrivals:
        for c in levels:
            a, b = rows[("sglang", arrival, c)], rows[("diffusers", arrival, c)]
            lines.append(
                f"| {arrival} | {c} | {a['images_per_s']:.2f} | {b['images_per_s']:.2f} | "
                f"{a['images_per_s'] / b['images_per_s']:.2f}x | {a['p50_s']:.3f} / "
                f"{b['p50_s']:.3f} | {a['p99_s']:.3f} / {b['p99_s']:.3f} | "
                f"{a['errors'] + b['errors']} |"
            )
    return "\n".join(lines)


def _write_json(path: str | None, rows: dict, direct: dict | None) -> int:
    if path:
        runs = [{"server": k[0], "arrival": k[1], **v} for k, v in rows.items()]
        with open(path, "w") as f:
            json.dump({"runs": runs, "direct": direct}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
