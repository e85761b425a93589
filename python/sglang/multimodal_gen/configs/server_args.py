"""Server arguments: one dataclass shared by ``sglang serve``, ``sglang generate`` and the engine.

``ServerArgs`` holds everything needed to start a :class:`~sglang.multimodal_gen.runtime.DiffusionEngine`
and the HTTP server in front of it. :meth:`ServerArgs.add_cli_args` registers the command-line flags
on an ``argparse`` parser and :meth:`ServerArgs.from_cli_args` turns the parsed namespace back into a
validated ``ServerArgs``: the flags are the command-line spelling of the fields, declared next to
them. Nothing here imports torch or FastAPI, so ``sglang serve --help`` is fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

from sglang.multimodal_gen.configs.launch_plan import (
    DEFAULT_DIST_TIMEOUT_S,
    plan_launch,
    running_under_torchrun,
)
from sglang.multimodal_gen.configs.parallel import (
    add_kernel_args,
    add_parallel_args,
    layout_from_args,
    resolve_layout,
)
from sglang.multimodal_gen.hub import HubUnavailableError, is_repo_id, model_index_snapshot

logger = logging.getLogger(__name__)

MODEL_TYPES = ("diffusion",)
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: ``--quantization`` values: online quantization of a floating-point transformer while loading
QUANTIZATIONS = ("fp8",)
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
DEFAULT_MAX_BATCH_SIZE = 8  # measured: docs/benchmarks.md, "Serving"
DEFAULT_MAX_INFERENCE_STEPS = 1000
DEFAULT_MAX_IMAGE_SIZE = 2048
# n x width x height x steps: 1 x 1024^2 x 256 steps, or 8 x 1024^2 x 32 (8 x 1024^2 x 50 is over)
DEFAULT_MAX_PIXEL_STEPS = 1024 * 1024 * 256
#: ``--cache-request-policy`` values: may a request choose its own step caching (``cache``)
CACHE_REQUEST_POLICIES = ("allow", "deny")
# input images (/v1/images/edits, /v1/videos' input_reference): the ImageLimits defaults
DEFAULT_MAX_INPUT_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_INPUT_BYTES = 64 << 20
DEFAULT_MAX_INPUT_IMAGES = 16


def _find_model_index(model_path: str, revision: str | None = None) -> str | None:
    """Return the path of ``model_index.json`` for a local directory or a Hub repo id (that one
    file is downloaded into the Hugging Face cache when it is not there; the engine fetches the
    rest).

    Raises:
        ValueError: a Hub id that is neither cached nor downloadable (the message names the repo
            id, the cache folder and the command that downloads it).
    """
    if os.path.isdir(model_path):
        candidate = os.path.join(model_path, "model_index.json")
        return candidate if os.path.isfile(candidate) else None
    if is_repo_id(model_path):
        try:
            candidate = os.path.join(model_index_snapshot(model_path, revision), "model_index.json")
        except HubUnavailableError as e:
            raise ValueError(f"no model_index.json found: {e}") from None
        return candidate if os.path.isfile(candidate) else None
    return None


def detect_model_type(model_path: str | None, revision: str | None = None) -> str:
    """Detect ``--model-type`` from the model's ``model_index.json`` (diffusers pipeline layout).

    Args:
        model_path: a local directory, a Hub repo id (its ``model_index.json`` at ``revision`` is
            downloaded when it is not cached), or ``None`` (the embedded default model, which is
            a diffusion model).

    Returns:
        ``"diffusion"``.

    Raises:
        ValueError: when no ``model_index.json`` is found or it names no diffusers pipeline; the
            message asks for an explicit ``--model-type``.
    """
    if model_path is None:
        return "diffusion"
    index = _find_model_index(model_path, revision)
    if index is None:
        raise ValueError(
            f"cannot detect the model type of {model_path!r}: no model_index.json found "
            "(locally or in the Hugging Face cache); pass --model-type diffusion"
        )
    try:
        with open(index, encoding="utf-8") as f:
            class_name = json.load(f).get("_class_name", "")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot read {index}: {e}; pass --model-type diffusion") from e
    if isinstance(class_name, str) and class_name.endswith("Pipeline"):
        return "diffusion"
    raise ValueError(
        f"{index} names {class_name!r}, not a diffusers pipeline; supported --model-type values: "
        f"{', '.join(MODEL_TYPES)}"
    )


@dataclass
class ServerArgs:
    """Arguments of the engine and the HTTP server.

    Attributes:
        model_path: local directory or Hub repo id (``owner/name``; downloaded into the Hugging
            Face cache when it is not there, only the files the engine reads); ``None`` serves the
            embedded tiny default model.
        revision: the Hub revision of ``model_path`` (``--revision``: a branch, tag or commit;
            default the repo's default branch).
        model_type: ``"diffusion"``; detected from ``model_index.json`` when ``None``.
        transformer_path: a transformer folder (its own ``config.json`` and safetensors, e.g. a
            ModelOpt FP8 / NVFP4 export) replacing the model's ``transformer/``
            (``--transformer-path``; a local folder or a Hub repo id).
        transformer_weights_path: a safetensors file or folder (or a Hub repo id, or
            ``owner/name/file.safetensors``) replacing the weights of the model's
            ``transformer/``, whose ``config.json`` is kept; a quantization config may sit in
            the safetensors header metadata (``--transformer-weights-path``). Exclusive with
            ``transformer_path``.
        quantization: quantize the floating-point transformer while loading
            (``--quantization``; one of :data:`QUANTIZATIONS`, ``None``: as the checkpoint is).
        cache_method, cache_threshold, cache_fn, cache_bn, cache_warmup, cache_interval,
            cache_order, cache_stop, cache_taylor_target, cache_max_cached_steps,
            cache_max_continuous_cached_steps, cache_max_skip_steps, cache_retention_ratio,
            cache_mag_ratios: step caching of the DiT blocks
            (``--cache-method`` ...; :attr:`step_cache`).
        host, port: where uvicorn listens.
        tp_size: tensor-parallel size (``--tp-size``; see ``configs.parallel`` for how
            ``--num-gpus`` fills it).
        sp_degree: sequence-parallel size (``--sp-degree`` = Ulysses x ring; 1: off).
        ulysses_degree / ring_degree: the split of ``sp_degree``; ``None``: chosen by the engine
            from the model's head count.
        enable_cfg_parallel: run the two CFG branches on different ranks (doubles the processes).
        api_key: when set, every endpoint but ``/health`` and ``/ready`` requires
            ``Authorization: Bearer <key>``; a list gives several keys (``--api-key`` repeated),
            each with its own video jobs and stored images (``docs/serving.md``, "Keys").
        admin_api_key: when set, the LoRA admin endpoints require this key instead; it sees
            every key's jobs and images.
        public_url: the base of the links of ``response_format: "url"``
            (``https://images.example.com``, a path prefix allowed); ``None``: the address the
            server listens on (``--host``/``--port``; see :mod:`~..entrypoints.public_url`).
        lora_paths / lora_nicknames / lora_scales: adapters loaded and activated at startup
            (nickname defaults to the file or folder name without extension; scale to 1.0).
            They come from the operator's command line and load from anywhere (relative paths
            are looked up in ``lora_dirs`` first; Hub ids are downloaded when not cached).
        lora_targets: ``--lora-target`` per startup adapter (``all``, ``transformer``,
            ``transformer_2`` for two-expert models); one value applies to all; default ``all``.
        lora_dirs: allowed roots for local LoRA paths sent to ``/v1/set_lora`` (realpath
            containment), passed to the engine. Empty: ``set_lora`` accepts no local path, only
            Hub ids.
        enable_hub_lora: ``/v1/set_lora`` may name Hub LoRA ids that are not in the local
            Hugging Face cache; they are downloaded (``--enable-hub-lora``; default off: only
            cached ones are accepted).
        max_queue_size: generation requests waiting or running at once; more get 503 + Retry-After.
        max_batch_size: generations run in one denoising loop at most (``--max-batch-size``; 1:
            one at a time).
        batch_wait_ms: how long a batch that is not full waits for more requests.
        max_image_size: largest allowed width or height in pixels; must not exceed the model's
            own maximum (the server refuses to start otherwise). ``None``: 2048, or the model's
            maximum when that is smaller.
        max_images_per_request: upper bound of ``n`` (``--max-n``).
        max_inference_steps: upper bound of ``num_inference_steps`` (``--max-steps``).
        cache_request_policy: whether a request may choose its own step caching (its ``cache``
            field; ``--cache-request-policy``): ``"allow"`` (default: a request's choice costs
            at most what the request costs uncached, which the other bounds limit) or
            ``"deny"`` (a request that sets ``cache`` is refused with HTTP 400; every request
            runs with ``--cache-method``).
        max_pixel_steps: upper bound of ``n x num_frames x width x height x
            num_inference_steps`` per request (0: no bound; ``None``: 1024x1024 x 256, or 4x the
            model's default request when larger).
        max_input_image_bytes: bytes of one input image file (``--max-input-image-bytes``).
        max_input_bytes: bytes of all the input images and the mask of one request
            (``--max-input-bytes``); the body limit of the routes taking images derives from it.
        max_input_images: input images in one request (``--max-input-images``; a model may
            take fewer).
        image_url_allowed_hosts: hosts whose ``http(s)`` image URLs a request may name
            (``--image-url-allowed-hosts``); empty: no URL is fetched.
        timeout_keep_alive_s: an idle kept-alive connection is closed after this long.
        timeout_headers_s: request headers must arrive within this long of the connection
            opening (or of the previous answer); 0: no bound.
        timeout_body_s: a request body must arrive within this long (else 408); 0: no bound.
        limit_concurrency: open connections at most; one more is answered 503 and closed.
        health_stall_timeout_s: ``/health`` answers 503 while work is pending and the engine has
            not started or finished a task for this long (0: never).
        dit_cpu_offload: keep DiT weights in host memory between runs (GPU only; no-op on CPU).
        attention_backend: SDPA kernel (``--attention-backend``: auto, flash, efficient, cudnn,
            math; the CPU has flash and math).
        enable_torch_compile: ``torch.compile`` the DiT blocks (``--enable-torch-compile``).
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` in every engine process
            (``--float32-matmul-precision``: highest, high, medium).
        cpu_gemm_backend: the kernel of fp32 linear layers on the CPU (``--cpu-gemm-backend``:
            auto, onednn, onednn-packed, blas).
        lora_merge_cache_gb: bound of the LoRA merge cache per rank in GiB (``None``: 1).
        max_loaded_lora_gb: bound of the loaded LoRA adapters per rank in GiB (``None``: 8).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks CUDA when available.
        dtype: ``auto|float32|float16|bfloat16``; ``None`` = ``auto`` (the engine's default).
        served_model_name: id reported by ``/v1/models`` (default: the engine's ``model_name``).
        log_level: Python logging level name for the server (``info``: one line per HTTP
            request, :mod:`~..entrypoints.request_log`).
        log_prompts: the per-request log line also shows prompts and LoRA paths (off: they
            never reach the log).
        nnodes, node_rank, dist_init_addr: multi-node launch (``--nnodes``, ``--node-rank``,
            ``--dist-init-addr HOST:PORT`` of node 0); node 0 serves HTTP, the others run their
            ranks only. Under ``torchrun`` these come from its environment instead.
        dist_timeout_s: seconds the start-up rendezvous waits for every node (``--dist-timeout``).
        graceful_shutdown_timeout_s: how long SIGTERM waits for in-flight work.
    """

    model_path: str | None = None
    revision: str | None = None
    model_type: str | None = None
    transformer_path: str | None = None
    transformer_weights_path: str | None = None
    quantization: str | None = None
    cache_method: str = "none"
    cache_threshold: float | None = None
    cache_fn: int | None = None
    cache_bn: int | None = None
    cache_warmup: int | None = None
    cache_interval: int | None = None
    cache_order: int | None = None
    cache_stop: int | None = None
    cache_taylor_target: str | None = None
    cache_max_cached_steps: int | None = None
    cache_max_continuous_cached_steps: int | None = None
    cache_max_skip_steps: int | None = None
    cache_retention_ratio: float | None = None
    cache_mag_ratios: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    sp_degree: int = 1
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    enable_cfg_parallel: bool = False
    api_key: str | list[str] | None = None
    admin_api_key: str | None = None
    public_url: str | None = None
    lora_paths: list[str] = field(default_factory=list)
    lora_nicknames: list[str] = field(default_factory=list)
    lora_scales: list[float] = field(default_factory=list)
    lora_targets: list[str] = field(default_factory=list)
    lora_dirs: list[str] = field(default_factory=list)
    enable_hub_lora: bool = False
    max_queue_size: int = 64
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    batch_wait_ms: float = 0.0
    max_image_size: int | None = None
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_inference_steps: int = DEFAULT_MAX_INFERENCE_STEPS
    max_pixel_steps: int | None = None
    cache_request_policy: str = "allow"
    max_input_image_bytes: int = DEFAULT_MAX_INPUT_IMAGE_BYTES
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_input_images: int = DEFAULT_MAX_INPUT_IMAGES
    image_url_allowed_hosts: list[str] = field(default_factory=list)
    timeout_keep_alive_s: float = 5.0
    timeout_headers_s: float = 10.0
    timeout_body_s: float = 30.0
    limit_concurrency: int = 512
    health_stall_timeout_s: float = 900.0
    dit_cpu_offload: bool = False
    attention_backend: str = "auto"
    enable_torch_compile: bool = False
    float32_matmul_precision: str = "highest"
    cpu_gemm_backend: str = "auto"
    device: str | None = None
    dtype: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    log_prompts: bool = False
    graceful_shutdown_timeout_s: float = 300.0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    lora_merge_cache_gb: float | None = None
    max_loaded_lora_gb: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check ranges and pairings; fill ``model_type`` and default LoRA nicknames.

        Raises:
            ValueError: naming the flag and the allowed range or pairing.
        """
        if self.model_type is None:
            self.model_type = detect_model_type(self.model_path, self.revision)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"--model-type {self.model_type!r} is not supported; choose from {MODEL_TYPES}"
            )
        check_weight_flags(self.transformer_path, self.transformer_weights_path, self.quantization)
        _ = self.step_cache  # a bad --cache-* value: one error at startup
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if int(self.tp_size) < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        resolve_layout(  # contradictory degrees: one error at startup, naming the numbers
            tp_size=self.tp_size,
            sp_degree=self.sp_degree,
            ulysses_degree=self.ulysses_degree,
            ring_degree=self.ring_degree,
            enable_cfg_parallel=self.enable_cfg_parallel,
        )
        if int(self.max_queue_size) < 1:
            raise ValueError(f"--max-queue-size must be >= 1, got {self.max_queue_size}")
        if int(self.max_batch_size) < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not 0 <= float(self.batch_wait_ms) < float("inf"):
            raise ValueError(f"--batch-wait-ms must be >= 0, got {self.batch_wait_ms}")
        if self.max_image_size is not None and int(self.max_image_size) < 1:
            raise ValueError(f"--max-image-size must be >= 1, got {self.max_image_size}")
        if int(self.max_images_per_request) < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_images_per_request}")
        if int(self.max_inference_steps) < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_inference_steps}")
        if self.cache_request_policy not in CACHE_REQUEST_POLICIES:
            raise ValueError(
                f"--cache-request-policy must be one of {', '.join(CACHE_REQUEST_POLICIES)}, "
                f"got {self.cache_request_policy!r}"
            )
        if self.max_pixel_steps is not None and int(self.max_pixel_steps) < 0:
            raise ValueError(f"--max-pixel-steps must be >= 0, got {self.max_pixel_steps}")
        for flag, value in (
            ("--max-input-image-bytes", self.max_input_image_bytes),
            ("--max-input-bytes", self.max_input_bytes),
            ("--max-input-images", self.max_input_images),
        ):
            if int(value) < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        self.image_url_allowed_hosts = [h.strip().lower() for h in self.image_url_allowed_hosts]
        if any(not h or "/" in h for h in self.image_url_allowed_hosts):
            raise ValueError(
                "--image-url-allowed-hosts takes host names (images.example.com), got "
                f"{self.image_url_allowed_hosts}"
            )
        if int(self.limit_concurrency) < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")
        for flag, value in (
            ("--timeout-keep-alive", self.timeout_keep_alive_s),
            ("--timeout-headers", self.timeout_headers_s),
            ("--timeout-body", self.timeout_body_s),
            ("--health-stall-timeout", self.health_stall_timeout_s),
            ("--timeout-graceful-shutdown", self.graceful_shutdown_timeout_s),
        ):
            if not 0 <= float(value) < float("inf"):
                raise ValueError(f"{flag} must be a number of seconds >= 0, got {value}")
        if float(self.timeout_keep_alive_s) < 1:
            raise ValueError(
                f"--timeout-keep-alive must be >= 1 second, got {self.timeout_keep_alive_s}"
            )
        from sglang.multimodal_gen.layers.attention import ATTENTION_BACKENDS

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {list(ATTENTION_BACKENDS)}, got "
                f"{self.attention_backend!r}"
            )
        from sglang.multimodal_gen.configs.parallel import check_float32_matmul_precision

        check_float32_matmul_precision(self.float32_matmul_precision)
        from sglang.multimodal_gen.layers.cpu_gemm import check_cpu_gemm_backend

        check_cpu_gemm_backend(self.cpu_gemm_backend)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if isinstance(self.api_key, (list, tuple)):
            self.api_key = list(self.api_key) or None
        if any(k == "" for k in self.user_api_keys):
            raise ValueError("--api-key must not be empty")
        if self.admin_api_key == "":
            raise ValueError("--admin-api-key must not be empty")
        if self.lora_nicknames and len(self.lora_nicknames) != len(self.lora_paths):
            raise ValueError(
                f"--lora-nickname given {len(self.lora_nicknames)} times but --lora-path "
                f"{len(self.lora_paths)} times; give one nickname per path (or none)"
            )
        if not self.lora_nicknames:
            self.lora_nicknames = [default_lora_nickname(p) for p in self.lora_paths]
        if len(set(self.lora_nicknames)) != len(self.lora_nicknames):
            raise ValueError(f"--lora-nickname values must be distinct, got {self.lora_nicknames}")
        if self.lora_scales and len(self.lora_scales) not in (1, len(self.lora_paths)):
            raise ValueError(
                f"--lora-scale given {len(self.lora_scales)} values for {len(self.lora_paths)} "
                "--lora-path values; give one scale, or one per path"
            )
        if self.lora_targets and len(self.lora_targets) not in (1, len(self.lora_paths)):
            raise ValueError(
                f"--lora-target given {len(self.lora_targets)} values for "
                f"{len(self.lora_paths)} --lora-path values; give one target, or one per path"
            )
        for flag, gb in (
            ("--lora-merge-cache-gb", self.lora_merge_cache_gb),
            ("--max-loaded-lora-gb", self.max_loaded_lora_gb),
        ):
            if gb is not None and not (0 <= gb < float("inf")):
                raise ValueError(f"{flag} must be a finite number of GiB >= 0, got {gb}")
        if self.public_url is not None:
            self.public_url = check_public_url(self.public_url)
        for root in self.lora_dirs:
            if not os.path.isdir(root):
                raise ValueError(f"--lora-dir {root!r} is not an existing directory")
        if self.nnodes != 1 or self.dist_init_addr or running_under_torchrun():
            # the same checks as at launch (port 1: no free port is looked for here)
            plan_launch(
                self.world_size, self.nnodes, self.node_rank, self.dist_init_addr,
                self.dist_timeout_s, free_port=1,
            )  # fmt: skip
        elif self.node_rank != 0:
            raise ValueError(f"--node-rank must be 0 without --nnodes, got {self.node_rank}")

    @property
    def step_cache(self):
        """The ``--cache-*`` flags as a
        :class:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig` (``None``: off).

        Raises:
            ValueError: naming the flag.
        """
        return step_cache_config(
            self.cache_method, self.cache_threshold, self.cache_fn, self.cache_bn,
            self.cache_warmup, interval=self.cache_interval, order=self.cache_order,
            stop=self.cache_stop, target=self.cache_taylor_target,
            max_cached_steps=self.cache_max_cached_steps,
            max_continuous_cached_steps=self.cache_max_continuous_cached_steps,
            max_skip_steps=self.cache_max_skip_steps,
            retention_ratio=self.cache_retention_ratio, mag_ratios=self.cache_mag_ratios,
        )  # fmt: skip

    @property
    def user_api_keys(self) -> tuple[str, ...]:
        """The keys of ``--api-key`` (none, one or several)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    @property
    def world_size(self) -> int:
        """Processes in the job: ``tp x sp x cfg``."""
        return int(self.tp_size) * int(self.sp_degree) * (2 if self.enable_cfg_parallel else 1)

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Register the engine and server flags on ``parser`` and return it (one flag per field;
        the parallel-layout and kernel flags come from :mod:`.parallel`)."""
        g = parser.add_argument_group("model")
        g.add_argument(
            "--model-path",
            default=None,
            help="local model directory or a Hugging Face Hub repo id (owner/name), downloaded "
            "into the HF cache when not there (HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE "
            "apply); omitted: the embedded tiny default model",
        )
        g.add_argument(
            "--revision",
            default=None,
            help="Hub revision of --model-path: a branch, tag or commit (default: the repo's "
            "default branch)",
        )
        g.add_argument(
            "--model-type",
            default=None,
            choices=MODEL_TYPES,
            help="model family; detected from model_index.json when omitted",
        )
        add_weight_args(g)
        add_cache_args(g)
        g.add_argument(
            "--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)"
        )
        g.add_argument(
            "--dtype", default=None, choices=DTYPES, help="compute dtype (default: auto)"
        )
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
        g.add_argument(
            "--host",
            default="127.0.0.1",
            help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all)",
        )
        g.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
        g.add_argument(
            "--api-key",
            action="append",
            default=None,
            help="require 'Authorization: Bearer KEY' (not on /health, /ready); repeat it for "
            "several keys: each sees only the video jobs and images it created",
        )
        g.add_argument(
            "--admin-api-key",
            default=None,
            help="separate key required by the LoRA admin endpoints (set/unset/unload/merge); "
            "it sees every key's jobs and images",
        )
        g.add_argument(
            "--public-url",
            default=None,
            metavar="URL",
            help="base of the links of response_format=url, e.g. https://images.example.com "
            "(default: http://HOST:PORT the server listens on; for 0.0.0.0 / :: the address "
            "the client connected to); never taken from request headers",
        )
        g.add_argument(
            "--max-queue-size",
            type=int,
            default=64,
            help="generation requests allowed to wait; more get 503 + Retry-After (default: 64)",
        )
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
            "--cache-request-policy",
            default="allow",
            choices=CACHE_REQUEST_POLICIES,
            help="whether a request may choose its own step caching (its cache field): allow "
            "(default) or deny (a request setting cache gets HTTP 400; every request runs with "
            "--cache-method)",
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
            "--max-input-image-bytes",
            type=int,
            default=DEFAULT_MAX_INPUT_IMAGE_BYTES,
            help="largest input image file in bytes (/v1/images/edits, input_reference; "
            f"default {DEFAULT_MAX_INPUT_IMAGE_BYTES} = 20 MiB)",
        )
        g.add_argument(
            "--max-input-bytes",
            type=int,
            default=DEFAULT_MAX_INPUT_BYTES,
            help="largest total of the input images and mask of one request in bytes "
            f"(default {DEFAULT_MAX_INPUT_BYTES} = 64 MiB)",
        )
        g.add_argument(
            "--max-input-images",
            type=int,
            default=DEFAULT_MAX_INPUT_IMAGES,
            help=f"most input images in one request (default {DEFAULT_MAX_INPUT_IMAGES}; a model "
            "may take fewer)",
        )
        g.add_argument(
            "--image-url-allowed-hosts",
            nargs="*",
            default=[],
            metavar="HOST",
            help="hosts whose http(s) image URLs a request may name (default: none; no URL is "
            "fetched, images come as files or base64)",
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
            "--log-level",
            default="info",
            choices=("debug", "info", "warning", "error", "critical"),
            help="server log level (default info: one key=value line per HTTP request)",
        )
        g.add_argument(
            "--log-prompts",
            action="store_true",
            help="show prompts and LoRA paths in the per-request log lines (default: never logged)",
        )

        g = parser.add_argument_group("LoRA")
        g.add_argument(
            "--lora-path",
            action="extend",
            nargs="+",
            default=None,
            help="adapter(s) to load and activate at startup (file, folder or Hub repo id, "
            "downloaded when not cached); loaded from anywhere, relative paths are looked up in "
            "--lora-dir first",
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
            "outside are refused, and without --lora-dir every local path is (Hub ids are "
            "accepted)",
        )
        g.add_argument(
            "--enable-hub-lora",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="let /v1/set_lora download Hub LoRA ids (owner/name) that are not in the local "
            "Hugging Face cache (default: off, only cached ones are accepted; --lora-path at "
            "startup downloads in every case)",
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

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """Build a validated ``ServerArgs`` from a namespace filled by :meth:`add_cli_args`.

        Raises:
            ValueError: see :meth:`validate`.
        """
        layout = layout_from_args(args)
        return cls(
            model_path=args.model_path,
            model_type=args.model_type,
            transformer_path=getattr(args, "transformer_path", None),
            transformer_weights_path=getattr(args, "transformer_weights_path", None),
            quantization=getattr(args, "quantization", None),
            **cache_fields(args),
            host=args.host,
            port=args.port,
            tp_size=layout.tp_size,
            sp_degree=layout.sp_degree,
            ulysses_degree=args.ulysses_degree,
            ring_degree=args.ring_degree,
            enable_cfg_parallel=bool(args.enable_cfg_parallel),
            api_key=(args.api_key[0] if len(args.api_key) == 1 else list(args.api_key))
            if args.api_key
            else None,
            admin_api_key=args.admin_api_key,
            public_url=args.public_url,
            lora_paths=list(args.lora_path or []),
            lora_nicknames=list(args.lora_nickname or []),
            lora_scales=list(args.lora_scale or []),
            lora_targets=list(args.lora_target or []),
            lora_dirs=list(args.lora_dir or []),
            enable_hub_lora=bool(getattr(args, "enable_hub_lora", False)),
            revision=getattr(args, "revision", None),
            max_queue_size=args.max_queue_size,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            max_image_size=args.max_image_size,
            max_images_per_request=args.max_n,
            max_inference_steps=args.max_steps,
            max_pixel_steps=args.max_pixel_steps,
            cache_request_policy=getattr(args, "cache_request_policy", "allow"),
            max_input_image_bytes=getattr(
                args, "max_input_image_bytes", DEFAULT_MAX_INPUT_IMAGE_BYTES
            ),
            max_input_bytes=getattr(args, "max_input_bytes", DEFAULT_MAX_INPUT_BYTES),
            max_input_images=getattr(args, "max_input_images", DEFAULT_MAX_INPUT_IMAGES),
            image_url_allowed_hosts=list(getattr(args, "image_url_allowed_hosts", None) or []),
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
            cpu_gemm_backend=getattr(args, "cpu_gemm_backend", "auto"),
            device=args.device,
            dtype=args.dtype,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            log_prompts=bool(getattr(args, "log_prompts", False)),
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            dist_init_addr=args.dist_init_addr,
            dist_timeout_s=args.dist_timeout,
            lora_merge_cache_gb=getattr(args, "lora_merge_cache_gb", None),
            max_loaded_lora_gb=getattr(args, "max_loaded_lora_gb", None),
        )

    @property
    def startup_lora_targets(self) -> list[str]:
        """The target of each startup adapter (``all`` by default)."""
        if not self.lora_targets:
            return ["all"] * len(self.lora_paths)
        if len(self.lora_targets) == 1:
            return self.lora_targets * len(self.lora_paths)
        return list(self.lora_targets)

    @property
    def startup_loras(self) -> list[tuple[str, str, float]]:
        """``[(nickname, path, strength), ...]`` for the startup adapters."""
        if not self.lora_scales:
            scales = [1.0] * len(self.lora_paths)
        elif len(self.lora_scales) == 1:
            scales = self.lora_scales * len(self.lora_paths)
        else:
            scales = list(self.lora_scales)
        return list(zip(self.lora_nicknames, self.lora_paths, scales))

    def replace(self, **changes) -> ServerArgs:
        """A copy with ``changes`` applied (re-validated)."""
        return dataclasses.replace(self, **changes)

    def redacted(self) -> dict:
        """The arguments as a dict with the API keys masked, for logging."""
        out = dataclasses.asdict(self)
        if isinstance(out["api_key"], str):
            out["api_key"] = "***"
        elif out["api_key"] is not None:
            out["api_key"] = ["***"] * len(out["api_key"])
        if out["admin_api_key"] is not None:
            out["admin_api_key"] = "***"
        return out


def check_public_url(url: str) -> str:
    """``--public-url`` normalised (no trailing ``/``): an ``http`` or ``https`` URL with a host,
    optionally a path prefix; no user name, password, query or fragment.

    Raises:
        ValueError: naming the flag and what is wrong.
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise ValueError(f"--public-url {url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--public-url must be an http:// or https:// URL with a host, such as "
            f"https://images.example.com; got {url!r}"
        )
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(
            f"--public-url must not carry a user name, password, query or fragment; got {url!r}"
        )
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def default_lora_nickname(path: str) -> str:
    """Nickname for a startup adapter given without ``--lora-nickname``: its base name.

    ``/a/b/pixel.safetensors`` -> ``pixel``; ``/a/b/style_lora/`` -> ``style_lora``;
    ``Owner/Repo`` -> ``Repo``.
    """
    base = os.path.basename(os.path.normpath(path))
    if base.endswith(".safetensors"):
        base = base[: -len(".safetensors")]
    return base or path


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


def check_weight_flags(
    transformer_path: str | None, transformer_weights_path: str | None, quantization: str | None
) -> None:
    """The parse-time checks of the transformer weight flags (shared by ``sglang serve`` and
    ``sglang generate``; whether the paths exist is checked when the engine resolves them).

    Raises:
        ValueError: ``--transformer-path`` with ``--transformer-weights-path`` (a transformer
            folder brings its own weights), an empty path, or a ``--quantization`` value not in
            :data:`QUANTIZATIONS`; the message names the flag.
    """
    for flag, value in (
        ("--transformer-path", transformer_path),
        ("--transformer-weights-path", transformer_weights_path),
    ):
        if value is not None and not str(value).strip():
            raise ValueError(f"{flag} must not be empty")
    if transformer_path and transformer_weights_path:
        raise ValueError(
            "--transformer-path and --transformer-weights-path are exclusive: a transformer "
            "folder brings its own config.json and weights; give one of them"
        )
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {quantization!r} is not supported; choose from "
            f"{', '.join(QUANTIZATIONS)}"
        )


def add_weight_args(parser) -> None:
    """``--transformer-path``, ``--transformer-weights-path`` and ``--quantization`` on
    ``parser`` (an ``argparse`` parser or group; shared by ``sglang serve`` and ``sglang
    generate``). ``--quantization`` takes any string here so that :func:`check_weight_flags`
    gives the one error message of both commands."""
    parser.add_argument(
        "--transformer-path",
        default=None,
        metavar="DIR",
        help="transformer folder (config.json + safetensors, e.g. a ModelOpt FP8/NVFP4 export) "
        "replacing the model's transformer/; a local folder or a Hub repo id (owner/name)",
    )
    parser.add_argument(
        "--transformer-weights-path",
        default=None,
        metavar="FILE|DIR|REPO_ID",
        help="safetensors file or folder (or Hub repo id, owner/name[/file.safetensors]) "
        "replacing the weights of the model's transformer/, its config.json kept; a "
        "quantization_config may sit in the safetensors metadata (exclusive with "
        "--transformer-path)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        metavar="{" + ",".join(QUANTIZATIONS) + "}",
        help="quantize the floating-point transformer while loading (fp8: FP8 e4m3 weights, "
        "per-channel scales); default: as the checkpoint is stored",
    )


def add_cache_args(parser) -> None:
    """``--cache-method`` and its knobs on ``parser`` (shared by ``sglang serve`` and ``sglang
    generate``); the values are checked by
    :meth:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig.of`."""
    from sglang.multimodal_gen.layers.step_cache import CACHE_METHODS

    parser.add_argument(
        "--cache-method",
        default="none",
        metavar="{" + ",".join(CACHE_METHODS) + "}",
        help="step caching of the DiT blocks (default none). fbcache: first-block cache "
        "(diffusers' FirstBlockCacheConfig rule; DBCache F1B0); dbcache: dual-block cache "
        "(cache-dit's DBCache rule, Fn scaled to the DiT); taylorseer: Taylor-extrapolated "
        "middle blocks on a fixed schedule (diffusers' TaylorSeerCacheConfig rule); teacache: "
        "every block skipped while the accumulated rescaled change of the first block's "
        "modulated input stays below the threshold (TeaCache, the model's published "
        "coefficients); magcache: whole steps skipped from the model's calibrated magnitude "
        "ratios (diffusers' MagCacheConfig rule). Each has a preset; the --cache-* knobs "
        "replace its values",
    )
    parser.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help="fbcache / dbcache: skip a step's middle blocks when the first blocks' residual "
        "changed by at most this (relative L1; default 0.3); teacache: rel_l1_thresh (default: "
        "the model's declared value); magcache: the accumulated error bound (default 0.2)",
    )
    parser.add_argument(
        "--cache-fn", type=int, default=None, help="dbcache: first blocks always computed (Fn)"
    )
    parser.add_argument(
        "--cache-bn", type=int, default=None, help="dbcache: last blocks always computed (Bn)"
    )
    parser.add_argument(
        "--cache-warmup",
        type=int,
        default=None,
        help="steps always computed at the start (default 0 fbcache, 2 dbcache, 3 taylorseer; "
        "teacache: the model's declared ret_steps)",
    )
    parser.add_argument(
        "--cache-interval",
        type=int,
        default=None,
        help="taylorseer: one computed step every this many after the warmup (default 3)",
    )
    parser.add_argument(
        "--cache-order",
        type=int,
        default=None,
        help="taylorseer: highest order of the Taylor expansion (default 1)",
    )
    parser.add_argument(
        "--cache-stop",
        type=int,
        default=None,
        help="taylorseer: steps from this index on are always computed (default: none)",
    )
    parser.add_argument(
        "--cache-taylor-target",
        default=None,
        choices=("residual", "output"),
        help="taylorseer: extrapolate the middle blocks' residual (default) or their output",
    )
    parser.add_argument(
        "--cache-max-cached-steps",
        type=int,
        default=None,
        help="fbcache / dbcache: at most this many skipped steps per request and CFG branch, "
        "later ones compute (cache-dit's max_cached_steps; -1: no limit; default: no limit)",
    )
    parser.add_argument(
        "--cache-max-continuous-cached-steps",
        type=int,
        default=None,
        help="fbcache / dbcache: at most this many skipped steps in a row, the next one "
        "computes (cache-dit's max_continuous_cached_steps; -1: no limit; default 4)",
    )
    parser.add_argument(
        "--cache-max-skip-steps",
        type=int,
        default=None,
        help="magcache: at most this many skipped steps in a row (diffusers' max_skip_steps; "
        "default 3)",
    )
    parser.add_argument(
        "--cache-retention-ratio",
        type=float,
        default=None,
        help="magcache: this fraction of the first steps always computes (diffusers' "
        "retention_ratio; default 0.2)",
    )
    parser.add_argument(
        "--cache-mag-ratios",
        default=None,
        metavar="FILE",
        help="magcache: the model's calibrated magnitude ratios (JSON; default: "
        "magcache_ratios.json beside the model, written by `sglang calibrate-cache`)",
    )


