"""Adapter switching cost: our LoRAManager vs diffusers' LoRA API on the same model and files.

Model: a Z-Image transformer with the real Z-Image-Turbo layer shapes (dim 3840, 30 heads, FFN
10240) and ``--blocks`` main blocks (no refiner blocks), random weights, built once in diffusers
(``ZImageTransformer2DModel``) and copied into ours (``zimage_from_diffusers_module``). Two LoRA
files in diffusers format (rank ``--rank`` on to_q/k/v, to_out.0, w1/w2/w3 of every block). Every
cost below is per block times the number of blocks, so the full model (30 blocks) is
``per-block x 30`` (the table prints per-block times).

Timed operations (median of ``--repeats``):

=====================  ==============================================  ============================
operation              ours (merge mode)                               diffusers
=====================  ==============================================  ============================
cold set               ``set_lora("a", path)``: read+convert+merge     ``load_lora_weights`` +
                                                                       ``fuse_lora``
load only              ``load_adapter("b", path)``                     ``load_lora_weights``
warm switch            ``set_lora("b")``, merge cache cleared           ``unfuse_lora`` +
                                                                       ``set_adapters`` + ``fuse_lora``
cache hit              ``set_lora("a")`` after it was merged once       (same as warm switch)
per-request selection  ``selection([b])`` on the merged target (the    switch to b and back
                       rows then run b in the forward: nothing merged)  (two warm switches)
set, unchanged file    ``set_lora("a", path)`` again (stat, no read)    ``load_lora_weights`` +
                                                                       ``fuse_lora`` again
unset                  ``unset_lora()`` (snapshot swapped back)         ``unfuse_lora`` +
                                                                       ``disable_lora``
=====================  ==============================================  ============================

Memory: our manager's own report (``LoRAManager.memory_report``): the snapshot kept while merged
(compared with the bytes of the adapter-affected weights), the merge cache, and the peak fp32
merge workspace. A correctness check compares one merged weight of both sides.

Usage::

    python benchmarks/bench_lora_switch.py --blocks 2              # CPU, about 3 GB of RAM
    python benchmarks/bench_lora_switch.py --blocks 30 --device cuda
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def median_of(fn, device, repeats, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        times.append(timed(fn, device))
    return statistics.median(times)


def write_lora(path, model, rank, seed, dtype):
    """A diffusers-format LoRA file on every attention/FFN linear of ``model``'s main blocks."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not name.startswith("layers."):
            continue
        if not any(s in name for s in ("attention.to_", "feed_forward.w")):
            continue
        a = torch.randn(rank, mod.in_features, generator=g) / mod.in_features**0.5
        b = torch.randn(mod.out_features, rank, generator=g) * 0.01
        sd[f"transformer.{name}.lora_A.weight"] = a.to(dtype)
        sd[f"transformer.{name}.lora_B.weight"] = b.to(dtype)
    save_file(sd, path)
    return len(sd) // 2


def run_ours(ours, paths, tmp, args, device):
    """Time our manager; returns (rows, merged to_q of block 0, unset bit-exact?, memory, stats)."""
    from sglang.multimodal_gen.layers.lora import workspace_stats
    from sglang.multimodal_gen.lora.manager import LoRAManager
    from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP

    rows = {}
    mgr = LoRAManager(
        {"transformer": ours},
        ZIMAGE_NAME_MAP,
        allowed_roots=[tmp],
        merge_cache_bytes=int(args.merge_cache_gb * 2**30),
    )
    base_bits = {k: v.clone() for k, v in ours.state_dict().items() if k.endswith("weight")}
    workspace_stats(reset_peak=True)
    rows["cold set (load + merge)"] = timed(lambda: mgr.set_lora("a", paths["a"]), device)
    memory = mgr.memory_report()
    rows["load only"] = timed(lambda: mgr.load_adapter("b", paths["b"]), device)
    mgr.set_lora("a")
    rows["warm switch (merge)"] = median_of(
        lambda: mgr.set_lora("b"), device, args.repeats, before=_prep(mgr, "a")
    )
    # cache hit: both compositions merged once -> switching swaps storage
    mgr.set_lora("a")
    mgr.set_lora("b")
    rows["cache hit (switch back)"] = median_of(
        lambda: mgr.set_lora("a"), device, args.repeats, before=lambda: mgr.set_lora("b")
    )

    rows["per-request selection"] = median_of(
        lambda: mgr.selection([("b", 1.0)]), device, args.repeats
    )
    rows["set, unchanged file"] = median_of(
        lambda: mgr.set_lora("a", paths["a"]), device, args.repeats
    )
    rows["unset"] = median_of(
        lambda: mgr.unset_lora(), device, args.repeats, before=lambda: mgr.set_lora("a")
    )
    unchanged = all(torch.equal(ours.state_dict()[k], v) for k, v in base_bits.items())
    stats = mgr.cache.stats()
    mgr.set_lora("a", merge_mode="merge")
    qkv = ours.state_dict()["layers.0.attention.to_qkv.base_layer.weight"]
    ours_w = qkv[: args.dim].float().clone()
    mgr.unset_lora()
    memory["workspace_peak_bytes"] = workspace_stats()["peak"]
    return rows, ours_w, unchanged, memory, stats


