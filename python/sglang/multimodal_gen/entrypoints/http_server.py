"""The OpenAI-compatible HTTP server: FastAPI app, request handling and ``launch_server``.

Routes (see ``docs/serving.md``)::

    POST /v1/images/generations     OpenAI Images API + seed, steps, guidance, negative_prompt, lora
    GET  /v1/images/files/{name}    images of response_format="url" (kept in memory, LRU)
    POST /v1/set_lora               load (if a path is given) and activate adapters globally
    POST /v1/unset_lora             deactivate (adapters stay loaded)
    POST /v1/unload_lora            free one adapter
    POST /v1/merge_lora_weights     merge the active composition into the weights
    POST /v1/unmerge_lora_weights   restore the base weights
    GET  /v1/list_loras             loaded adapters and the active composition
    GET  /v1/models                 the served model
    GET  /health                    200 while the engine serves, 503 otherwise (no auth)
    GET  /metrics                   Prometheus text format

The app only talks to the engine through a :class:`~.scheduler.Scheduler` (one thread, arrival
order). Request bodies are parsed here, not by FastAPI, so invalid JSON is a 400 that says where
(line and column), schema errors are a 422, and bad values a 400 naming the field; all in the
OpenAI error envelope, never with a stack trace.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.auth import ADMIN_PATHS, ApiKeyAuth
from sglang.multimodal_gen.entrypoints.metrics import ServerMetrics
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception, error_body
from sglang.multimodal_gen.entrypoints.protocol import (
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    Limits,
    ModelCard,
    ModelList,
    SetLoRARequest,
    StatusResponse,
    TargetRequest,
    UnloadLoRARequest,
    validate_generation,
    validate_set_lora,
    validate_target,
)
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.errors import (
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
    SGLangError,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


# ---------------------------------------------------------------------------------------------
# body parsing


class BodyError(InvalidRequestError):
    """The body is not a JSON document (HTTP 400, ``code="invalid_json"``)."""


class ClientGoneError(SGLangError):
    """The client closed the connection before its answer was ready (status 499, not sent)."""

    status_code = 499
    error_type = "client_closed_request"


class SchemaError(InvalidRequestError):
    """The JSON does not match the endpoint's schema (HTTP 422)."""

    status_code = 422


def _json_hint(text: str, pos: int) -> str:
    """A hint for the two mistakes users make most: a trailing comma, a shell continuation."""
    before = text[:pos].rstrip()
    if "`" in text[max(0, pos - 2) : pos + 1] or (before.endswith("`")):
        return " (a shell line-continuation backtick ` is not part of JSON)"
    if before.endswith(",") and text[pos : pos + 1] in ("}", "]"):
        return " (trailing comma before the closing bracket; remove it)"
    return ""


def parse_json_body(raw: bytes, model: type[BaseModel], *, allow_empty: bool = False) -> Any:
    """Decode ``raw`` as JSON and validate it against ``model``.

    Raises:
        BodyError: 400; invalid UTF-8 or JSON, with line and column of the first error.
        SchemaError: 422; the JSON does not fit ``model`` (message lists the fields at fault).
    """
    if len(raw) > MAX_BODY_BYTES:
        raise BodyError(f"request body larger than {MAX_BODY_BYTES} bytes", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8 ({e.reason})", code="invalid_json") from e
    if not text.strip():
        if not allow_empty:
            raise BodyError("request body is empty; expected a JSON object", code="invalid_json")
        text = "{}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"invalid JSON in request body at line {e.lineno}, column {e.colno}: "
            f"{e.msg}{_json_hint(text, e.pos)}",
            code="invalid_json",
        ) from e
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        parts, first_param = [], None
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
            first_param = first_param or loc
            if err.get("type") == "extra_forbidden":
                parts.append(f"{loc}: unknown field")
            else:
                parts.append(f"{loc}: {err.get('msg')}")
        raise SchemaError(
            "request body does not match the schema: " + "; ".join(parts),
            param=first_param,
            code="invalid_schema",
        ) from e


# ---------------------------------------------------------------------------------------------
# images


