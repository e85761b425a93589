"""``sglang generate``: one image from the command line, written as PNG, JPEG or WebP.

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
    parser.add_argument(
        "--negative-prompt",
        default=None,
        help="negative prompt for CFG (Z-Image: with --guidance-scale > 0; Flux: with "
        "--true-cfg-scale > 1)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    parser.add_argument(
        "--num-inference-steps",
        type=int,
        default=None,
        help="denoising steps (default: the model family's, e.g. 8 for Z-Image-Turbo, 28 for "
        "FLUX.1-dev, 4 for FLUX.1-schnell)",
    )
    parser.add_argument("--height", type=int, default=None, help="pixels (default: 1024)")
    parser.add_argument("--width", type=int, default=None, help="pixels (default: 1024)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="Z-Image: CFG weight, 0 disables CFG (default 0); Flux.1 [dev]: the embedded "
        "(distilled) guidance (default 3.5)",
    )
    parser.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help="real CFG weight with --negative-prompt for families with embedded guidance "
        "(Flux); 1 disables it (default: 1)",
    )
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="text-encoder tokens (default: the family's: 512 for Z-Image and FLUX.1-dev, "
        "256 for FLUX.1-schnell)",
    )
    parser.add_argument(
        "--output-path",
        default="output.png",
        help="image file (.png, .jpg/.jpeg, .webp by extension), or a directory (a trailing "
        "slash or an existing one) for one PNG per image (default: output.png)",
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
        "--lora-target",
        nargs="+",
        action="extend",
        default=None,
        help="LoRA target per --lora-path (one value applies to all; default: all)",
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


_IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}


def output_files(path: str, count: int) -> list[tuple[str, str]]:
    """``[(file, PIL format)]`` for ``count`` images written to ``--output-path``.

    A trailing slash or an existing directory gives ``image_000.png``, ``image_001.png``, ...
    (sorted names in order); a file name needs a known image extension.

    Raises:
        ValueError: an unknown extension, or several images for one file name.
    """
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return [(os.path.join(path, f"image_{i:03d}.png"), "PNG") for i in range(count)]
    ext = os.path.splitext(path)[1].lower()
    if ext not in _IMAGE_FORMATS:
        raise ValueError(
            f"--output-path {path!r}: unknown image extension {ext or '(none)'!r}; use one of "
            f"{sorted(_IMAGE_FORMATS)} or a directory"
        )
    if count != 1:
        raise ValueError(f"--output-path {path!r} names one file for {count} images")
    return [(path, _IMAGE_FORMATS[ext])]


def save_png(image, path: str, fmt: str = "PNG") -> None:
    """Write a PIL image (PNG by default; ``fmt`` a PIL format name), creating the parent
    directory."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    image.save(path, format=fmt)


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

    try:
        targets = output_files(args.output_path, 1)
    except ValueError as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 2
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
                target=args.lora_target or "all",
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
            true_cfg_scale=args.true_cfg_scale,
            max_sequence_length=args.max_sequence_length,
            seed=seed,
        )
        images = engine.generate(req, progress=False if args.no_progress else None)
        for image, (path, fmt) in zip(images, targets):
            save_png(image.convert("RGB"), path, fmt)
    except (ValueError, FileNotFoundError, LookupError) as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 2
    except (SGLangError, EngineDeadError, RuntimeError) as e:
        print(f"sglang generate: error: {e}", file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.shutdown()
    for path, _ in targets:
        print(os.path.abspath(path))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang.cli.generate ...`` (same flags as ``sglang generate``)."""
    parser = add_generate_args(argparse.ArgumentParser(prog="sglang generate"))
    return run_generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
