"""``sglang generate``: one image from the command line, written as PNG.

Same engine and defaults as the server, so the same arguments give the same pixels::

    sglang generate --model-path DIR --prompt "a cat" --seed 42 --num-inference-steps 8 \\
        --height 1024 --width 1024 --guidance-scale 0 --output-path cat.png \\
        [--lora-path A.safetensors B/ --lora-scale 0.7 1.3] [--tp-size 2]

Without ``--model-path`` the embedded tiny default model is used (random weights: the image is
noise by construction). Exit code 0 on success, 2 for bad arguments or input, 1 for other errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sglang.multimodal_gen.lora.requests import MERGE_MODES


def add_generate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``generate`` flags on ``parser`` and return it."""
    parser.add_argument(
        "--model-path",
        default=None,
        help="diffusers-format model directory or a Hub id in the local HF cache "
        "(default: the embedded tiny random-weight model; its images are noise)",
    )
    parser.add_argument("--prompt", required=True, help="text prompt")
    parser.add_argument("--negative-prompt", default=None, help="used when guidance > 0")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    parser.add_argument(
        "--num-inference-steps", type=int, default=8, help="denoising steps (default: 8)"
    )
    parser.add_argument("--height", type=int, default=1024, help="pixels (default: 1024)")
    parser.add_argument("--width", type=int, default=1024, help="pixels (default: 1024)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=0.0,
        help="CFG weight; 0 disables CFG (default: 0)",
    )
    parser.add_argument(
        "--output-path", default="output.png", help="PNG file to write (default: output.png)"
    )
    parser.add_argument(
        "--lora-path", nargs="+", action="extend", default=None, help="LoRA file(s)/folder(s)"
    )
    parser.add_argument(
        "--lora-scale",
        nargs="+",
        action="extend",
        type=float,
        default=None,
        help="strength per --lora-path (one value applies to all; default 1.0)",
    )
    parser.add_argument(
        "--lora-merge-mode",
        default=None,
        choices=MERGE_MODES,
        help="how adapters are applied (default: the LoRA manager's)",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel processes")
    parser.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=("auto", "float32", "float16", "bfloat16"))
    parser.add_argument("--no-progress", action="store_true", help="hide the step progress bar")
    return parser


def lora_pairs(paths: list[str] | None, scales: list[float] | None) -> list[tuple[str, float]]:
    """``[(path, scale), ...]`` from the flags.

    Raises:
        ValueError: ``--lora-scale`` without ``--lora-path``, or a count other than 1 or
            ``len(paths)``.
    """
    paths = list(paths or [])
    scales = list(scales or [])
    if scales and not paths:
        raise ValueError("--lora-scale given without --lora-path")
    if not scales:
        scales = [1.0] * len(paths)
    elif len(scales) == 1:
        scales = scales * len(paths)
    elif len(scales) != len(paths):
        raise ValueError(
            f"--lora-scale has {len(scales)} values for {len(paths)} --lora-path values; "
            "give one, or one per path"
        )
    return list(zip(paths, scales))


def save_png(image, path: str) -> None:
    """Write a PIL image as PNG (creating the parent directory)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    image.save(path, format="PNG")


def run_generate(args: argparse.Namespace) -> int:
    """Run ``sglang generate`` with parsed ``args``; returns the exit code."""
    from sglang.multimodal_gen.errors import EngineDeadError, SGLangError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from sglang.multimodal_gen.runtime.engine import quiet_library_progress_bars

    quiet_library_progress_bars()
    try:
        loras = lora_pairs(args.lora_path, args.lora_scale)
    except ValueError as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 2
    if args.tp_size < 1:
        print(
            f"sglang generate: error: --tp-size must be >= 1, got {args.tp_size}", file=sys.stderr
        )
        return 2

    import secrets

    from sglang.multimodal_gen.runtime import DiffusionEngine, GenerationRequest

    seed = args.seed if args.seed is not None else secrets.randbits(31)
    if args.seed is None:
        print(f"seed: {seed}", file=sys.stderr)
    engine = None
    try:
        engine = DiffusionEngine(
            model_path=args.model_path, tp_size=args.tp_size, device=args.device, dtype=args.dtype
        )
        if loras:
            engine.set_lora(
                [f"lora{i}" for i in range(len(loras))],
                [p for p, _ in loras],
                strength=[s for _, s in loras],
                merge_mode=args.lora_merge_mode,
            )
        req = GenerationRequest(
            prompt=args.prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_inference_steps=args.num_inference_steps,
            guidance_scale=args.guidance_scale,
            seed=seed,
        )
        image = engine.generate(req, progress=False if args.no_progress else None)[0]
        save_png(image, args.output_path)
    except (ValueError, FileNotFoundError, LookupError) as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 2
    except (SGLangError, EngineDeadError, RuntimeError) as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.shutdown()
    print(os.path.abspath(args.output_path))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang.cli.generate ...`` (same flags as ``sglang generate``)."""
    parser = add_generate_args(argparse.ArgumentParser(prog="sglang generate"))
    return run_generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