def encode_image(image: Any, output_format: str, compression: int | None) -> bytes:
    """Encode a PIL image as PNG (lossless, ``compression`` ignored), JPEG or WebP.

    ``compression`` is the OpenAI ``output_compression`` in [0, 100]; like OpenAI's (default 100 =
    best), it is used as the JPEG/WebP quality (default 95 here).
    """
    buf = io.BytesIO()
    quality = 95 if compression is None else int(compression)
    if output_format == "png":
        image.save(buf, format="PNG")
    elif output_format == "jpeg":
        image.convert("RGB").save(buf, format="JPEG", quality=quality)
    else:
        image.save(buf, format="WEBP", quality=quality)
    return buf.getvalue()


class ImageStore:
    """In-memory store for ``response_format="url"``: random names, LRU, time-limited.

    Args:
        capacity: images kept at most (oldest dropped first).
        ttl_s: seconds an image stays available.
    """

    def __init__(self, capacity: int = 256, ttl_s: float = 3600.0):
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[bytes, str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str) -> str:
        """Store ``data``; return its file name (``<random>.<ext>``)."""
        name = f"{secrets.token_urlsafe(18)}.{output_format}"
        with self._lock:
            self._items[name] = (data, _MEDIA_TYPES[output_format], time.monotonic())
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return name

    def get(self, name: str) -> tuple[bytes, str] | None:
        """``(bytes, media_type)`` or ``None`` when unknown or expired."""
        with self._lock:
            item = self._items.get(name)
            if item is None:
                return None
            if time.monotonic() - item[2] > self.ttl_s:
                del self._items[name]
                return None
            return item[0], item[1]


# ---------------------------------------------------------------------------------------------
# app


def _error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = describe_exception(exc)
    return JSONResponse(body, status_code=status, headers=headers)


