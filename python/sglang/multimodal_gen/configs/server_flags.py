"""The command-line flags of ``sglang serve`` (and of ``sglang generate``'s shared groups).

:func:`add_server_flags` registers them on an ``argparse`` parser and :func:`server_args_kwargs`
maps the parsed namespace onto :class:`~.server_args.ServerArgs` fields; the public entry points
are ``ServerArgs.add_cli_args`` and ``ServerArgs.from_cli_args``. Nothing here imports torch or
FastAPI, so ``sglang serve --help`` is fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang.multimodal_gen.configs.launch_plan import DEFAULT_DIST_TIMEOUT_S
from sglang.multimodal_gen.configs.parallel import (
    add_kernel_args,
    add_parallel_args,
    layout_from_args,
)
from sglang.multimodal_gen.configs.server_args import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    DEFAULT_MAX_INFERENCE_STEPS,
    DEFAULT_MAX_PIXEL_STEPS,
    DTYPES,
    MODEL_TYPES,
)


def str_to_bool(value: str | bool) -> bool:
    """Parse ``true|false`` (also ``1|0``, ``yes|no``, ``on|off``) as used by ``--dit-cpu-offload``.

    Raises:
        argparse.ArgumentTypeError: for any other spelling (argparse reports it as a usage error).
    """
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_server_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the engine and server flags on ``parser`` and return it."""
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model-path",
        default=None,
        help="local model directory or a Hub repo id present in the local Hugging Face "
        "cache (no downloads); omitted: the embedded tiny default model",
    )
    g.add_argument(
        "--model-type",
        default=None,
        choices=MODEL_TYPES,
        help="model family; detected from model_index.json when omitted",
    )
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default: auto)")
    g.add_argument(
        "--dit-cpu-offload",
        type=str_to_bool,
        default=False,
        metavar="{true,false}",
        help="keep DiT weights in host memory between denoising runs (GPU only)",
    )

    add_parallel_args(parser)
    add_kernel_args(parser)
    add_multinode_args(parser.add_argument_group("multi-node"))

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health)"
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="separate key required by the LoRA admin endpoints (set/unset/unload/merge)",
    )
    g.add_argument("--max-queue-size", type=int, default=64)
    g.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="generations with the same settings run in one denoising loop, at most this many",
    )
    g.add_argument(
        "--batch-wait-ms",
        type=float,
        default=0.0,
        help="how long a batch that is not full waits for more requests (milliseconds)",
    )
    g.add_argument(
        "--max-image-size",
        type=int,
        default=None,
        help="largest width or height in pixels (default: 2048, or the model's maximum when "
        "smaller; a larger value than the model's is refused at start-up)",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        help=f"largest n (images per request; default {DEFAULT_MAX_IMAGES_PER_REQUEST})",
    )
    g.add_argument(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_INFERENCE_STEPS,
        help=f"largest num_inference_steps (default {DEFAULT_MAX_INFERENCE_STEPS})",
    )
    g.add_argument(
        "--max-pixel-steps",
        type=int,
        default=None,
        help="largest n x num_frames x width x height x num_inference_steps of one request "
        f"(default {DEFAULT_MAX_PIXEL_STEPS} = 1024x1024 x 256, or 4x the model's default "
        "request when larger, as for video models; 0: no bound)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    g.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=300.0,
        help="seconds SIGTERM/SIGINT waits for queued and running requests before failing them "
        "and exiting (default 300)",
    )
    g.add_argument(
        "--timeout-headers",
        type=float,
        default=10.0,
        help="seconds a connection has to send its request headers (default 10; 0: no bound)",
    )
    g.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="seconds a request body has to arrive, else 408 (default 30; 0: no bound)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=512,
        help="open connections at most; more are answered 503 and closed (default 512)",
    )
    g.add_argument(
        "--health-stall-timeout",
        type=float,
        default=900.0,
        help="/health answers 503 when work is pending and the engine has not started or "
        "finished a task for this many seconds (default 900; 0: never)",
    )
    g.add_argument("--served-model-name", default=None, help="id reported by /v1/models")
    g.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error", "critical")
    )

    g = parser.add_argument_group("LoRA")
    g.add_argument(
        "--lora-path",
        action="extend",
        nargs="+",
        default=None,
        help="adapter(s) to load and activate at startup (file, folder or cached repo id); "
        "loaded from anywhere, relative paths are looked up in --lora-dir first",
    )
    g.add_argument(
        "--lora-nickname",
        action="extend",
        nargs="+",
        default=None,
        help="nickname per --lora-path (default: its file/folder name)",
    )
    g.add_argument(
        "--lora-scale",
        action="extend",
        nargs="+",
        type=float,
        default=None,
        help="strength per startup adapter (default 1.0)",
    )
    g.add_argument(
        "--lora-target",
        action="extend",
        nargs="+",
        default=None,
        help="target per startup adapter: all, transformer, transformer_2 (two-expert "
        "models); one value applies to all (default all)",
    )
    g.add_argument(
        "--lora-dir",
        action="append",
        default=None,
        help="allowed root for local LoRA paths given to /v1/set_lora (repeatable); paths "
        "outside are refused, and without --lora-dir every local path is (Hub ids from the "
        "local cache are accepted)",
    )
    g.add_argument(
        "--lora-merge-cache-gb",
        type=float,
        default=None,
        help="GiB of merged weights cached per rank for fast switching back (default 1; 0 "
        "disables); kept in host memory when the GPU could not hold it",
    )
    g.add_argument(
        "--max-loaded-lora-gb",
        type=float,
        default=None,
        help="GiB of loaded adapters per rank (default 8); least recently used inactive "
        "adapters are unloaded to make room, a larger adapter is refused with HTTP 400",
    )
    return parser


