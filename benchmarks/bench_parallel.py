"""Per-step DiT time, bytes moved and error of each parallel layout against one process.

A Z-Image-shaped DiT (built with diffusers' ``ZImageTransformer2DModel`` from one seed in every
process, loaded through our name map and weight loaders) runs one CFG step: the conditional and
unconditional rows (``StagedPipeline.run_branches``, which splits them over the CFG group when
CFG parallelism is on). Every process of a layout counts the bytes it sends through
``torch.distributed`` by collective (all-reduce: the TP reduces; all-to-all: Ulysses; P2P: ring;
all-gather: the SP output gather and the CFG combine). Reported per layout: the median step time
over ``--repeats``, the bytes sent per rank per step, and the relative error of the output
against the one-process step.

On this 2-core CPU with gloo the times show the cost of the collectives, not a speed-up (the
processes share two cores); the byte counts are what the formulas in docs/parallelism.md predict
and are the same with NCCL. On a multi-GPU CUDA machine, ``--device cuda`` runs the same layouts on
NCCL (``--dtype bfloat16`` there).

``--speedup-model`` prints instead the modelled step time of real models on 2/4/8 GPUs of one
NVLink node: the measured one-GPU step (docs/benchmarks.md) divided by the process count, plus
the bytes each rank sends per step (the formulas of docs/parallelism.md) over an effective
``--link-gbps`` (default 350 GB/s: H200 NVLink 4 is 450 GB/s per direction, NCCL reaches about
80 % of it on large messages), with no overlap of communication and compute (conservative).

Usage:
    python benchmarks/bench_parallel.py [--dim 768 --layers 4 --heads 12 --size 256]
        [--layouts tp2,ulysses2,ring2,usp2x2,tp2xulysses2,cfg2] [--repeats 5] [--device cpu]
    python benchmarks/bench_parallel.py --speedup-model [--link-gbps 350]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from sglang.multimodal_gen.distributed import ParallelLayout, launch_processes

LAYOUTS = {
    "one": ParallelLayout(),
    "tp2": ParallelLayout(tp_size=2),
    "ulysses2": ParallelLayout(ulysses_degree=2),
    "ring2": ParallelLayout(ring_degree=2),
    "usp2x2": ParallelLayout(ulysses_degree=2, ring_degree=2),
    "tp2xulysses2": ParallelLayout(tp_size=2, ulysses_degree=2),
    "cfg2": ParallelLayout(cfg_degree=2),
    "cfg2xulysses2": ParallelLayout(cfg_degree=2, ulysses_degree=2),
}


def _count_bytes(counter: dict) -> None:
    """Wrap the collectives the engine uses so each adds the bytes this rank sends."""

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def wrap(name, fn, size_of):
        def inner(*a, **kw):
            counter[name] += size_of(*a, **kw)
            return fn(*a, **kw)

        return inner

    dist.all_reduce = wrap("all_reduce", dist.all_reduce, lambda t, **_: nbytes(t))
    dist.all_to_all_single = wrap(
        "all_to_all", dist.all_to_all_single, lambda out, inp, *a, **k: nbytes(inp)
    )
    dist.all_gather = wrap("all_gather", dist.all_gather, lambda parts, t, **_: nbytes(t))
    dist.batch_isend_irecv = wrap(
        "p2p",
        dist.batch_isend_irecv,
        lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.isend),
    )


def _model(args, device):
    from diffusers import ZImageTransformer2DModel
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family

    hd = args.dim // args.heads
    axes = [hd // 4, 3 * hd // 8, 3 * hd // 8]
    torch.manual_seed(0)  # the same full weights in every process
    ref = ZImageTransformer2DModel(
        dim=args.dim, n_layers=args.layers, n_refiner_layers=1, n_heads=args.heads,
        n_kv_heads=args.heads, cap_feat_dim=256, axes_dims=axes, axes_lens=[1024, 512, 512],
    )  # fmt: skip
    dtype = getattr(torch, args.dtype)
    return denoiser_from_module(ref, get_family("zimage").denoiser(), dtype, device)


def _inputs(args, device, dtype):
    g = torch.Generator().manual_seed(1)
    lat = args.size // 8
    x = torch.randn(2, 16, 1, lat, lat, generator=g).to(device, dtype)  # [cond, uncond]
    caps = [torch.randn(n, 256, generator=g).to(device, dtype) for n in (77, 20)]
    return x, torch.tensor([0.6, 0.6], device=device), caps


def _rank_fn(rank, args):
    from sglang.multimodal_gen.pipelines.base import StagedPipeline

    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    counter: dict = defaultdict(int)
    model = _model(args, device)
    dtype = model.dtype
    x, t, caps = _inputs(args, device, dtype)
    ctx = model.encode_captions(caps)  # once per request, as the pipeline does
    pipe = object.__new__(StagedPipeline)  # run_branches needs no pipeline state

    def step():
        out = pipe.run_branches(model, 2, dict(x=x, t=t, cap=ctx), ("x", "t", "cap"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return torch.stack(out)

    with torch.no_grad():
        out = step()  # warm-up
        _count_bytes(counter)
        counter.clear()
        out = step()
        sent = dict(counter)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), sent, out.float().cpu()


# Measured one-H200 DiT step (bf16, docs/benchmarks.md) and the shapes that set the traffic:
# tokens per row, rows per step (2 with CFG batched), width, blocks, TP all-reduces per block.
REAL = {
    "Z-Image-Turbo 1024^2 (no CFG)": dict(
        ms=121.7, tokens=4096 + 128, rows=1, dim=3840, blocks=32, ar=2, cfg=False
    ),  # fmt: skip
    "FLUX.1-dev 1024^2 (no true CFG)": dict(
        ms=180.0, tokens=4096 + 512, rows=1, dim=3072, blocks=57, ar=4 / 3, cfg=False
    ),  # fmt: skip
    "Wan2.2-A14B 480x832x17 (CFG)": dict(
        ms=1077.6, tokens=7800, rows=2, dim=5120, blocks=40, ar=3, cfg=True
    ),  # fmt: skip
}
MODEL_LAYOUTS = {
    "Z-Image-Turbo 1024^2 (no CFG)": ["tp2", "ulysses2", "ring2", "usp2x2", "tp2xring2", "usp2x4"],
    "FLUX.1-dev 1024^2 (no true CFG)": ["tp2", "ulysses2", "ulysses4", "tp4", "ulysses8", "usp4x2"],
    "Wan2.2-A14B 480x832x17 (CFG)": [
        "cfg2",
        "ulysses2",
        "cfg2xulysses2",
        "ulysses4",
        "cfg2xulysses4",
        "ulysses8",
    ],  # fmt: skip
}


def _parse_layout(name: str) -> ParallelLayout:
    if name in LAYOUTS:
        return LAYOUTS[name]
    kw = {}
    for part in name.split("x"):
        for key, field in (("tp", "tp_size"), ("ulysses", "ulysses_degree"),
                           ("ring", "ring_degree"), ("cfg", "cfg_degree")):  # fmt: skip
            if part.startswith(key):
                kw[field] = int(part[len(key) :])
        if part.startswith("usp"):
            u, r = part[3:], name.split("x")[1]
            kw.update(ulysses_degree=int(u), ring_degree=int(r))
            break
    return ParallelLayout(**kw)


def step_bytes(m: dict, lay: ParallelLayout) -> float:
    """Bytes one rank sends per step (bf16) under ``lay`` (see docs/parallelism.md)."""
    rows = m["rows"] // (2 if lay.cfg_degree == 2 and m["cfg"] else 1)
    a = rows * m["tokens"] * m["dim"] * 2  # one block's activation over the whole sequence
    u, r, t = lay.ulysses_degree, lay.ring_degree, lay.tp_size
    local = a / (u * r)  # this SP rank's share
    per_block = 0.0
    per_block += 4 * local * (u - 1) / u  # Ulysses: q, k, v and the output, all-to-all
    per_block += 2 * (local / t) * (r - 1)  # ring: its k/v block (own heads) to the next rank
    per_block += m["ar"] * local * 2 * (t - 1) / t  # TP: ring all-reduces
    return per_block * m["blocks"]


def speedup_model(link_gbps: float) -> None:
    print(f"modelled step on one NVLink node ({link_gbps:.0f} GB/s effective per rank, no overlap)")
    print(
        f"{'model':>34} {'layout':>15} {'GPUs':>4} {'MB/rank/step':>12} {'step ms':>8} {'speed-up':>8}"
    )
    for name, m in REAL.items():
        print(f"{name:>34} {'one':>15} {1:>4} {0:>12.0f} {m['ms']:>8.1f} {1.0:>8.2f}")
        for lay_name in MODEL_LAYOUTS[name]:
            lay = _parse_layout(lay_name)
            gpus = lay.world_size
            useful = gpus if (lay.cfg_degree == 1 or m["cfg"]) else gpus // 2
            byts = step_bytes(m, lay)
            ms = m["ms"] / useful + byts / (link_gbps * 1e9) * 1e3
            print(
                f"{name:>34} {lay_name:>15} {gpus:>4} {byts / 1e6:>12.0f} {ms:>8.1f} {m['ms'] / ms:>8.2f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument(
        "--size", type=int, default=256, help="image side in pixels (tokens = (size/16)^2)"
    )
    p.add_argument("--layouts", default=",".join(k for k in LAYOUTS if k != "one"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--speedup-model", action="store_true")
    p.add_argument("--link-gbps", type=float, default=350.0)
    args = p.parse_args()
    if args.speedup_model:
        speedup_model(args.link_gbps)
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    tokens = (args.size // 16) ** 2
    print(
        f"Z-Image-shaped DiT dim {args.dim} x {args.layers} layers, {args.heads} heads, "
        f"{args.size}x{args.size} ({tokens} image tokens + captions 77/20 -> 96/32), CFG batch 2, "
        f"{args.dtype}, {backend}"
    )
    base_t, _, base_out = launch_processes(_rank_fn, 1, (args,), backend=backend)[0]
    print(
        f"{'layout':>14} {'procs':>5} {'step s':>8} {'x one':>6}  {'MiB sent / rank / step':<48} rel err"
    )
    print(f"{'one':>14} {1:>5} {base_t:8.3f} {1.0:6.2f}  {'-':<48} 0")
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        res = launch_processes(_rank_fn, layout.world_size, (args,), backend=backend, layout=layout)
        step_t = max(r[0] for r in res)
        sent = res[0][1]
        vol = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(sent.items())) or "-"
        err = max(float((r[2] - base_out).abs().max() / base_out.abs().max()) for r in res)
        print(
            f"{name:>14} {layout.world_size:>5} {step_t:8.3f} {step_t / base_t:6.2f}  "
            f"{vol:<48} {err:.1e}"
        )


if __name__ == "__main__":
    main()
