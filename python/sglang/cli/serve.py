"""``sglang serve``: start the OpenAI-compatible diffusion server.

Example::

    sglang serve --model-path M --model-type diffusion --dit-cpu-offload false --num-gpus 1 \
        --port 8080 --host localhost

Multi-node (node 0 serves HTTP, node 1 runs its ranks only and exits 0 when node 0 stops)::

    sglang serve --tp-size 2 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:5000   # node 0
    sglang serve --tp-size 2 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000   # node 1

and ``torchrun --nproc-per-node 2 -m sglang.cli.main serve ...`` (rank 0 serves).

Flags are those of :class:`~sglang.multimodal_gen.configs.server_args.ServerArgs`. Heavy imports
(torch, FastAPI, the engine) happen only when the server actually starts, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse

from sglang.multimodal_gen.configs.server_args import ServerArgs


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``serve`` flags on ``parser``."""
    return ServerArgs.add_cli_args(parser)


def _follow(server_args: ServerArgs) -> bool:
    """On a node without rank 0 (``--node-rank`` > 0, or a torchrun rank > 0): run this node's
    ranks, no HTTP server, until node 0 shuts down; ``False`` on the leader."""
    from sglang.multimodal_gen.runtime.model_source import job_kwargs
    from sglang.multimodal_gen.runtime.nodes import multinode_kwargs, run_follower_node

    if server_args.world_size == 1 and server_args.nnodes == 1:
        return False
    import logging

    logging.basicConfig(level=server_args.log_level.upper(), format="%(levelname)s %(message)s")
    return run_follower_node(**job_kwargs(server_args), **multinode_kwargs(server_args))


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
        if _follow(server_args):
            return 0
        from sglang.multimodal_gen.entrypoints.http_server import launch_server
        from sglang.multimodal_gen.runtime.worker import quiet_library_progress_bars

        quiet_library_progress_bars()  # as `sglang generate`: no weight-loading bars in the log
        launch_server(server_args)
    except (Exception, KeyboardInterrupt) as e:
        return report("serve", e)
    return 0