def server_args_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerArgs`` fields of a namespace filled by :func:`add_server_flags`."""
    layout = layout_from_args(args)
    return dict(
        model_path=args.model_path,
        model_type=args.model_type,
        host=args.host,
        port=args.port,
        tp_size=layout.tp_size,
        sp_degree=layout.sp_degree,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        enable_cfg_parallel=bool(args.enable_cfg_parallel),
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        lora_paths=list(args.lora_path or []),
        lora_nicknames=list(args.lora_nickname or []),
        lora_scales=list(args.lora_scale or []),
        lora_targets=list(args.lora_target or []),
        lora_dirs=list(args.lora_dir or []),
        max_queue_size=args.max_queue_size,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_image_size=args.max_image_size,
        max_images_per_request=args.max_n,
        max_inference_steps=args.max_steps,
        max_pixel_steps=args.max_pixel_steps,
        timeout_keep_alive_s=args.timeout_keep_alive,
        graceful_shutdown_timeout_s=args.timeout_graceful_shutdown,
        timeout_headers_s=args.timeout_headers,
        timeout_body_s=args.timeout_body,
        limit_concurrency=args.limit_concurrency,
        health_stall_timeout_s=args.health_stall_timeout,
        dit_cpu_offload=args.dit_cpu_offload,
        attention_backend=args.attention_backend,
        enable_torch_compile=bool(args.enable_torch_compile),
        float32_matmul_precision=args.float32_matmul_precision,
        device=args.device,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_timeout_s=args.dist_timeout,
        lora_merge_cache_gb=getattr(args, "lora_merge_cache_gb", None),
        max_loaded_lora_gb=getattr(args, "max_loaded_lora_gb", None),
    )


def add_multinode_args(parser) -> None:
    """``--nnodes``, ``--node-rank``, ``--dist-init-addr``, ``--dist-timeout`` on ``parser`` (an
    ``argparse`` parser or group; shared by ``sglang serve`` and ``sglang generate``)."""
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes in the job; each runs --tp-size / --nnodes ranks (default 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index in [0, nnodes); node 0 serves HTTP / writes the output",
    )
    parser.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous address on node 0, reachable from every node (needed with --nnodes > 1)",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_DIST_TIMEOUT_S,
        help="seconds the start-up rendezvous waits for every node before failing (default "
        f"{DEFAULT_DIST_TIMEOUT_S:g})",
    )
