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
    GET  /health                    liveness: 200 while the engine serves, 503 otherwise (no auth)
    GET  /ready                     readiness: /health and room in the queue, else 503 (no auth)
    GET  /metrics                   Prometheus text format

The app only talks to the engine through a :class:`~.scheduler.Scheduler` (one thread, arrival
order). Request bodies are parsed here, not by FastAPI, so invalid JSON is a 400 that says where
(line and column), schema errors are a 422, and bad values a 400 naming the field; all in the
OpenAI error envelope, never with a stack trace.

Nothing a client sends is read or kept without a bound: a body is refused with 413 from its
``Content-Length`` before it is read, or as soon as a chunked body passes the limit; a body that
does not arrive in ``timeout_body_s`` gets 408; request headers must arrive within
``timeout_headers_s`` of the connection opening (or of the previous answer); connections above
``limit_concurrency`` are answered 503 and closed at once (:func:`uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
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

from sglang.multimodal_gen.configs.server_args import DEFAULT_MAX_IMAGE_SIZE, ServerArgs
from sglang.multimodal_gen.engine_ops import OPS
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
    schema_error_message,
    validate_generation,
    validate_set_lora,
    validate_target,
)
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler, default_request_factory
from sglang.multimodal_gen.entrypoints.videos import add_video_routes
from sglang.multimodal_gen.errors import (
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
    SGLangError,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
#: Deepest JSON nesting accepted (the schemas need 3: body, ``lora`` list, adapter object).
MAX_JSON_DEPTH = 32
#: Longest integer literal accepted in a body (no field takes more than 20 digits).
MAX_INT_DIGITS = 100
# ``\uD800``-``\uDFFF`` escapes: only bodies that contain one are walked for lone surrogates
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
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


class _LongInt(str):
    """An integer literal longer than :data:`MAX_INT_DIGITS` (kept as text, refused after parsing;
    ``int()`` of 4,300+ digits raises a library error)."""


def _parse_int(text: str) -> int | _LongInt:
    if len(text) > MAX_INT_DIGITS:
        return _LongInt(text)
    return int(text)


def _nested_too_deep_key(text: str, limit: int) -> str | None:
    """The top-level key under which ``text`` nests deeper than ``limit`` (None: at the top)."""
    depth, key, i, n = 0, None, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if depth == 1 and text[j + 1 : j + 40].lstrip().startswith(":"):
                key = text[i + 1 : j]
            i = j + 1
            continue
        if c in "[{":
            depth += 1
            if depth > limit:
                return key
        elif c in "]}":
            depth -= 1
        i += 1
    return key


def _check_parsed(obj: Any, walk: bool) -> None:
    """Refuse what JSON allows but no field can take: nesting deeper than
    :data:`MAX_JSON_DEPTH`, lone UTF-16 surrogates (``"\\ud800"``), integers of more than
    :data:`MAX_INT_DIGITS` digits. ``walk=False``: nothing of the kind can be there (checked on
    the raw text), so the walk is skipped.

    Raises:
        BodyError: 400, ``param`` the top-level field holding the value.
    """
    if not walk:
        return
    stack: list[tuple[Any, tuple, int]] = [(obj, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        param = str(path[0]) if path else None
        where = ".".join(str(p) for p in path) or "the body"
        if depth > MAX_JSON_DEPTH:
            raise BodyError(
                f"{f'field {param!r}' if param else 'the body'} is nested more than "
                f"{MAX_JSON_DEPTH} levels deep; no field takes that",
                param=param,
                code="invalid_json",
            )
        if isinstance(value, _LongInt):
            raise BodyError(
                f"{where} is an integer of {len(value.lstrip('-'))} digits; no field takes "
                f"more than {MAX_INT_DIGITS}",
                param=param,
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BodyError(
                    f"{where} is not valid Unicode text: character {e.start} is a lone UTF-16 "
                    f"surrogate ({ascii(value[e.start])}); send UTF-8 text or paired "
                    "\\uXXXX escapes",
                    param=param,
                    code="invalid_json",
                ) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path, depth + 1))  # keys are checked as text at their level
                stack.append((v, (*path, k), depth + 1))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((v, (*path, i), depth + 1))


def parse_json_body(raw: bytes, model: type[BaseModel], *, allow_empty: bool = False) -> Any:
    """Decode ``raw`` as JSON and validate it against ``model``.

    Raises:
        PayloadTooLargeError: 413; more than :data:`MAX_BODY_BYTES`.
        BodyError: 400; invalid UTF-8 or JSON, with line and column of the first error; nesting,
            integers or text no field can take (:func:`_check_parsed`).
        SchemaError: 422; the JSON does not fit ``model`` (one sentence per field at fault,
            :func:`~.protocol.schema_error_message`).
    """
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(
            f"request body larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            f"request body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_json"
        ) from e
    if not text.strip():
        if not allow_empty:
            raise BodyError("request body is empty; expected a JSON object", code="invalid_json")
        text = "{}"
    long_ints: list[bool] = []

    def parse_int(digits: str) -> int | _LongInt:
        out = _parse_int(digits)
        if isinstance(out, _LongInt):
            long_ints.append(True)
        return out

    try:
        obj = json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"invalid JSON in request body at line {e.lineno}, column {e.colno}: "
            f"{e.msg}{_json_hint(text, e.pos)}",
            code="invalid_json",
        ) from e
    except RecursionError:
        key = _nested_too_deep_key(text, MAX_JSON_DEPTH)
        where = f"field {key!r}" if key else "the body"
        raise BodyError(
            f"{where} is nested more than {MAX_JSON_DEPTH} levels deep; no field takes that",
            param=key,
            code="invalid_json",
        ) from None
    _check_parsed(
        obj,
        walk=bool(long_ints)
        or _SURROGATE_ESCAPE.search(text) is not None
        or text.count("[") + text.count("{") > MAX_JSON_DEPTH,
    )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = schema_error_message(e.errors(), model)
        raise SchemaError(message, param=param, code="invalid_schema") from e


async def read_body(
    request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float | None = None
) -> bytes:
    """The request body, read with bounds on its size and on the time it takes to arrive.

    A ``Content-Length`` above ``limit`` is refused before anything is read; a body without one
    (chunked) is refused as soon as it passes ``limit``.

    Raises:
        PayloadTooLargeError: 413.
        RequestTimeoutError: 408; the body did not arrive within ``timeout_s``.
        BodyError: 400; a ``Content-Length`` that is not a number.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise BodyError(f"invalid Content-Length header {declared[:40]!r}")
        if int(declared) > limit:
            raise PayloadTooLargeError(
                f"request body of {int(declared)} bytes (Content-Length) is larger than the "
                f"limit of {limit} bytes",
                code="request_too_large",
            )
    chunks: list[bytes] = []
    total = 0

    async def receive_all() -> None:
        nonlocal total
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLargeError(
                    f"request body larger than the limit of {limit} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive_all(), timeout_s)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout_s:g} s ({total} bytes received)",
            code="request_timeout",
        ) from None
    return b"".join(chunks)


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
        "/ready",
        "/metrics",
    }
    | ADMIN_PATHS
    | {op.path for op in OPS.values() if op.path}
)


def _endpoint_label(path: str) -> str:
    if path in _KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/images/files/"):
        return "/v1/images/files/{name}"
    if path == "/v1/videos" or path.startswith("/v1/videos/"):
        return "/v1/videos" if path == "/v1/videos" else "/v1/videos/{id}"
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
    info = dict(getattr(engine, "model_info", {}) or {})
    defaults = dict(info.get("defaults") or getattr(engine, "defaults", None) or {})
    limits = Limits(
        spatial_factor=int(engine.spatial_factor),
        max_image_size=resolve_max_image_size(args.max_image_size, defaults),
        max_images=args.max_images_per_request,
        max_steps=args.max_inference_steps,
        max_pixel_steps=args.max_pixel_steps or None,
    )
    metrics = ServerMetrics()
    scheduler = Scheduler(
        engine,
        args.max_queue_size,
        metrics=metrics,
        request_factory=request_factory,
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
    app.state.limits = limits

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
        message, param = schema_error_message(exc.errors(), None)
        return JSONResponse(error_body(message, 422, param=param, code="invalid_schema"), 422)

    # ------------------------------------------------------------------ helpers
    async def request_body(request: Request) -> bytes:
        return await read_body(request, MAX_BODY_BYTES, args.timeout_body_s or None)

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
        req = parse_json_body(await request_body(request), ImageGenerationRequest)
        check_model(req.model)
        params = validate_generation(req, limits, defaults)
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
        req = parse_json_body(await request_body(request), SetLoRARequest)
        kwargs = validate_set_lora(req, lora_targets)
        result = await wait_for(scheduler.submit_call("set_lora", **kwargs))
        names = req.lora_nickname if isinstance(req.lora_nickname, list) else [req.lora_nickname]
        return status(f"active on target {req.target!r}: {', '.join(names)}", result)

    @app.post("/v1/unset_lora")
    async def unset_lora(request: Request):
        req = parse_json_body(await request_body(request), TargetRequest, allow_empty=True)
        target = validate_target(req.target, lora_targets)
        result = await wait_for(scheduler.submit_call("unset_lora", target=target))
        return status(f"LoRA deactivated on target {target!r} (adapters stay loaded)", result)

    @app.post("/v1/unload_lora")
    async def unload_lora(request: Request):
        req = parse_json_body(await request_body(request), UnloadLoRARequest)
        result = await wait_for(scheduler.submit_call("unload_lora", req.lora_nickname))
        return status(f"unloaded {req.lora_nickname!r}", result)

    @app.post("/v1/merge_lora_weights")
    async def merge_lora_weights(request: Request):
        req = parse_json_body(await request_body(request), TargetRequest, allow_empty=True)
        target = validate_target(req.target, lora_targets)
        result = await wait_for(scheduler.submit_call("merge_lora_weights", target=target))
        return status(f"merged the active LoRA into target {target!r}", result)

    @app.post("/v1/unmerge_lora_weights")
    async def unmerge_lora_weights(request: Request):
        req = parse_json_body(await request_body(request), TargetRequest, allow_empty=True)
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
            parallel=info.get("parallel"),
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    # /v1/videos: asynchronous video jobs (video models; 400 naming the modality otherwise)
    app.state.videos = add_video_routes(
        app,
        scheduler=scheduler,
        read_body=request_body,
        parse_body=parse_json_body,
        check_model=check_model,
        limits=limits,
        defaults=defaults,
        modality=str(defaults.get("modality", "image")),
        model_id=model_id,
        request_factory=request_factory or default_request_factory(),
    )

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

    _check_op_routes(app)
    return app


def _check_op_routes(app: FastAPI) -> None:
    """Every route of the engine op table is served, with its method (a missing one is a bug)."""
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or ()}
    missing = [op.name for op in OPS.values() if op.path and (op.method, op.path) not in served]
    if missing:
        raise RuntimeError(f"engine ops without their HTTP route: {missing}")


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


# ---------------------------------------------------------------------------------------------
# connections


def _raw_error_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer with the error envelope that closes the connection (written
    by the protocol before any request is parsed, so without the app)."""
    body = json.dumps(error_body(message, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return (head + "\r\n").encode() + body


def guarded_protocol_class(timeout_headers_s: float | None, limit_concurrency: int | None):
    """uvicorn's h11 protocol with the two bounds uvicorn lacks.

    - ``timeout_headers_s``: the request line and headers must arrive within this many seconds
      of the connection opening or of the previous answer on it (uvicorn's own
      ``timeout_keep_alive`` only starts after an answer, and any byte resets it), else the
      connection gets 408 and is closed: idle or trickling sockets do not pile up.
    - ``limit_concurrency``: a connection opened while that many are open gets 503 and is closed
      at once, so file descriptors stay bounded.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _raw_error_response(503, "Service Unavailable", "too many open connections; retry later")
    slow = _raw_error_response(
        408, "Request Timeout", f"request headers did not arrive within {timeout_headers_s} s"
    )

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if limit_concurrency is not None and len(self.connections) > limit_concurrency:
                transport.write(busy)
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if timeout_headers_s:
                self._header_timer = self.loop.call_later(timeout_headers_s, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.write(slow)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers, on a kept-alive socket

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_config(app: Any, server_args: ServerArgs, **overrides: Any) -> Any:
    """The ``uvicorn.Config`` of ``app`` under ``server_args``' connection bounds
    (``timeout_keep_alive_s``, ``timeout_headers_s``, ``limit_concurrency``)."""
    import uvicorn

    kwargs = dict(
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        access_log=server_args.log_level.lower() == "debug",
        timeout_graceful_shutdown=int(server_args.graceful_shutdown_timeout_s),
        timeout_keep_alive=max(1, int(server_args.timeout_keep_alive_s)),
        http=guarded_protocol_class(
            server_args.timeout_headers_s or None, server_args.limit_concurrency or None
        ),
    )
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


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
        from sglang.multimodal_gen.runtime.engine import check_device

        check_device(server_args.device)  # before the model loads: one clear line, exit 2
        engine = build_engine(server_args)
    try:
        # the app first: it refuses limits the model cannot serve before adapters load
        app = create_app(engine, server_args, shutdown_engine=own_engine)
        load_startup_loras(engine, server_args)
        _run_uvicorn(uvicorn.Server(uvicorn_config(app, server_args)))
    except BaseException:
        if own_engine:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine.shutdown() failed")
        raise
