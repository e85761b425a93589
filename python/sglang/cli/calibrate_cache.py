"""``sglang calibrate-cache``: measure a model's MagCache ratios and store them beside the model.

::

    sglang calibrate-cache [--model-path DIR] [--steps 28] [--prompt "a cat" ...] [--seed 0] \\
        [--height H --width W] [--output FILE]

Runs one uncached request per prompt with ``cache={"method": "magcache", "calibrate": true}``
(every step computed, the ratio of consecutive residual magnitudes recorded per state; see
:mod:`sglang.multimodal_gen.layers.step_cache.magcache`), averages them over the prompts and writes
``magcache_ratios.json`` into the model directory (or ``--output``). ``sglang serve`` and
``sglang generate`` with ``--cache-method magcache`` then load that file by themselves;
``--cache-mag-ratios FILE`` names another one. Without ``--model-path`` the embedded demo model is
calibrated, and ``--output`` is required (its directory is part of the installed package, which
ships the demo's file: exit 2 without it). Prints the file's path. Exit codes and the one-line errors are those of
:mod:`sglang.cli.errors`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

#: Prompts calibrated when none is given (the ratios are prompt-independent; a few are averaged).
DEFAULT_PROMPTS = (
    "a red circle on a blue background, top left",
    "a photo of a cat sitting on a wooden table",
)


def add_calibrate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``calibrate-cache`` flags on ``parser`` and return it."""
    parser.add_argument(
        "--model-path",
        default=None,
        help="diffusers-format model directory (default: the embedded demo model, which then "
        "needs --output)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="denoising steps of the calibration runs (default: the model's default); other "
        "step counts resample the ratios",
    )
    parser.add_argument(
        "--prompt",
        nargs="+",
        default=None,
        help="prompts to calibrate with, averaged (default: two generic prompts)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    parser.add_argument("--height", type=int, default=None, help="image height (model default)")
    parser.add_argument("--width", type=int, default=None, help="image width (model default)")
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="guidance scale (model default)"
    )
    parser.add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help="where to write the ratios (default: magcache_ratios.json in the --model-path "
        "directory; required without --model-path, as the embedded demo model's directory is "
        "part of the installed package)",
    )
    parser.add_argument("--device", default=None, help="execution device (default: auto)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: the model's)")
    return parser


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``sglang calibrate-cache`` with parsed ``args``; returns the exit code (one line
    ``sglang calibrate-cache: error: ...`` on failure)."""
    from sglang.cli.errors import report

    try:
        return _run(args)
    except (Exception, KeyboardInterrupt) as e:
        return report("calibrate-cache", e)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from sglang.multimodal_gen.layers.step_cache.mag_ratios import RATIOS_FILE, MagRatios
    from sglang.multimodal_gen.outputs import STEP_CACHE_INFO
    from sglang.multimodal_gen.runtime import DiffusionEngine

    if args.model_path is None and args.output is None:  # never write into the package
        raise ValueError(
            "--output is required without --model-path: the embedded demo model's directory is "
            "part of the installed package (which ships its magcache_ratios.json)"
        )
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    fields = {
        k: v
        for k, v in dict(
            num_inference_steps=args.steps,
            height=args.height,
            width=args.width,
            guidance_scale=args.guidance_scale,
        ).items()
        if v is not None
    }
    engine = DiffusionEngine(model_path=args.model_path, device=args.device, dtype=args.dtype)
    try:
        runs, steps = [], None
        for prompt in prompts:
            params = engine.spec.resolve(
                engine.spec.params(
                    prompt=prompt,
                    seed=args.seed,
                    cache={"method": "magcache", "calibrate": True},
                    **fields,
                )
            )
            steps = int(params.num_inference_steps)
            out = engine.generate(params, progress=False)
            runs.append(getattr(out[0], "info", {}).get(STEP_CACHE_INFO, {}).get("mag_ratios", {}))
        path = args.output or os.path.join(engine.model_path, RATIOS_FILE)
        MagRatios.average(runs, steps).save(path)
    finally:
        engine.shutdown()
    print(os.path.abspath(path))
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = add_calibrate_args(argparse.ArgumentParser(prog="sglang calibrate-cache"))
    sys.exit(run_calibrate(parser.parse_args()))
