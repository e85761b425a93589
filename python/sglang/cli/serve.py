"""``sglang serve``: start the OpenAI-compatible diffusion server.

Example::

    sglang serve --model-path M --model-type diffusion --dit-cpu-offload false --num-gpus 1 \
        --port 8080 --host localhost

Flags are those of :class:`~sglang.multimodal_gen.configs.server_args.ServerArgs`. Heavy imports
(torch, FastAPI, the engine) happen only when the server actually starts, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import sys

from sglang.multimodal_gen.configs.server_args import ServerArgs


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``serve`` flags on ``parser``."""
    return ServerArgs.add_cli_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    """Validate the flags, start the engine and the HTTP server; block until shutdown.

    Returns:
        0 after a clean shutdown, 2 for invalid flags, 1 when the model or a startup adapter
        cannot be loaded (the message goes to stderr).
    """
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        print(f"sglang serve: error: {e}", file=sys.stderr)
        return 2
    from sglang.multimodal_gen.entrypoints.http_server import launch_server
    from sglang.multimodal_gen.errors import SGLangError

    try:
        launch_server(server_args)
    except (SGLangError, ValueError, FileNotFoundError) as e:
        # A model or startup adapter that cannot be used: one clear line, no traceback.
        message = getattr(e, "message", None) or str(e)
        print(f"sglang serve: error: {message}", file=sys.stderr)
        return 1
    return 0
