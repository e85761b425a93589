"""Step caching on the tiny Flux.1 [dev] and Z-Image models, ours against diffusers' hooks.

For each method diffusers has a hook for on these models, the same request runs in one process
through diffusers' pipeline with the hook and through ours with the matched setting, each with its
own uncached run:

* ``fbcache`` = diffusers' ``FirstBlockCacheConfig(threshold)`` (Flux: ``transformer.
  enable_cache``; Z-Image, whose diffusers model has no ``enable_cache`` and whose blocks call
  their hidden states ``x``: the hook applied directly, the name mapped, as
  ``test/integration/caching/test_fbcache_parity.py`` does);
* ``taylorseer`` with ``target=output``, ``Fn = Bn = 0`` = diffusers' ``TaylorSeerCacheConfig``
  (``cache_interval``, ``disable_cache_before_step``, ``max_order``, fp32 factors) with
  ``cache_identifiers`` naming every transformer block (Flux: ``transformer_blocks.<i>``,
  ``single_transformer_blocks.<i>``; Z-Image: its main ``layers.<i>``), the computation the two
  share; our default ``residual`` target runs too (ours only);
* ``magcache`` = diffusers' ``MagCacheConfig(threshold, mag_ratios, num_inference_steps)``
  (other knobs at the defaults both share: ``max_skip_steps=3``, ``retention_ratio=0.2``), the
  ratios measured once per model by our calibration mode (``magcache`` with ``calibrate=True``,
  the uncached request's ratios, untimed) and handed to both sides: ours as a ratios file
  (``mag_ratios``), diffusers' as the list;
* ``teacache`` (no diffusers hook): ours only, the family's preset and one threshold.

Reported per setting: steps computed / skipped (ours: the request's counts; diffusers: counted
from its hook's decisions), wall time of the pipeline call against the same side's uncached call
(median of ``--repeats`` interleaved passes), PSNR of each side against its own uncached image,
and ours against diffusers' (cached). The tiny models have random weights, so their trajectories
(and the head-residual ratios the thresholds act on) are not those of trained models: the
thresholds here are the ones that skip some steps on them, not advice for a real checkpoint.
Both models are built with more blocks than the test models (Flux 2 dual + 6 single blocks,
Z-Image 8 layers).

Usage::

    python benchmarks/bench_step_cache.py [--steps 16] [--size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.mag_ratios import MagRatios
from sglang.multimodal_gen.models.families.tiny.flux import TINY_TRANSFORMER, build_flux_dir
from sglang.multimodal_gen.models.families.tiny.zimage import (
    DEFAULT_TRANSFORMER,
    build_zimage_dir,
)
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

PROMPT = "a small red fox in the snow"
TAYLOR = dict(warmup=2, interval=3, order=1)  # diffusers' defaults are 3 / 5 / 1
#: model -> [(method, our knobs, diffusers' config or None: ours only)]
NO_LIMIT = dict(max_continuous_cached_steps=-1)  # diffusers' FBCache has no step limit
SETTINGS = {
    "flux": [("fbcache", dict(threshold=t, **NO_LIMIT)) for t in (0.3, 0.5)],
    "zimage": [("fbcache", dict(threshold=t, **NO_LIMIT)) for t in (0.8, 1.0)],
}
#: model -> MagCache thresholds (the ratios file is added once calibrated: ``calibrate``), chosen
#: on the ratios of 16 steps at 64x64 (other step counts and sizes measure other ratios): every
#: accumulated error is at least 0.002 from them; 0.06 is diffusers' default
MAG_THRESHOLDS = {"flux": (0.06, 0.2), "zimage": (0.04, 0.2)}  # 0.2: our preset
for _name in SETTINGS:
    SETTINGS[_name] += [
        ("taylorseer", dict(TAYLOR, target="output")),
        ("taylorseer", dict(warmup=3, interval=5, order=1, target="output")),
        ("taylorseer", dict(TAYLOR)),  # our default residual target: ours only
        *(("magcache", dict(threshold=t)) for t in MAG_THRESHOLDS[_name]),
        ("teacache", {}),  # no diffusers hook: ours only (the family's threshold)
        ("teacache", dict(threshold=0.4)),
    ]
BLOCKS = {  # diffusers' names of the blocks our sequence spans
    "flux": [r"transformer_blocks\.\d+", r"single_transformer_blocks\.\d+"],
    "zimage": [r"layers\.\d+"],
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def _first_image(x) -> np.ndarray:
    """uint8 ``[H, W, 3]``: the first image of a pipeline's ``np`` output."""
    x = np.asarray(x)
    if x.dtype != np.uint8:
        x = (x * 255).round().astype(np.uint8)
    return x.reshape(-1, *x.shape[-3:])[0]


