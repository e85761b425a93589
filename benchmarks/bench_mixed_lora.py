"""Cost of mixed LoRA compositions in one batch: a DiT step over B rows, with no LoRA, one shared
composition, and rows with different compositions (a ``RowMapping`` in the target's
``LoRAContext``).

The Z-Image DiT (diffusers' ``ZImageTransformer2DModel`` with random weights, loaded into ours)
gets random rank-``--rank`` adapters on every LoRA-able linear layer. Cases, each one DiT forward
over ``--batch`` rows (one denoising step of ``--batch`` requests without CFG):

* ``none``: adapters loaded, none active (the base GEMMs only);
* ``shared``: every row uses adapter ``a0``, the layers' global composition (unmerged: one
  delta over the whole batch);
* ``mixed``: rows cycle through ``--compositions`` different compositions (``a0``; ``a1``;
  ``a2``; ``a0 + a1``; ...; the fifth is "no LoRA"), all in the same forward: each layer computes
  each group of rows on its own (base GEMM plus that group's delta).

Reported: the median over ``--repeats`` interleaved runs of each case and the ratios against
``none`` (the goal for 4 compositions is <= 1.15x).

Usage::

    python benchmarks/bench_mixed_lora.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--dim 768 --layers 8 --heads 12 --size 256] [--batch 8] [--rank 16] [--compositions 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args, device, dtype):
    from diffusers import ZImageTransformer2DModel
    from sglang.multimodal_gen.layers.lora import LoRAWeights
    from sglang.multimodal_gen.lora.compose import wrap_layers
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family

    hd = args.dim // args.heads
    torch.manual_seed(0)
    ref = ZImageTransformer2DModel(
        dim=args.dim, n_layers=args.layers, n_refiner_layers=1, n_heads=args.heads,
        n_kv_heads=args.heads, cap_feat_dim=256, axes_dims=[hd // 4, 3 * hd // 8, 3 * hd // 8],
        axes_lens=[1024, 512, 512],
    )  # fmt: skip
    model = denoiser_from_module(ref, get_family("zimage").denoiser(), dtype, device)
    layers, ctx = wrap_layers("transformer", model)
    g = torch.Generator().manual_seed(1)
    for layer in layers.values():
        out_f, in_f = layer.base_layer.weight.shape
        for i in range(3):
            a = torch.randn(args.rank, in_f, generator=g) / in_f**0.5
            b = torch.randn(out_f, args.rank, generator=g) * 0.01
            w = LoRAWeights(a.to(dtype), b.to(dtype), 1.0)
            layer.add_adapter(f"a{i}", {None: w}, slot=i)  # slot i on every layer
    return model, layers, ctx


COMPOSITIONS = [
    [("a0", 1.0)],
    [("a1", 0.8)],
    [("a2", 1.2)],
    [("a0", 0.5), ("a1", 0.5)],
    [],
    [("a1", 0.3), ("a2", 0.9)],
    [("a0", -0.4)],
    [("a0", 0.2), ("a1", 0.2), ("a2", 0.2)],
]


def main(argv=None) -> int:
    from sglang.multimodal_gen.layers.lora import Composition, RowMapping

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--size", type=int, default=256, help="image side (px); latent = size / 8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--compositions", type=int, default=4, choices=range(2, 9))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, layers, lora_ctx = build(args, device, dtype)
    g = torch.Generator().manual_seed(2)
    lat = args.size // 8
    x = torch.randn(args.batch, 16, 1, lat, lat, generator=g).to(device, dtype)
    t = torch.full((args.batch,), 0.6, device=device)
    caps = [torch.randn(32, 256, generator=g).to(device, dtype) for _ in range(args.batch)]

    def slots(comp):  # adapter "a<i>" is in slot i on every layer
        return Composition((int(n[1:]), s) for n, s in comp)

    mixed = RowMapping.of([slots(COMPOSITIONS[i % args.compositions]) for i in range(args.batch)])

    def step(case):
        for layer in layers.values():
            layer.set_active(slots([("a0", 1.0)]) if case == "shared" else Composition.EMPTY)
        with torch.no_grad(), lora_ctx.rows(mixed if case == "mixed" else None):
            ctx = model.encode_captions(caps)
            model(x=x, t=t, cap=ctx)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    cases = ("none", "shared", "mixed")
    times: dict[str, list[float]] = {c: [] for c in cases}
    for c in cases:
        step(c)  # warm-up
    for r in range(args.repeats):
        for c in cases if r % 2 == 0 else reversed(cases):
            t0 = time.perf_counter()
            step(c)
            times[c].append(time.perf_counter() - t0)
    med = {c: statistics.median(v) for c, v in times.items()}
    print(
        f"Z-Image DiT dim {args.dim} x {args.layers} layers, {args.size}px, batch {args.batch}, "
        f"rank {args.rank}, {args.dtype} on {args.device}, {len(layers)} LoRA layers"
    )
    for c in cases:
        print(f"  {c:7s} {med[c] * 1e3:9.1f} ms/step   {med[c] / med['none']:.3f}x none")
    print(
        f"  mixed ({args.compositions} compositions) / shared: {med['mixed'] / med['shared']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
