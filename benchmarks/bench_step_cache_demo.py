"""Step caching on the embedded demo model (the default model of ``sglang generate``), CPU:
image change, scene scores and wall time of each ``--cache-method`` preset and a few knob
settings against the same requests uncached.

Per setting, over ``--prompts`` demo captions (``demo_scenes.random_scenes(N, seed=7)``, seed =
the prompt's index, the model's own 64x64, ``--steps`` steps):

- steps computed / skipped per request (the ``step_cache`` counts ``sglang generate`` prints;
  ``a-b`` when the requests differ) and the share of DiT blocks skipped;
- PSNR of each image against the uncached one (min and mean over the prompts);
- the scene reader's scores (``demo_scenes.accuracy``, as ``test/integration/demo/`` scores
  pictures: colour, shape, position against the prompt's scene), in points, cached and the
  uncached ones they are compared with;
- wall time of the in-process engine call (``DiffusionEngine.generate``, one request per prompt,
  the request's ``cache`` field), the prompts' total per repeat; settings interleaved (each
  repeat runs every setting in turn, the order rotated), median over ``--repeats``, and its
  ratio to the uncached median.

Targets (the ``meets`` column): PSNR >= 30 dB on every prompt (P), every scene score within 5
points of the uncached one (S), wall time <= 0.75x uncached (T). The method presets are those of
every implemented method (``IMPLEMENTED_CACHE_METHODS``); a setting the engine refuses (its
request fails, e.g. a method that needs a calibration the model lacks) gets a row saying so.

``--cli-repeats N`` also times whole ``sglang generate`` runs (a process each, the first prompt)
for ``none`` and the method presets, interleaved, median of N.

Usage::

    python benchmarks/bench_step_cache_demo.py [--repeats 5] [--prompts 8] [--steps 28]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from sglang.multimodal_gen.layers.step_cache import IMPLEMENTED_CACHE_METHODS
from sglang.multimodal_gen.models import demo_scenes as ds
from sglang.multimodal_gen.runtime import DiffusionEngine

# (method, knobs): every implemented method's preset first, then the reference libraries'
# defaults (diffusers' FirstBlockCacheConfig and TaylorSeerCacheConfig, cache-dit's DBCache
# with its Fn scaled to the model) and a few knob settings around the presets
SETTINGS: list[tuple[str, dict]] = [("none", {})] + [
    (m, {}) for m in IMPLEMENTED_CACHE_METHODS if m != "none"
]
SETTINGS += [
    ("fbcache", dict(threshold=0.05, max_continuous_cached_steps=-1)),  # diffusers' default
    ("dbcache", dict(threshold=0.08, warmup=8, max_continuous_cached_steps=-1)),  # cache-dit's
    ("taylorseer", dict(warmup=3, interval=5, order=1)),  # diffusers' default
    ("fbcache", dict(threshold=0.3, max_continuous_cached_steps=-1)),  # the preset, no limit
    ("taylorseer", dict(order=0)),
]
FIELDS = ("color", "shape", "position")
FLAG = dict(threshold="--cache-threshold", fn="--cache-fn", bn="--cache-bn",
            warmup="--cache-warmup", interval="--cache-interval", order="--cache-order",
            max_cached_steps="--cache-max-cached-steps",
            max_continuous_cached_steps="--cache-max-continuous-cached-steps")  # fmt: skip


def psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def cache_value(method: str, knobs: dict):
    return dict(method=method, **knobs) if knobs else method


def run_setting(engine, scenes, steps, method, knobs):
    """``(seconds for all prompts, images, step_cache infos)``; raises what the engine refuses."""
    images, infos = [], []
    t0 = time.perf_counter()
    for i, s in enumerate(scenes):
        out = engine.generate(prompt=s.caption, seed=i, num_inference_steps=steps,
                              cache=cache_value(method, knobs), progress=False)  # fmt: skip
        images.append(out[0])
        infos.append(getattr(out[0], "info", {}).get("step_cache"))
    return time.perf_counter() - t0, images, infos


def cli_times(scene, steps, repeats, methods) -> dict[str, float]:
    """Median wall seconds of ``sglang generate`` (a fresh process each run) per method."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
                argv = [sys.executable, "-m", "sglang.cli.main", "generate", "--prompt",
                        scene.caption, "--seed", "0", "--num-inference-steps", str(steps),
                        "--cache-method", m, "--no-progress", "--output-path", f"{tmp}/{m}.png"]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True)
                times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def counts(infos, steps) -> tuple[str, str]:
    if infos[0] is None:
        return f"{steps} / 0", "0 %"
    done = [s["steps_computed"] for s in infos]
    skip = [s["steps_skipped"] for s in infos]
    span = lambda v: str(v[0]) if min(v) == max(v) else f"{min(v)}-{max(v)}"  # noqa: E731
    bc = sum(s["blocks_computed"] for s in infos)
    bs = sum(s["blocks_skipped"] for s in infos)
    return f"{span(done)} / {span(skip)}", f"{100 * bs / (bc + bs):.0f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed passes (median), >= 1")
    ap.add_argument("--prompts", type=int, default=8, help="demo captions per setting")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--cli-repeats", type=int, default=0,
                    help="also time whole `sglang generate` runs, N each (0: off)")  # fmt: skip
    args = ap.parse_args()
    scenes = ds.random_scenes(args.prompts, seed=7)
    names = [(m, k) for m, k in SETTINGS]
    times: dict[int, list[float]] = {i: [] for i in range(len(names))}
    images: dict[int, list] = {}
    infos: dict[int, list] = {}
    refused: dict[int, str] = {}
    with DiffusionEngine(device="cpu") as engine:  # no model path: the embedded demo model
        run_setting(engine, scenes[:1], args.steps, "none", {})  # warm-up
        for r in range(args.repeats):
            order = list(range(len(names)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                if i in refused:
                    continue
                try:
                    dt, imgs, inf = run_setting(engine, scenes, args.steps, *names[i])
                except Exception as e:  # noqa: BLE001 - a setting the engine refuses
                    refused[i] = f"{type(e).__name__}: {str(e).split(';')[0]}"
                    continue
                times[i].append(dt)
                if i not in images:
                    images[i], infos[i] = imgs, inf
                    if 0 in images:  # progress (stderr): this setting's change, as it lands
                        p = [psnr(a, b) for a, b in zip(imgs, images[0])]
                        print(f"{names[i]}: {counts(inf, args.steps)}, PSNR min {min(p):.1f}, "
                              f"{dt:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
                else:  # every pass draws the same pixels: quality from any pass
                    assert all(psnr(a, b) == float("inf") for a, b in zip(imgs, images[i]))
    base_t = statistics.median(times[0])
    base_acc = ds.accuracy(images[0], scenes)
    print(f"demo model, {args.prompts} prompts, {args.steps} steps, 64x64, CPU; wall: median of "
          f"{args.repeats} interleaved passes over the prompts (in-process engine)")  # fmt: skip
    print("| method | knobs | steps computed / skipped | blocks skipped | PSNR min / mean (dB) "
          "| colour | shape | position | wall (s) | vs none | meets |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (method, knobs) in enumerate(names):
        knob = ", ".join(f"{FLAG[k]} {v}" for k, v in knobs.items()) or "preset"
        if method == "none":
            knob = ""
        if i in refused:
            print(f"| `{method}` | {knob} | not run: {refused[i]} |||||||||")
            continue
        cs, frac = counts(infos[i], args.steps)
        p = [psnr(a, b) for a, b in zip(images[i], images[0])]
        acc = ds.accuracy(images[i], scenes)
        t = statistics.median(times[i])
        score = " | ".join(
            f"{100 * acc[f]:.0f}" if i == 0 else f"{100 * acc[f]:.0f} ({100 * base_acc[f]:.0f})"
            for f in FIELDS
        )
        meets = ""
        if i:
            ok = dict(P=min(p) >= 30, S=all(abs(acc[f] - base_acc[f]) <= 0.05 for f in FIELDS),
                      T=t / base_t <= 0.75)  # fmt: skip
            meets = "".join(k for k, v in ok.items() if v) or "-"
        ps = "inf" if i == 0 else f"{min(p):.1f} / {np.mean(p):.1f}"
        print(f"| `{method}` | {knob} | {cs} | {frac} | {ps} | {score} | {t:.3f} | "
              f"{t / base_t:.2f}x | {meets} |")  # fmt: skip
    if args.cli_repeats:
        methods = ["none"] + [
            m for j, (m, k) in enumerate(names[1:], 1) if not k and j not in refused
        ]
        ct = cli_times(scenes[0], args.steps, args.cli_repeats, methods)
        print(f"\n`sglang generate` (one process per run, median of {args.cli_repeats}):")
        for m in methods:
            print(f"- `{m}`: {ct[m]:.2f} s ({ct[m] / ct['none']:.2f}x)")


if __name__ == "__main__":
    main()