def ours(pipe, kw, method, knobs):
    """``(seconds, pixels, (computed, skipped))`` of our pipeline with the setting."""
    pipe.enable_step_cache(StepCacheConfig.of(method, **knobs) if method != "none" else None)
    gens = []
    new_generation = pipe.new_generation
    pipe.new_generation = lambda *a, **k: gens.append(new_generation(*a, **k)) or gens[-1]
    try:
        t0 = time.perf_counter()
        out = pipe(PROMPT, generator=torch.Generator().manual_seed(42), output_type="np", **kw)
        dt = time.perf_counter() - t0
    finally:
        del pipe.new_generation
    s = gens[-1].cache.summary() if gens[-1].cache else None
    counts = (s["steps_computed"], s["steps_skipped"]) if s else (kw["num_inference_steps"], 0)
    return dt, _first_image(out), counts


def calibrate(pipe, kw, path: str) -> list[float]:
    """Our calibration run of ``pipe`` (``magcache`` with ``calibrate=True``: every step
    computed) on the benchmark's request; its ratios are saved to ``path`` (the file ``magcache``
    reads) and returned (one per step: the models have one state, Flux ``blocks/0/cond``,
    Z-Image's batched CFG ``blocks/0/joint``).

    Raises:
        RuntimeError: the summary holds no ratios or more than one list.
    """
    pipe.enable_step_cache(StepCacheConfig.of("magcache", calibrate=True))
    gens = []
    new_generation = pipe.new_generation
    pipe.new_generation = lambda *a, **k: gens.append(new_generation(*a, **k)) or gens[-1]
    try:
        pipe(PROMPT, generator=torch.Generator().manual_seed(42), output_type="np", **kw)
    finally:
        del pipe.new_generation
    measured = gens[-1].cache.summary().get("mag_ratios") or {}
    if len(measured) != 1:
        raise RuntimeError(f"calibration: expected one list of ratios, got {list(measured)}")
    [(key, ratios)] = measured.items()
    MagRatios(kw["num_inference_steps"], {key: tuple(ratios)}).save(path)
    return list(ratios)


def _zimage_block_names() -> None:
    """diffusers 0.42.1's block hooks fetch ``hidden_states``; Z-Image's blocks call it ``x``
    (argument 0): register that mapping once."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    meta = TransformerBlockMetadata(return_hidden_states_index=0)
    meta._cached_parameter_indices = {"hidden_states": 0}
    TransformerBlockRegistry.register(ZImageTransformerBlock, meta)


def diffusers_pipe(name, model_dir, method, knobs):
    """diffusers' pipeline on ``model_dir`` with the hook matching ``(method, knobs)`` (fresh
    states) and a list the hook's decisions are appended to (True: computed)."""
    import diffusers
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    cls = diffusers.FluxPipeline if name == "flux" else diffusers.ZImagePipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    t = pipe.transformer
    if method == "fbcache":
        config = FirstBlockCacheConfig(threshold=knobs["threshold"])
    elif method == "taylorseer":
        config = TaylorSeerCacheConfig(
            cache_interval=knobs["interval"], disable_cache_before_step=knobs["warmup"],
            max_order=knobs["order"], taylor_factors_dtype=torch.float32,
            cache_identifiers=BLOCKS[name],
        )  # fmt: skip
    elif method == "magcache":
        with open(knobs["mag_ratios"]) as f:
            saved = json.load(f)
        [ratios] = saved["ratios"].values()
        config = MagCacheConfig(threshold=knobs["threshold"], mag_ratios=ratios,
                                num_inference_steps=saved["num_inference_steps"])  # fmt: skip
    else:
        return pipe
    if name == "flux":
        t.enable_cache(config)
    else:  # no enable_cache / cache_context on diffusers' Z-Image model: one context per call
        from diffusers.hooks import (
            apply_first_block_cache,
            apply_mag_cache,
            apply_taylorseer_cache,
        )

        apply = {"fbcache": apply_first_block_cache, "taylorseer": apply_taylorseer_cache,
                 "magcache": apply_mag_cache}[method]  # fmt: skip
        apply(t, config)
        _set_cache_context(t, CacheContext("cond"))
    return pipe


def _decision_spy():
    """Record diffusers' FBCache, TaylorSeer and MagCache decisions (the first hooked block's,
    per call)."""
    import diffusers.hooks.first_block_cache as fbc
    import diffusers.hooks.mag_cache as mc
    import diffusers.hooks.taylorseer_cache as tsc

    seen: list[tuple[int, bool]] = []
    fb = fbc.FBCHeadBlockHook._should_compute_remaining_blocks
    ts = tsc.TaylorSeerCacheHook._measure_should_compute
    mag = mc.MagCacheHeadHook.new_forward

    def fb_spy(self, residual):
        out = fb(self, residual)
        seen.append((id(self), bool(out)))
        return out

    def ts_spy(self):
        out = ts(self)
        seen.append((id(self), bool(out[0])))
        return out

    def mag_spy(self, module, *args, **kwargs):
        out = mag(self, module, *args, **kwargs)
        seen.append((id(self), bool(self.state_manager.get_state().should_compute)))
        return out

    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = fb_spy
    mc.MagCacheHeadHook.new_forward = mag_spy
    tsc.TaylorSeerCacheHook._measure_should_compute = ts_spy
    return seen


