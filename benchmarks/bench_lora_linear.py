"""LoRA linear overhead: base vs unmerged (ours, peft) vs merged, on real DiT layer shapes.

For each (in, out) shape, token count, rank and number of adapters:

* ``base``: the plain layer (our ``ReplicatedLinear``, i.e. ``F.linear``);
* ``ours``: our LoRA layer unmerged (``dynamic``), N adapters fused into one pair of GEMMs;
* ``peft``: peft's LoRA ``Linear`` on an ``nn.Linear`` with the same N adapters all active
  (``set_adapter([...])``; peft runs one pair of GEMMs per adapter);
* ``merged``: our layer with the adapters merged (must cost the same as ``base``).

Printed per row: median times (ms), overhead ``t / t_base - 1`` for ours and peft, the FLOP-ratio
bound ``R * (in + out) / (in * out)`` with ``R = N * r``, ``ours_overhead / bound``, and the speedup
over peft. Goal: ours within 1.5x of the bound, never slower than peft.

Usage::

    python benchmarks/bench_lora_linear.py --quick                       # small CPU sweep
    python benchmarks/bench_lora_linear.py --device cuda --dtype bf16    # full sweep on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.lora import LoRAWeights, wrap_with_lora

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = ((3840, 3840), (3840, 10240), (10240, 3840))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(module, x, device, warmup: int, iters: int, stat: str = "median", inner: int = 1):
    """Median (or minimum) milliseconds of one ``module(x)``.

    Each sample runs ``inner`` calls back to back and synchronizes once, so on a GPU the kernels
    queue as they do inside a model's forward (per-call launch latency is not what a DiT sees).
    """
    for _ in range(warmup):
        module(x)
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            module(x)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return min(times) if stat == "min" else statistics.median(times)


def build(in_f, out_f, rank, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    adapters = [
        (
            (torch.randn(rank, in_f, generator=g) / in_f**0.5).to(dtype),
            (torch.randn(out_f, rank, generator=g) / rank**0.5).to(dtype),
            float(2 * rank) / rank,  # alpha = 2r
        )
        for _ in range(n)
    ]
    base = ReplicatedLinear(in_f, out_f, params_dtype=dtype, device=device, tp_rank=0, tp_size=1)
    base.weight_loader(base.weight, w)
    base.weight_loader(base.bias, b)
    ours = wrap_with_lora(base)
    for i, (a, bm, scale) in enumerate(adapters):
        ours.add_adapter(f"a{i}", {None: LoRAWeights(a, bm, scale)})
    ours.set_active([(f"a{i}", 1.0) for i in range(n)])

    lin = torch.nn.Linear(in_f, out_f, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank)
    peft = PeftLoraLinear(lin, "a0", cfg, r=rank, lora_alpha=2 * rank)
    for i in range(1, n):
        peft.update_layer(f"a{i}", rank, lora_alpha=2 * rank, config=cfg)
    with torch.no_grad():
        for i, (a, bm, _) in enumerate(adapters):
            peft.lora_A[f"a{i}"].weight.copy_(a)
            peft.lora_B[f"a{i}"].weight.copy_(bm)
    peft.set_adapter([f"a{i}" for i in range(n)])
    peft.to(device=device, dtype=dtype)
    return ours, peft


def case(x, in_f, out_f, tokens, rank, n, dtype, device, args) -> str:
    """Time the four variants for one configuration; returns the table row."""
    ours, peft = build(in_f, out_f, rank, n, dtype, device)
    timing = (device, args.warmup, args.iters, args.stat, args.inner)
    t_base = bench(ours.base_layer, x, *timing)
    t_ours = bench(ours, x, *timing)
    t_peft = bench(peft, x, *timing)
    ours.merge()
    t_merged = bench(ours, x, *timing)
    bound = n * rank * (in_f + out_f) / (in_f * out_f)
    o_ours, o_peft = t_ours / t_base - 1, t_peft / t_base - 1
    return (
        f"{in_f:>5}x{out_f:<6} {tokens:>5} {rank:>4} {n:>2} | {t_base:8.2f} "
        f"{t_ours:8.2f} {t_peft:8.2f} {t_merged:8.2f} | {100 * o_ours:6.1f} "
        f"{100 * o_peft:6.1f} {100 * bound:6.1f} {o_ours / bound:8.2f} "
        f"{t_peft / t_ours:7.2f}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU-sized sweep: 1024 tokens, ranks 16/64, 1/4 adapters",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--inner", type=int, default=None, help="calls per timed sample (default: 10 on cuda, 1)"
    )
    p.add_argument(
        "--stat",
        choices=("median", "min"),
        default=None,
        help="per-variant statistic (default: median; min with --quick, robust to a shared CPU)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.quick:
        args.tokens, args.ranks, args.adapters = [1024], [16, 64], [1, 4]
        args.warmup, args.iters = 1, 3
        args.stat = args.stat or "min"
    args.stat = args.stat or "median"
    args.inner = args.inner or (10 if device.type == "cuda" else 1)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"device={device} dtype={dtype} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    header = (
        f"{'in x out':>12} {'tok':>5} {'r':>4} {'N':>2} | {'base':>8} {'ours':>8} {'peft':>8} "
        f"{'merged':>8} | {'ours%':>6} {'peft%':>6} {'bound%':>6} {'ours/bnd':>8} {'vs peft':>7}"
    )
    print(header)
    print("-" * len(header))
    torch.set_grad_enabled(False)
    for in_f, out_f in SHAPES:
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f, device=device, dtype=dtype)
            for rank in args.ranks:
                for n in args.adapters:
                    print(case(x, in_f, out_f, tokens, rank, n, dtype, device, args), flush=True)
    print(
        f"times in ms ({args.stat} of {args.iters} samples x {args.inner} calls); overheads in % of base; 'vs peft' = t_peft / t_ours"
    )


if __name__ == "__main__":
    main()
