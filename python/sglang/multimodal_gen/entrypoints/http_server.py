"""The OpenAI-compatible HTTP server: ``create_app`` (the FastAPI app) and ``launch_server``.

Routes (see ``docs/serving.md``), by module::

    images.py      POST /v1/images/generations     OpenAI Images API + seed, steps, guidance, ...
                   POST /v1/images/edits           the same with input images (and a mask)
                   GET  /v1/images/files/{name}    images of response_format="url" (LRU, in memory)
    lora_admin.py  POST /v1/set_lora, /v1/unset_lora, /v1/unload_lora,
                        /v1/merge_lora_weights, /v1/unmerge_lora_weights;  GET /v1/list_loras
    videos.py      /v1/videos                      asynchronous video jobs (video models)
    here           GET  /v1/models                 the served model
                   GET  /health                    liveness: 200 while the engine serves, else 503
                   GET  /ready                     readiness: /health and room in the queue
                   GET  /metrics                   Prometheus text format

The app only talks to the engine through a :class:`~.scheduler.Scheduler` (one thread, arrival
order). Bodies are read and parsed with bounds by :mod:`.http_body`; every error is an OpenAI
error envelope (:mod:`.routing`), never a stack trace nor a server path (:mod:`.public_paths`).
Connections are bounded below the app, in uvicorn's protocol (:mod:`.transport`). ``/health`` and
``/ready`` need no API key. Every request gets one log line and an ``X-Request-Id``
(:mod:`.request_log`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.configs.server_args import (
    DEFAULT_MAX_IMAGE_SIZE,
    DEFAULT_MAX_PIXEL_STEPS,
    ServerArgs,
)
from sglang.multimodal_gen.entrypoints.auth import ApiKeyAuth
from sglang.multimodal_gen.entrypoints.images import ImageStore, add_image_routes
from sglang.multimodal_gen.entrypoints.lora_admin import add_lora_routes
from sglang.multimodal_gen.entrypoints.metrics import ServerMetrics
from sglang.multimodal_gen.entrypoints.openai_errors import error_body
from sglang.multimodal_gen.entrypoints.protocol import ModelCard, ModelList
from sglang.multimodal_gen.entrypoints.public_paths import PublicPaths
from sglang.multimodal_gen.entrypoints.public_url import PublicUrl
from sglang.multimodal_gen.entrypoints.request_log import RequestLog
from sglang.multimodal_gen.entrypoints.routing import AuthAndCount, EnvelopeRoute, RouteContext
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.entrypoints.schema_errors import schema_error_message
from sglang.multimodal_gen.entrypoints.transport import run_uvicorn, uvicorn_server
from sglang.multimodal_gen.entrypoints.videos import add_video_routes
from sglang.multimodal_gen.hub import hf_hub_cache_dir
from sglang.multimodal_gen.image_inputs import ImageLimits

logger = logging.getLogger(__name__)


def server_spec(engine_spec: RequestSpec, args: ServerArgs) -> RequestSpec:
    """The engine's request spec with the server's bounds on top (``--max-image-size``,
    ``--max-n``, ``--max-steps``, ``--max-pixel-steps``, ``--max-input-images``) and whether a
    request may choose its step caching (``--cache-request-policy``).

    Raises:
        ValueError: ``--max-image-size`` above the model's maximum.
    """
    defaults = engine_spec.as_dict()
    policy = getattr(args, "cache_request_policy", "allow")
    engine_spec = dataclasses.replace(engine_spec, request_cache=policy == "allow")
    return engine_spec.with_limits(
        RequestLimits(
            max_image_size=resolve_max_image_size(args.max_image_size, defaults),
            max_num_frames=None,
            max_sequence_length=None,
            max_inference_steps=args.max_inference_steps,
            max_num_outputs_per_prompt=args.max_images_per_request,
            max_pixel_steps=resolve_max_pixel_steps(args.max_pixel_steps, defaults),
            max_input_images=args.max_input_images,
        )
    )


def _hub_lora_fetcher(args: ServerArgs):
    """With ``--enable-hub-lora``: ``fetch(path)`` downloads a ``set_lora`` Hub id missing from
    the cache under the engine's path policy (its ``--lora-dir`` roots), else ``None``."""
    if not args.enable_hub_lora:
        return None
    roots = list(args.lora_dirs)

    def fetch(path: str) -> None:
        from sglang.multimodal_gen.lora.loading import fetch_hub_source

        fetch_hub_source(path, roots)

    return fetch