def theirs(pipe, kw, seen):
    """``(seconds, pixels, (computed, skipped))`` of diffusers' pipeline (counts from the first
    hook that decided)."""
    seen.clear()
    t0 = time.perf_counter()
    out = pipe(PROMPT, generator=torch.Generator().manual_seed(42), output_type="np", **kw)
    dt = time.perf_counter() - t0
    first = [d for h, d in seen if h == seen[0][0]] if seen else []
    counts = (sum(first), len(first) - sum(first)) if first else (kw["num_inference_steps"], 0)
    return dt, _first_image(out.images), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median), >= 1")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="bench_step_cache_")
    dirs = {
        "flux": build_flux_dir(os.path.join(root, "flux"),
                               transformer=dict(TINY_TRANSFORMER, num_layers=2, num_single_layers=6)),
        "zimage": build_zimage_dir(os.path.join(root, "zimage"),
                                   transformer=dict(DEFAULT_TRANSFORMER, n_layers=8)),
    }  # fmt: skip
    kws = {
        "flux": dict(guidance_scale=3.5),
        "zimage": dict(guidance_scale=3.5, negative_prompt="blurry"),
    }
    _zimage_block_names()
    seen = _decision_spy()
    print(f"tiny models, {args.size}x{args.size}, {args.steps} steps, fp32, CPU; wall: median of "
          f"{args.repeats} interleaved passes")  # fmt: skip
    print("| model | method | knobs | steps computed / skipped: ours, diffusers | speed-up: ours, "
          "diffusers | PSNR vs uncached (dB): ours, diffusers | ours vs diffusers (dB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    notes: list[str] = []  # printed after the table
    for name in ("flux", "zimage"):
        ours_pipe = (FluxPipeline if name == "flux" else ZImagePipeline).from_pretrained(dirs[name])
        kw = dict(kws[name], height=args.size, width=args.size, num_inference_steps=args.steps)
        path = os.path.join(root, f"{name}_magcache_ratios.json")
        ratios = calibrate(ours_pipe, kw, path)
        notes.append(f"{name} magcache ratios (ours, calibrated): "
                     f"{', '.join(f'{r:.4f}' for r in ratios)}")  # fmt: skip
        rows = [("none", {})] + [
            (m, dict(k, mag_ratios=path) if m == "magcache" else k) for m, k in SETTINGS[name]
        ]
        times: dict[tuple[int, str], list[float]] = {}
        px: dict[tuple[int, str], np.ndarray] = {}
        counts: dict[tuple[int, str], tuple[int, int]] = {}
        ours(ours_pipe, kw, "none", {})  # warm-up
        for r in range(args.repeats):
            order = list(range(len(rows)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                method, knobs = rows[i]
                # diffusers has no residual target and no TeaCache hook: those rows run ours only
                matched = (
                    method in ("none", "fbcache", "magcache") or knobs.get("target") == "output"
                )
                sides = ("ours", "diffusers") if matched else ("ours",)
                for side in sides:
                    if side == "ours":
                        dt, img, c = ours(ours_pipe, kw, method, knobs)
                    else:
                        pipe = diffusers_pipe(name, dirs[name], method, knobs)
                        dt, img, c = theirs(pipe, kw, seen)
                    times.setdefault((i, side), []).append(dt)
                    px[i, side], counts[i, side] = img, c
        t0 = {s: statistics.median(times[0, s]) for s in ("ours", "diffusers")}
        for i, (method, knobs) in enumerate(rows):
            has = (i, "diffusers") in times
            med = {
                s: statistics.median(times[i, s])
                for s in ("ours", "diffusers")
                if has or s == "ours"
            }
            c = f"{counts[i, 'ours'][0]} / {counts[i, 'ours'][1]}"
            c += f", {counts[i, 'diffusers'][0]} / {counts[i, 'diffusers'][1]}" if has else ", --"
            sp = f"{t0['ours'] / med['ours']:.2f}x" + (
                f", {t0['diffusers'] / med['diffusers']:.2f}x" if has else ", --"
            )
            p = f"{psnr(px[i, 'ours'], px[0, 'ours']):.1f}" + (
                f", {psnr(px[i, 'diffusers'], px[0, 'diffusers']):.1f}" if has else ", --"
            )
            vs = f"{psnr(px[i, 'ours'], px[i, 'diffusers']):.1f}" if has else "--"
            shown = {k: v for k, v in knobs.items() if k not in NO_LIMIT and k != "mag_ratios"}
            knob = ", ".join(f"{k} {v}" for k, v in shown.items()) or "-"
            print(f"| {name} | {method} | {knob} | {c} | {sp} | {p} | {vs} |", flush=True)
    print("\n".join(notes))


if __name__ == "__main__":
    main()
