"""``sglang generate``: one image from the command line, written as PNG, JPEG or WebP.

Same engine and defaults as the server, so the same arguments give the same pixels::

    sglang generate --model-path DIR --prompt "a cat" --seed 42 --num-inference-steps 8 \\
        --height 1024 --width 1024 --guidance-scale 0 --output-path cat.png \\
        [--lora-path A.safetensors B/ --lora-scale 0.7 1.3] [--tp-size 2]

Across nodes, the same command on each with ``--nnodes N --node-rank K --dist-init-addr
HOST:PORT`` (or under ``torchrun``): node 0 writes the output, the others exit 0 when it is done.

Without ``--model-path`` the embedded demo model is used (a tiny Z-Image trained on simple scenes:
"a red circle on a blue background, top left"; 64x64 by default; see docs/models.md). Exit code 0
on success, 2 for bad arguments or input, 1 for runtime
failures, 130 when interrupted; every error is one line ``sglang generate: error: ...`` (see
:mod:`sglang.cli.errors`, shared with ``sglang serve``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sglang.multimodal_gen.configs.parallel import (
    add_kernel_args,
    add_parallel_args,
    layout_from_args,
)
from sglang.multimodal_gen.configs.server_flags import add_multinode_args
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
    parser.add_argument(
        "--height",
        type=int,
        default=None,
        help="pixels (default: the model's, 1024 for Z-Image-Turbo)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="pixels (default: the model's, 1024 for Z-Image-Turbo)",
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="Z-Image: CFG weight, 0 disables CFG (default: the model's own, 0 for Z-Image-Turbo "
        "and the demo model); Flux.1 [dev]: the embedded "
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
        "--guidance-scale-2",
        type=float,
        default=None,
        help="guidance of the second (low-noise) expert of two-expert models such as Wan2.2 "
        "T2V-A14B (default: the family's, 3.0 for A14B)",
    )
    parser.add_argument(
        "--num-frames",
        type=int,
        default=None,
        help="video models: frames (default: the family's, e.g. 81 for Wan2.2 A14B)",
    )
    parser.add_argument(
        "--fps",
        type=int,
        default=None,
        help="video models: frames per second of the written video (default: the family's)",
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
        help="images: .png, .jpg/.jpeg, .webp; videos: .mp4 (H.264), .webp, .gif; or a "
        "directory (a trailing slash or an existing one) for one PNG per image or frame "
        "(default: output.png)",
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
    add_parallel_args(parser)
    add_kernel_args(parser)
    add_multinode_args(parser.add_argument_group("multi-node"))
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


def output_files(path: str, count: int, modality: str = "image") -> list[tuple[str, str]]:
    """``[(file, format)]`` for ``count`` images (or videos) written to ``--output-path``.

    A trailing slash or an existing directory gives ``image_000.png``, ... for images and one
    folder of PNG frames per video (``video_000/frame_00000.png``, ...): sorted names are in
    order. A file name needs an extension of the model's modality (``sglang.multimodal_gen.outputs``).

    Raises:
        ValueError: an extension of another modality or none, or several outputs for one file.
    """
    from sglang.multimodal_gen.outputs import is_directory_target, output_format

    if is_directory_target(path):
        name = "video_{:03d}" if modality == "video" else "image_{:03d}.png"
        fmt = "frames" if modality == "video" else "PNG"
        return [(os.path.join(path, name.format(i)), fmt) for i in range(count)]
    fmt = output_format(path, modality)
    if count != 1:
        raise ValueError(f"--output-path {path!r} names one file for {count} outputs")
    return [(path, fmt)]


def save_video(frames, path: str, fmt: str, fps: int) -> None:
    """Write uint8 ``[F, H, W, 3]`` frames as ``fmt`` (``mp4``/``webp``/``gif``) or, with
    ``fmt="frames"``, as a directory of PNG frames."""
    from sglang.multimodal_gen.outputs import encode_video, write_frames_dir

    if fmt == "frames":
        write_frames_dir(frames, path)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode_video(frames, fps, fmt))


def save_png(image, path: str, fmt: str = "PNG") -> None:
    """Write a PIL image (PNG by default; ``fmt`` a PIL format name), creating the parent
    directory."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    image.save(path, format=fmt)