class _EnvelopeRoute(APIRoute):
    """A route whose handler errors of any kind become OpenAI error envelopes."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError):
                raise  # handled by the app's exception handlers
            except Exception as e:
                return _error_response(e)

        return guarded


_KNOWN_ENDPOINTS = frozenset(
    {
        "/v1/images/generations",
        "/v1/models",
        "/v1/list_loras",
        "/health",
        "/metrics",
    }
    | ADMIN_PATHS
)


def _endpoint_label(path: str) -> str:
    if path in _KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/images/files/"):
        return "/v1/images/files/{name}"
    return "other"


class _AuthAndCount:
    """ASGI middleware: API-key check before anything else, then count the request by status.

    A plain ASGI class rather than ``@app.middleware("http")``, so the handlers receive the
    server's own ``receive`` and can notice a client disconnecting (``request.is_disconnected``).
    """

    def __init__(self, app: Any, auth: ApiKeyAuth, metrics: ServerMetrics):
        self.app = app
        self.auth = auth
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        authorization = None
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                authorization = value.decode("latin-1")
                break
        status = 500
        try:
            reason = self.auth.check(path, authorization)
            if reason is not None:
                status = 401
                body = error_body(reason, 401, param=None, code="invalid_api_key")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return

            async def send_and_note(message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.observe_request(_endpoint_label(path), status)


def create_app(
    engine: Any,
    server_args: ServerArgs | None = None,
    *,
    request_factory: Callable[..., Any] | None = None,
    shutdown_engine: bool = False,
) -> FastAPI:
    """Build the FastAPI app in front of ``engine``.

    Args:
        engine: a ``DiffusionEngine`` (or an object with the same methods and properties:
            ``generate``, ``set_lora``, ``unset_lora``, ``unload_lora``, ``merge_lora_weights``,
            ``unmerge_lora_weights``, ``list_loras``, ``is_alive``, ``shutdown``, ``model_name``,
            ``spatial_factor``, ``lora_targets``). Only the app's scheduler thread calls it.
        server_args: limits, keys and names (defaults: ``ServerArgs()``).
        request_factory: builds the engine's request object (default ``GenerationRequest``).
        shutdown_engine: call ``engine.shutdown()`` when the app stops.

    Returns:
        The app; ``app.state`` holds ``scheduler``, ``metrics``, ``engine`` and ``server_args``.
    """
    args = server_args or ServerArgs()
    metrics = ServerMetrics()
    scheduler = Scheduler(
        engine, args.max_queue_size, metrics=metrics, request_factory=request_factory
    )
    auth = ApiKeyAuth(args.api_key, args.admin_api_key)
    info = dict(getattr(engine, "model_info", {}) or {})
    family_max = (info.get("defaults") or {}).get("max_image_size")
    limits = Limits(
        spatial_factor=int(engine.spatial_factor),
        # never more than the model's position tables cover
        max_image_size=min(args.max_image_size, family_max or args.max_image_size),
        max_images=args.max_images_per_request,
        max_steps=args.max_inference_steps,
    )
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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        logger.info("serving %s (spatial factor %d)", model_id, limits.spatial_factor)
        try:
            yield
        finally:
            logger.info("shutting down: finishing queued work")
            await run_in_threadpool(scheduler.stop, args.graceful_shutdown_timeout_s)
            if shutdown_engine:
                await run_in_threadpool(engine.shutdown)
            logger.info("shutdown complete")

    app = FastAPI(title="sglang diffusion server", lifespan=lifespan)
    app.router.route_class = _EnvelopeRoute
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.server_args = args
    app.state.images = images

    # ------------------------------------------------------------------ middleware / handlers
    app.add_middleware(_AuthAndCount, auth=auth, metrics=metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(
            error_body(message, exc.status_code), exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(f"invalid request: {exc.errors()[:3]}", 422), 422)

    # ------------------------------------------------------------------ helpers
    async def wait_for(future, request: Request | None = None) -> Any:
        """Await a scheduler future.

        503 instead of hanging if the engine dies meanwhile. With ``request`` (generations), a
        client that disconnects while its work still waits in the queue has it dropped.
        """
        afut = asyncio.wrap_future(future)
        next_alive_check = time.monotonic() + 1.0
        try:
            while True:
                done, _ = await asyncio.wait({afut}, timeout=0.25)
                if done:
                    return afut.result()
                if request is not None and await request.is_disconnected():
                    dropped = future.cancel()  # False once it runs: the result is discarded
                    raise ClientGoneError(
                        "the client disconnected"
                        + ("; its queued request was dropped" if dropped else "")
                    )
                if time.monotonic() >= next_alive_check:
                    next_alive_check = time.monotonic() + 1.0
                    if not await run_in_threadpool(scheduler.engine_alive):
                        future.cancel()
                        raise EngineDeadError(
                            f"the engine is not available: {scheduler.dead_reason or 'not alive'}"
                        )
        except asyncio.CancelledError:
            future.cancel()  # the handler itself was cancelled: drop the work if not started
            raise

    def check_model(model: str | None) -> None:
        if model is not None and model not in model_aliases:
            raise NotFoundError(
                f"model {model!r} is not served here; this server serves {model_id!r}",
                param="model",
                code="model_not_found",
            )

    def status(message: str, detail: Any = None) -> dict:
        return StatusResponse(message=message, detail=detail).model_dump()

    # ------------------------------------------------------------------ routes
    @app.post("/v1/images/generations")
    async def images_generations(request: Request):
        t0 = time.perf_counter()
        req = parse_json_body(await request.body(), ImageGenerationRequest)
        check_model(req.model)
        params = validate_generation(req, limits)
        if params.engine_kwargs.get("seed") is None:
            # drawn here so the response can report it and the image can be reproduced
            params.engine_kwargs["seed"] = secrets.randbits(63)
        pil_images = await wait_for(scheduler.submit_generation(**params.engine_kwargs), request)

        def encode_all() -> list[bytes]:
            return [
                encode_image(img, params.output_format, params.output_compression)
                for img in pil_images
            ]

        blobs = await run_in_threadpool(encode_all)
        data = []
        for blob in blobs:
            if params.response_format == "url":
                name = images.put(blob, params.output_format)
                data.append(ImageData(url=f"{str(request.base_url)}v1/images/files/{name}"))
            else:
                data.append(ImageData(b64_json=base64.b64encode(blob).decode("ascii")))
        body = ImageGenerationResponse(
            created=int(time.time()),
            data=data,
            output_format=params.output_format,
            size=params.size,
            seed=params.engine_kwargs.get("seed"),
        ).model_dump(exclude_none=True)
        metrics.images.inc(len(data))
        metrics.e2e.observe(time.perf_counter() - t0)
        return JSONResponse(body)

    @app.get("/v1/images/files/{name}")
    async def image_file(name: str):
        item = images.get(name)
        if item is None:
            raise NotFoundError(f"image {name!r} does not exist or has expired", param="name")
        return Response(content=item[0], media_type=item[1])

    @app.post("/v1/set_lora")
    async def set_lora(request: Request):
        req = parse_json_body(await request.body(), SetLoRARequest)
        kwargs = validate_set_lora(req, lora_targets)
        result = await wait_for(scheduler.submit_call("set_lora", **kwargs))
        names = req.lora_nickname if isinstance(req.lora_nickname, list) else [req.lora_nickname]
        return status(f"active on target {req.target!r}: {', '.join(names)}", result)

    @app.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        req = parse_json_body(await request.body(), TargetRequest, allow_empty=True)
        target = validate_target(req.target, lora_targets)
        result = await wait_for(scheduler.submit_call("unset_lora", target=target))
        return status(f"LoRA deactivated on target {target!r} (adapters stay loaded)", result)

    @app.post("/v1/unload_lora")
    async def unload_lora(request: Request):
        req = parse_json_body(await request.body(), UnloadLoRARequest)
        result = await wait_for(scheduler.submit_call("unload_lora", req.lora_nickname))
        return status(f"unloaded {req.lora_nickname!r}", result)

    @app.post("/v1/merge_lora_weights")
    async def merge_lora_weights(request: Request):
        req = parse_json_body(await request.body(), TargetRequest, allow_empty=True)
        target = validate_target(req.target, lora_targets)
        result = await wait_for(scheduler.submit_call("merge_lora_weights", target=target))
        return status(f"merged the active LoRA into target {target!r}", result)

    @app.post("/v1/unmerge_lora_weights")
    async def unmerge_lora_weights(request: Request):
        req = parse_json_body(await request.body(), TargetRequest, allow_empty=True)
        target = validate_target(req.target, lora_targets)
        result = await wait_for(scheduler.submit_call("unmerge_lora_weights", target=target))
        return status(f"restored the base weights of target {target!r}", result)

    @app.get("/v1/list_loras")
    async def list_loras():
        return JSONResponse(await wait_for(scheduler.submit_call("list_loras")))

    @app.get("/v1/models")
    async def models():
        card = ModelCard(
            id=model_id,
            created=created,
            root=args.model_path,
            family=info.get("family"),
            pipeline_class=info.get("pipeline_class"),
            modality=(info.get("defaults") or {}).get("modality"),
            tp_sizes=info.get("tp_sizes"),
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health():
        if await run_in_threadpool(scheduler.healthy):
            return JSONResponse({"status": "ok"})
        reason = scheduler.dead_reason or "the server is shutting down"
        return JSONResponse(error_body(reason, 503), 503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.set_queue_depth(scheduler.queue_depth)
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


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
    engine.set_lora(names, paths, target="all", strength=strengths, trusted=True)
    logger.info("startup LoRA active: %s (%.2fs)", names, time.perf_counter() - t0)


def build_engine(server_args: ServerArgs) -> Any:
    """Create the ``DiffusionEngine`` for ``server_args`` (imports the runtime lazily)."""
    from sglang.multimodal_gen.runtime import DiffusionEngine

    return DiffusionEngine.from_args(server_args)


def _run_uvicorn(server: Any) -> None:
    """Run uvicorn; a SIGTERM/SIGINT that ended a graceful shutdown ends the process with 0.

    uvicorn re-raises the signal it caught once it has shut down, so the process would die from it;
    with these handlers installed it is simply noted, and ``sglang serve`` exits normally.
    """
    import signal

    got: list[int] = []

    def note(signum, frame):
        got.append(signum)

    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    else:
        previous = {}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        logger.info("stopped by signal %d after a graceful shutdown", got[-1])


def launch_server(server_args: ServerArgs, engine: Any | None = None) -> None:
    """Start the engine (unless given), the startup adapters, then uvicorn; block until shutdown.

    SIGTERM / SIGINT: uvicorn stops accepting connections and waits for open requests (up to
    ``graceful_shutdown_timeout_s``); then the scheduler drains and the engine shuts down.
    """
    import uvicorn

    _configure_logging(server_args.log_level)
    logger.info("server args: %s", server_args.redacted())
    own_engine = engine is None
    if engine is None:
        engine = build_engine(server_args)
    try:
        load_startup_loras(engine, server_args)
        app = create_app(engine, server_args, shutdown_engine=own_engine)
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level.lower(),
            access_log=server_args.log_level.lower() == "debug",
            timeout_graceful_shutdown=int(server_args.graceful_shutdown_timeout_s),
        )
        _run_uvicorn(uvicorn.Server(config))
    except BaseException:
        if own_engine:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine.shutdown() failed")
        raise