def create_app(
    engine: Any,
    server_args: ServerArgs | None = None,
    *,
    shutdown_engine: bool = False,
) -> FastAPI:
    """Build the FastAPI app in front of ``engine``.

    Args:
        engine: a ``DiffusionEngine`` (or an object with the same methods and properties:
            ``generate``, ``generate_batch``, ``set_lora``, ``unset_lora``, ``unload_lora``,
            ``merge_lora_weights``, ``unmerge_lora_weights``, ``list_loras``, ``is_alive``,
            ``shutdown``, ``model_name``, ``spec``, ``lora_targets``). Only the app's scheduler
            thread calls it.
        server_args: limits, keys and names (defaults: ``ServerArgs()``).
        shutdown_engine: call ``engine.shutdown()`` when the app stops.

    Returns:
        The app; ``app.state`` holds ``scheduler``, ``metrics``, ``engine``, ``server_args``,
        ``spec`` (the request spec with the server's bounds) and ``public_paths``.
    """
    args = server_args or ServerArgs()
    info = dict(getattr(engine, "model_info", {}) or {})
    spec = server_spec(engine.spec, args)
    metrics = ServerMetrics()
    scheduler = Scheduler(
        engine,
        args.max_queue_size,
        metrics=metrics,
        stall_timeout_s=args.health_stall_timeout_s or None,
        max_batch_size=args.max_batch_size,
        batch_wait_s=float(args.batch_wait_ms) / 1000.0,
    )
    auth = ApiKeyAuth(args.api_key, args.admin_api_key)
    lora_targets = tuple(engine.lora_targets)
    if args.served_model_name:
        model_id = args.served_model_name
    elif args.model_path and not os.path.isdir(args.model_path):
        model_id = args.model_path  # a Hub id: nicer than its snapshot folder's hash
    else:
        model_id = str(engine.model_name)
    model_aliases = {model_id, str(engine.model_name)}
    if args.model_path:
        model_aliases |= {args.model_path, os.path.basename(os.path.normpath(args.model_path))}
    created = int(time.time())
    images = ImageStore()
    public_paths = PublicPaths(
        args.lora_dirs, args.model_path, hidden={"hf-cache": hf_hub_cache_dir()}
    )
    public_url = PublicUrl(args.public_url, args.host, args.port)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        logger.info("serving %s (spatial factor %d)", model_id, spec.spatial_factor)
        if args.public_url is None and args.host in ("0.0.0.0", "::", ""):
            logger.info(
                "response_format=url links use the address each client connected to; set "
                "--public-url for the address clients should use"
            )
        try:
            yield
        finally:
            logger.info("shutting down: finishing queued work")
            await run_in_threadpool(scheduler.stop, args.graceful_shutdown_timeout_s)
            if shutdown_engine:
                await run_in_threadpool(engine.shutdown)
            logger.info("shutdown complete")

    app = FastAPI(title="sglang diffusion server", lifespan=lifespan)
    app.router.route_class = EnvelopeRoute
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.server_args = args
    app.state.images = images
    app.state.spec = spec
    app.state.public_paths = public_paths

    # ------------------------------------------------------------------ middleware / handlers
    app.add_middleware(AuthAndCount, auth=auth, metrics=metrics, router=app.router)
    # added last: the outermost, so every answer (a 401 too) has its id and its log line
    app.add_middleware(RequestLog, log_prompts=args.log_prompts)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        path = request.url.path
        path = path if len(path) <= 200 else path[:200] + "..."  # not a 60 KB echo
        if exc.status_code == 404:
            message = f"no route {request.method} {path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
        return JSONResponse(
            error_body(message, exc.status_code), exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError):
        message, param = schema_error_message(exc.errors(), None)
        return JSONResponse(error_body(message, 422, param=param, code="invalid_schema"), 422)

    # ------------------------------------------------------------------ routes
    ctx = RouteContext(
        scheduler=scheduler,
        spec=spec,
        model_id=model_id,
        model_aliases=frozenset(model_aliases),
        timeout_body_s=args.timeout_body_s or None,
        public_paths=public_paths,
        public_url=public_url,
        image_limits=ImageLimits(
            max_file_bytes=args.max_input_image_bytes,
            max_request_bytes=args.max_input_bytes,
            max_images=args.max_input_images,
        ),
        image_url_hosts=tuple(args.image_url_allowed_hosts),
    )
    add_image_routes(app, ctx, images, metrics)
    add_lora_routes(app, ctx, lora_targets, _hub_lora_fetcher(args))

    def model_card() -> ModelCard:
        return ModelCard(
            id=model_id,
            created=created,
            root=model_id,  # the served name: never the server's directory
            family=info.get("family"),
            pipeline_class=info.get("pipeline_class"),
            modality=spec.outputs,
            inputs=list(spec.inputs),
            required_inputs=list(spec.required_inputs),
            parameters=spec.parameters(),
            tp_sizes=info.get("tp_sizes"),
            parallel=info.get("parallel"),
            quantization=info.get("quantization"),
        )

    @app.get("/v1/models")
    async def models():
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """One model (OpenAI's ``models.retrieve``): the served model under any of its names."""
        ctx.check_model(model)
        return JSONResponse(model_card().model_dump())

    # /v1/videos: asynchronous video jobs (video models; 400 naming the modality otherwise)
    app.state.videos = add_video_routes(app, ctx)

    def unavailable(reason: str) -> JSONResponse:
        return JSONResponse(error_body(reason, 503), 503, headers={"Retry-After": "1"})

    # GET and HEAD: load balancers and Kubernetes probes use either
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        """Liveness: the engine is alive and makes progress (restart the replica if not)."""
        if await run_in_threadpool(scheduler.healthy):
            return JSONResponse({"status": "ok"})
        return unavailable(scheduler.unhealthy_reason() or "the server is shutting down")

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        """Readiness: healthy, the model loaded (the app exists only after it has) and the queue
        has room, so a load balancer sends new work elsewhere while this replica is full."""
        if not await run_in_threadpool(scheduler.healthy):
            return unavailable(scheduler.unhealthy_reason() or "the server is shutting down")
        depth = scheduler.queue_depth
        if depth >= scheduler.max_queue_size:
            return unavailable(f"the request queue is full ({depth} waiting)")
        return JSONResponse({"status": "ready", "queue_depth": depth})

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.set_queue_depth(scheduler.queue_depth)
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def resolve_max_image_size(requested: int | None, defaults: dict) -> int:
    """The server's largest side: ``--max-image-size``, which must not exceed the model's
    ``max_image_size`` (what its position tables cover); unset: 2048, or the model's if smaller.

    Raises:
        ValueError: ``requested`` is larger than the model's maximum (the server does not start).
    """
    model_max = defaults.get("max_image_size")
    if requested is None:
        return min(DEFAULT_MAX_IMAGE_SIZE, model_max or DEFAULT_MAX_IMAGE_SIZE)
    if model_max is not None and requested > model_max:
        raise ValueError(
            f"--max-image-size {requested} is larger than this model's maximum of {model_max} "
            f"pixels per side; use --max-image-size {model_max} or less"
        )
    return int(requested)