def run_diffusers(ref, paths, args, device, rows):
    """Time diffusers' LoRA API on ``ref``; appends to ``rows``; returns merged to_q of block 0."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=ref
    )
    rows["cold set (load + merge)"].append(
        timed(
            lambda: (
                pipe.load_lora_weights(paths["a"], adapter_name="a"),
                pipe.fuse_lora(adapter_names=["a"]),
            ),
            device,
        )
    )
    ref_w = ref.layers[0].attention.to_q.base_layer.weight.float().clone()
    rows["load only"].append(
        timed(lambda: pipe.load_lora_weights(paths["b"], adapter_name="b"), device)
    )

    def d_switch(to):
        pipe.unfuse_lora()
        pipe.set_adapters([to])
        pipe.fuse_lora(adapter_names=[to])

    rows["warm switch (merge)"].append(
        median_of(lambda: d_switch("b"), device, args.repeats, before=lambda: d_switch("a"))
    )
    rows["cache hit (switch back)"].append(
        median_of(lambda: d_switch("a"), device, args.repeats, before=lambda: d_switch("b"))
    )
    rows["per-request selection"].append(
        median_of(lambda: (d_switch("b"), d_switch("a")), device, args.repeats)
    )

    def d_reload():
        pipe.unfuse_lora()
        pipe.delete_adapters("a")
        pipe.load_lora_weights(paths["a"], adapter_name="a")
        pipe.set_adapters(["a"])
        pipe.fuse_lora(adapter_names=["a"])

    rows["set, unchanged file"].append(median_of(d_reload, device, args.repeats))

    def d_unset():
        pipe.unfuse_lora()
        pipe.disable_lora()

    def d_prep():
        pipe.enable_lora()
        d_switch("a")

    rows["unset"].append(median_of(d_unset, device, args.repeats, before=d_prep))
    return ref_w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--dim", type=int, default=3840)
    p.add_argument("--heads", type=int, default=30)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    p.add_argument("--merge-cache-gb", type=float, default=4.0, help="our merge cache bound")
    p.add_argument("--skip-diffusers", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    torch.set_grad_enabled(False)

    from diffusers import ZImageTransformer2DModel
    from sglang.multimodal_gen.models.families.zimage import zimage_from_diffusers_module

    head_dim = args.dim // args.heads
    axes = [head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8]
    t0 = time.perf_counter()
    ref = ZImageTransformer2DModel(
        dim=args.dim,
        n_layers=args.blocks,
        n_refiner_layers=0,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        axes_dims=axes,
    ).to(device=device, dtype=dtype)
    ours = zimage_from_diffusers_module(ref, dtype=dtype, device=device)
    n_params = sum(p.numel() for p in ref.parameters())
    ffn = ref.layers[0].feed_forward.w1.out_features
    print(
        f"model: {args.blocks} blocks of dim {args.dim}, {args.heads} heads, FFN {ffn}, "
        f"{n_params / 1e9:.2f} B params ({n_params * ref.dtype.itemsize / 2**30:.2f} GiB), "
        f"{dtype}, {device}; built in {time.perf_counter() - t0:.1f} s; LoRA rank {args.rank}"
    )
    tmp = tempfile.mkdtemp(prefix="bench_lora_switch_")
    paths = {}
    for i, name in enumerate(("a", "b")):
        paths[name] = os.path.join(tmp, f"{name}.safetensors")
        n_mod = write_lora(paths[name], ref, args.rank, i, dtype)
    size = os.path.getsize(paths["a"]) / 2**20
    print(f"LoRA files: {n_mod} modules, {size:.1f} MiB each")
    ours_times, ours_w, unchanged, memory, stats = run_ours(ours, paths, tmp, args, device)
    del ours
    gc.collect()
    rows = {k: [v] for k, v in ours_times.items()}
    if not args.skip_diffusers:
        ref_w = run_diffusers(ref, paths, args, device, rows)
        diff = (ours_w - ref_w).abs().max().item()
        print(f"merged layers.0 to_q: max |ours - diffusers| = {diff:.3g} ({dtype})")

    gib = 2**30
    affected = memory["affected_weight_bytes"]
    print(f"weights bit-identical to the start after unset: {unchanged}; merge cache: {stats}")
    print(
        f"memory after the cold set: snapshot {memory['snapshot_bytes'] / gib:.2f} GiB = "
        f"{memory['snapshot_bytes'] / affected:.2f}x the adapter-affected weights "
        f"({affected / gib:.2f} GiB); merge cache {memory['merge_cache_bytes'] / gib:.2f} GiB "
        f"(shares storage with the merged weights); peak fp32 workspace "
        f"{memory['workspace_peak_bytes'] / 2**20:.0f} MiB"
    )
    print()
    n = args.blocks
    print(f"| operation | ours ms/block | diffusers ms/block | speedup | ours ms ({n} blocks) |")
    print("|---|---:|---:|---:|---:|")
    for name, vals in rows.items():
        d = f"{vals[1] / n:.1f} | {vals[1] / vals[0]:.1f}x" if len(vals) > 1 else "- | -"
        print(f"| {name} | {vals[0] / n:.1f} | {d} | {vals[0]:.1f} |")


def _prep(mgr, name):
    def before():
        mgr.set_lora(name)
        mgr.cache.clear()

    return before


if __name__ == "__main__":
    main()
