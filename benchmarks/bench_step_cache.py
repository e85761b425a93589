"""Step caching on the tiny Flux.1 [dev] and Z-Image models: steps and blocks skipped and the
image change (PSNR against the uncached image) per cache setting (no timings: the tiny models'
DiT calls are too short for the block savings to show in them).

The tiny models have random weights, so their trajectories (and the head-residual ratios the
thresholds act on) are not those of trained models: the numbers show what each knob does, not
which threshold suits a real checkpoint. Both models are built with more blocks than the test
models (Flux 2 dual + 6 single blocks, Z-Image 8 layers) so that DBCache's ``Fn``/``Bn`` have
room.

Usage::

    python benchmarks/bench_step_cache.py [--steps 16] [--size 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.models.families.tiny.flux import TINY_TRANSFORMER, build_flux_dir
from sglang.multimodal_gen.models.families.tiny.zimage import (
    DEFAULT_TRANSFORMER,
    build_zimage_dir,
)
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

TAYLORSEER = [
    ("taylorseer", {}),  # diffusers' defaults: warmup 3, interval 5, order 1, residual
    ("taylorseer", dict(interval=3)),
    ("taylorseer", dict(order=2)),
    ("taylorseer", dict(order=0)),
    ("taylorseer", dict(target="output")),
    ("taylorseer", dict(fn=1, bn=1)),
]
SETTINGS = {
    "flux": [
        ("none", {}),
        ("fbcache", dict(threshold=0.3)),
        ("fbcache", dict(threshold=0.5)),
        ("fbcache", dict(threshold=0.8)),
        ("dbcache", dict(threshold=0.5, fn=2, bn=2, warmup=2)),
        *TAYLORSEER,
    ],
    "zimage": [
        ("none", {}),
        ("fbcache", dict(threshold=0.6)),
        ("fbcache", dict(threshold=0.8)),
        ("fbcache", dict(threshold=1.0)),
        ("dbcache", dict(threshold=1.0, fn=2, bn=2, warmup=2)),
        *TAYLORSEER,
    ],
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def run(pipe, kw):
    """``(pixels, the request's cache summary)``."""
    gens = []
    new_generation = pipe.new_generation
    pipe.new_generation = lambda *a, **k: gens.append(new_generation(*a, **k)) or gens[-1]
    try:
        out = pipe("a small red fox in the snow", generator=torch.Generator().manual_seed(42),
                   output_type="np", **kw)  # fmt: skip
    finally:
        del pipe.new_generation
    return np.asarray(out), gens[-1].cache.summary() if gens[-1].cache else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="bench_step_cache_")
    pipes = {
        "flux": FluxPipeline.from_pretrained(build_flux_dir(
            os.path.join(root, "flux"), transformer=dict(TINY_TRANSFORMER, num_layers=2, num_single_layers=6))),
        "zimage": ZImagePipeline.from_pretrained(build_zimage_dir(
            os.path.join(root, "zimage"), transformer=dict(DEFAULT_TRANSFORMER, n_layers=8))),
    }  # fmt: skip
    kws = {
        "flux": dict(guidance_scale=3.5),
        "zimage": dict(guidance_scale=3.5, negative_prompt="blurry"),
    }
    print("| model | method | knobs | steps computed / skipped | blocks skipped | PSNR dB |")
    print("|---|---|---|---|---|---:|")
    for name, pipe in pipes.items():
        kw = dict(kws[name], height=args.size, width=args.size, num_inference_steps=args.steps)
        base = None
        for method, knobs in SETTINGS[name]:
            pipe.enable_step_cache(StepCacheConfig.of(method, **knobs))
            px, s = run(pipe, kw)
            base = px if base is None else base
            if s is None:
                cs, frac = f"{args.steps} / 0", "0 %"
            else:
                cs = f"{s['steps_computed']} / {s['steps_skipped']}"
                total = s["blocks_computed"] + s["blocks_skipped"]
                frac = f"{100 * s['blocks_skipped'] / total:.0f} %"
            knob = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "-"
            print(f"| {name} | {method} | {knob} | {cs} | {frac} | {psnr(px, base):.1f} |")


if __name__ == "__main__":
    main()
