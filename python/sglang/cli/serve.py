"""``sglang serve``: start the OpenAI-compatible diffusion server.

Example::

    sglang serve --model-path M --model-type diffusion --dit-cpu-offload false --num-gpus 1 \
        --port 8080 --host localhost

Flags are those of :class:`~sglang.multimodal_gen.configs.server_args.ServerArgs`. Heavy imports
(torch, FastAPI, the engine) happen only when the server actually starts, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse

from sglang.multimodal_gen.configs.server_args import ServerArgs


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``serve`` flags on ``parser``."""
    return ServerArgs.add_cli_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    """Validate the flags, start the engine and the HTTP server; block until shutdown.

    Returns:
        0 after a clean shutdown; otherwise the exit code of :mod:`sglang.cli.errors` (2: bad
        flags or input, e.g. a model or startup adapter path that does not exist or cannot be
        used, a ``--max-image-size`` above the model's, a device this machine lacks; 1: runtime
        failures), with one line ``sglang serve: error: ...`` on stderr, as ``sglang generate``.
    """
    from sglang.cli.errors import report

    try:
        server_args = ServerArgs.from_cli_args(args)
        from sglang.multimodal_gen.entrypoints.http_server import launch_server

        launch_server(server_args)
    except (Exception, KeyboardInterrupt) as e:
        return report("serve", e)
    return 0