def cache_fields(args) -> dict:
    """The ``cache_*`` fields of a namespace filled by :func:`add_cache_args`."""
    return {
        k: getattr(args, k, None)
        for k in (
            "cache_method",
            "cache_threshold",
            "cache_fn",
            "cache_bn",
            "cache_warmup",
            "cache_interval",
            "cache_order",
            "cache_stop",
            "cache_taylor_target",
            "cache_max_cached_steps",
            "cache_max_continuous_cached_steps",
            "cache_max_skip_steps",
            "cache_retention_ratio",
            "cache_mag_ratios",
        )
    } | {"cache_method": getattr(args, "cache_method", None) or "none"}


def step_cache_config(
    method, threshold=None, fn=None, bn=None, warmup=None, *, interval=None, order=None,
    stop=None, target=None, max_cached_steps=None, max_continuous_cached_steps=None,
    max_skip_steps=None, retention_ratio=None, mag_ratios=None,
):  # fmt: skip
    """The :class:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig` of the ``--cache-*``
    values, ``None`` for ``none``.

    Raises:
        ValueError: naming the flag (an unknown or unimplemented method, a value out of range).
    """
    from sglang.multimodal_gen.layers.step_cache import StepCacheConfig

    cfg = StepCacheConfig.of(
        method or "none", threshold, fn, bn, warmup,
        interval=interval, order=order, stop=stop, target=target,
        max_cached_steps=max_cached_steps, max_continuous_cached_steps=max_continuous_cached_steps,
        max_skip_steps=max_skip_steps, retention_ratio=retention_ratio, mag_ratios=mag_ratios,
    )  # fmt: skip
    return cfg if cfg.enabled else None


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