def resolve_max_pixel_steps(requested: int | None, defaults: dict) -> int | None:
    """The server's budget of ``n x num_frames x width x height x num_inference_steps`` per
    request: ``--max-pixel-steps`` (0: no bound, ``None``); unset: 1024x1024 x 256, or four
    times the model's default request when that is larger (a video model's default 81 frames
    at 480x832 and 40 steps alone cost about 5 such images)."""
    if requested is not None:
        return int(requested) or None
    d = defaults
    default_cost = (
        int(d.get("width") or 0) * int(d.get("height") or 0) * int(d.get("num_frames") or 1)
        * int(d.get("num_inference_steps") or 0)
    )  # fmt: skip
    return max(DEFAULT_MAX_PIXEL_STEPS, 4 * default_cost)


# ---------------------------------------------------------------------------------------------
# launch


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def load_startup_loras(engine: Any, server_args: ServerArgs) -> None:
    """Load and activate the ``--lora-path`` adapters (before the server accepts requests).

    They come from the operator's command line, so they are trusted: they load even from outside
    ``--lora-dir`` (relative paths are looked up in the ``--lora-dir`` roots first).

    Raises:
        whatever ``engine.set_lora`` raises (the server then does not start).
    """
    loras = server_args.startup_loras
    if not loras:
        return
    names = [n for n, _, _ in loras]
    paths = [p for _, p, _ in loras]
    strengths = [s for _, _, s in loras]
    t0 = time.perf_counter()
    targets = server_args.startup_lora_targets
    engine.set_lora(names, paths, target=targets, strength=strengths, trusted=True)
    logger.info("startup LoRA active: %s (%.2fs)", names, time.perf_counter() - t0)


def build_engine(server_args: ServerArgs) -> Any:
    """Create the ``DiffusionEngine`` for ``server_args`` (imports the runtime lazily)."""
    from sglang.multimodal_gen.runtime import DiffusionEngine

    return DiffusionEngine.from_args(server_args)


def launch_server(server_args: ServerArgs, engine: Any | None = None) -> None:
    """Start the engine (unless given), the startup adapters, then uvicorn; block until shutdown.

    SIGTERM / SIGINT: the server refuses new work (503) and uvicorn stops accepting connections;
    queued and running requests go on for up to ``graceful_shutdown_timeout_s`` in all (those
    still open then get 503), then the engine shuts down.
    """

    _configure_logging(server_args.log_level)
    logger.info("server args: %s", server_args.redacted())
    own_engine = engine is None
    if engine is None:
        from sglang.multimodal_gen.runtime.engine import check_device

        check_device(server_args.device)  # before the model loads: one clear line, exit 2
        engine = build_engine(server_args)
    try:
        # the app first: it refuses limits the model cannot serve before adapters load
        app = create_app(engine, server_args, shutdown_engine=own_engine)
        load_startup_loras(engine, server_args)
        scheduler = app.state.scheduler
        timeout = server_args.graceful_shutdown_timeout_s
        run_uvicorn(uvicorn_server(app, server_args, lambda: scheduler.begin_shutdown(timeout)))
    except BaseException:
        if own_engine:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine.shutdown() failed")
        raise
