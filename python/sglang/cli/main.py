"""The ``sglang`` console script: ``sglang serve ...``, ``sglang generate ...`` and ``sglang
calibrate-cache ...`` (:mod:`sglang.cli.calibrate_cache`: a model's MagCache ratios).

``generate`` lives in :mod:`sglang.cli.generate` (``add_generate_args(parser)`` and
``run_generate(args) -> int``); it is imported only when that subcommand is used, so ``serve``
works (and ``--help`` is fast) whatever the state of the other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_generate(subparsers, load: bool):
    help_text = (
        "run one request and write its images (PNG, JPEG, WebP) or videos (MP4, WebP, GIF, "
        "frame folders)"
    )
    if not load:
        # Placeholder so `sglang --help` lists it; the real flags are added when it is chosen.
        p = subparsers.add_parser("generate", help=help_text, add_help=False)
        p.set_defaults(_run=None)
        return
    p = subparsers.add_parser("generate", help=help_text)
    try:
        from sglang.cli.generate import add_generate_args, run_generate
    except ImportError as e:
        p.set_defaults(_run=None, _unavailable=f"sglang generate is not available: {e}")
        return
    add_generate_args(p)
    p.set_defaults(_run=run_generate)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The top-level parser. ``argv`` decides whether the ``generate`` module is imported."""
    from sglang.cli.serve import add_serve_args, run_serve

    parser = argparse.ArgumentParser(prog="sglang", description="SGLang diffusion engine")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,calibrate-cache}")
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server (/v1/images/generations, /v1/videos, LoRA admin)",
    )
    add_serve_args(serve)
    serve.set_defaults(_run=run_serve)
    _add_generate(sub, load=bool(argv) and argv[0] == "generate")
    from sglang.cli.calibrate_cache import add_calibrate_args, run_calibrate

    calibrate = sub.add_parser(
        "calibrate-cache",
        help="measure a model's MagCache ratios (--cache-method magcache) and store them beside "
        "the model",
    )
    add_calibrate_args(calibrate)
    calibrate.set_defaults(_run=run_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sglang`` script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if args.command is None:
        parser.print_help()
        return 2
    if run is None:
        print(
            f"sglang: error: {getattr(args, '_unavailable', 'subcommand not available')}",
            file=sys.stderr,
        )
        return 2
    return int(run(args) or 0)


def console_main() -> None:
    """The console script: :func:`main`, then exit with its code (at once, with ``os._exit``,
    if an engine call is still running after an interrupt; see ``exit_code_for_process``)."""
    from sglang.multimodal_gen.runtime.compute_thread import exit_code_for_process

    sys.exit(exit_code_for_process(main()))


if __name__ == "__main__":
    console_main()