def check_output_dir(path: str) -> None:
    """Create the folder the images go to now, before the model loads, so a path that cannot be
    written fails at once.

    Raises:
        ValueError: the folder cannot be created or written (names ``--output-path``).
    """
    is_dir = path.endswith(("/", os.sep)) or os.path.isdir(path)
    folder = os.path.abspath(path if is_dir else os.path.dirname(os.path.abspath(path)))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--output-path {path!r}: cannot create folder {folder!r} ({e.strerror or e})"
        ) from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output-path {path!r}: folder {folder!r} is not writable")
    if not is_dir and os.path.isdir(path):
        raise ValueError(f"--output-path {path!r} is a directory")


def run_generate(args: argparse.Namespace) -> int:
    """Run ``sglang generate`` with parsed ``args``; returns the exit code.

    Any failure is one line ``sglang generate: error: ...`` on stderr with the exit code of
    :mod:`sglang.cli.errors` (2: bad arguments or input, 1: runtime failure), never a traceback.
    """
    from sglang.cli.errors import report

    try:
        return _run_generate(args)
    except (Exception, KeyboardInterrupt) as e:
        return report("generate", e)


def _request_from_args(args: argparse.Namespace, seed: int):
    from sglang.multimodal_gen.runtime import GenerationRequest

    return GenerationRequest(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale,
        max_sequence_length=args.max_sequence_length,
        seed=seed,
        num_frames=getattr(args, "num_frames", None),
        fps=getattr(args, "fps", None),
        guidance_scale_2=getattr(args, "guidance_scale_2", None),
    )


def _check_output_extension(path: str) -> None:
    """Before the model (and so its modality) is known: the extension must be an image or a
    video one (the exact check follows once the model is loaded)."""
    try:
        output_files(path, 1, "image")
    except ValueError:
        try:
            output_files(path, 1, "video")
        except ValueError:
            pass
        else:
            return
        raise


def _run_generate(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from sglang.multimodal_gen.runtime.worker import quiet_library_progress_bars

    quiet_library_progress_bars()
    loras = lora_pairs(args.lora_path, args.lora_scale)
    layout = layout_from_args(args)  # contradictory degrees: one error before loading
    from sglang.multimodal_gen.runtime.nodes import multinode_kwargs, run_follower_node

    multinode = multinode_kwargs(args)
    job = dict(
        model_path=args.model_path,
        tp_size=layout.tp_size,
        sp_degree=layout.sp_degree,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_degree=layout.cfg_degree,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enable_torch_compile=args.enable_torch_compile,
        float32_matmul_precision=args.float32_matmul_precision,
    )
    if run_follower_node(**job, **multinode):
        return 0  # a node without rank 0: it followed node 0, which wrote the output

    import secrets

    from sglang.multimodal_gen.runtime import DiffusionEngine
    from sglang.multimodal_gen.runtime.engine import check_device

    _check_output_extension(args.output_path)
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    req = _request_from_args(args, seed)
    # every value rule that does not need the model, before it loads (the same rules again,
    # with the model's limits, in engine.generate)
    req.validate(spatial_factor=1)
    check_device(args.device)
    check_output_dir(args.output_path)
    if args.seed is None:
        print(f"seed: {seed}", file=sys.stderr)
    engine = None
    try:
        engine = DiffusionEngine(**job, **multinode)
        if loras:
            engine.set_lora(
                [f"lora{i}" for i in range(len(loras))],
                [p for p, _ in loras],
                target=args.lora_target or "all",
                strength=[s for _, s in loras],
                merge_mode=args.lora_merge_mode,
            )
        modality = getattr(engine, "modality", "image")
        targets = output_files(args.output_path, 1, modality)
        progress = False if args.no_progress else None
        if modality == "video":
            fps = req.fps or engine.defaults.get("fps") or 16
            for frames, (path, fmt) in zip(engine.generate_video(req, progress=progress), targets):
                save_video(frames, path, fmt, int(fps))
        else:
            for image, (path, fmt) in zip(engine.generate(req, progress=progress), targets):
                save_png(image.convert("RGB"), path, fmt)
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the result (or the first error) is what the user needs
                logging.getLogger(__name__).warning("engine shutdown failed", exc_info=True)
    for path, _ in targets:
        print(os.path.abspath(path))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang.cli.generate ...`` (same flags as ``sglang generate``)."""
    parser = add_generate_args(argparse.ArgumentParser(prog="sglang generate"))
    return run_generate(parser.parse_args(argv))


if __name__ == "__main__":
    from sglang.multimodal_gen.runtime.compute_thread import exit_code_for_process

    sys.exit(exit_code_for_process(main()))
